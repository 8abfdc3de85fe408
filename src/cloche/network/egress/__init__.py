"""Egress: sessions reach the hosts a policy names, through a proxy on the host.

    policy   the server's ceiling (--egress-policy): named policies of host rules and limits
    guard    where a connection may go: names resolved on the host, addresses checked
    proxy    one session's door: HTTP and CONNECT on a unix socket its sandbox reaches
    secrets  --secrets: placeholders in the sandbox, values put into requests on the host
    tls      the per-server CA for the hosts that carry secrets (only those are intercepted)
    service  a server's policies, its sessions' doors, and the audit file (JSON lines)

The sandbox keeps no network of its own: `sandbox/` gives it the socket, and the kernel
listens on its loopback and sets the proxy variables.
"""
