"""The host's side of the sandboxes' network: a sandbox has none, only doors.

A door is a unix socket of the host in the sandbox's door directory (`/run/cloche` inside),
which the sandbox may connect to (`runsc --host-uds=open`); nothing else of the host is
reachable from inside, and nothing outside reaches in except through a door.

    egress   out: the hosts a policy names, through a proxy on the host (`door.sock`)
    ports    in: servers listening on the sandbox's loopback, reached by the host over
             connections the sandbox's relay opens to it (`ports.sock`)
    splice   bytes moved from socket to socket in the kernel, for both
    door_socket  a door's listening socket (egress's, ports', and the process supervisor's,
             `procd.sock`, which `cloche.sessions.supervisor_link` holds)

The sandbox's side of each is the kernel's (`cloche.kernel.egress`, `cloche.kernel.ports`);
`sandbox/` only gives a sandbox its door directory.
"""
