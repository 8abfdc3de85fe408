"""Packages for live sessions: the host resolves, fetches and unpacks wheels; the sandbox,
which has no network, only ever sees the files.

    requirements  what a session may ask for (names and versions, never URLs or options)
    resolver      pip, run as a tool in a subprocess: which wheels, for the sandbox's Python
    cache         the shared wheel cache (content-addressed by sha256), filled by pip download
    unpack        a wheel's files into a session's site directory, refusing zip-slip
    installer     all of it for one session, within the policy and the size limit
    bridge        the kernel's `%pip install` requests over its channel
"""
