"""Volumes: tenants' named directories that outlive sessions, each held to its size.

`store` keeps them under --volumes-dir (made, found again at start, leased, deleted);
`quota` holds each to its size (an ext4 image, loop-mounted while in use); `files` reaches
their files without a session, following no symlink; `paths` checks where a session
mounts them. `sandbox/` binds a lease's directory into a sandbox like any bind mount, and
`sessions/` resolves names to leases: no front end touches a volume's directory.
"""
