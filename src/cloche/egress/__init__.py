"""Egress: sessions reach the hosts a policy names, through a proxy on the host.

    policy   the server's ceiling (--egress-policy): named policies of host rules and limits
    guard    where a connection may go: names resolved on the host, addresses checked
    proxy    one session's door: HTTP and CONNECT on a unix socket its sandbox reaches
    audit    a JSON line per connection and per request, in a file rotated by size

The sandbox keeps no network of its own: `sandbox/` gives it the socket, and the kernel
listens on its loopback and sets the proxy variables.
"""
