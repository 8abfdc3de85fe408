"""Ports: servers listening on a sandbox's loopback, reached from the host.

    door   one session's ports door: the connections its sandbox's relay opens to the
           host, taken one per connection to a server inside; kept-alive ones reused
    wire   HTTP/1.1 written afresh to a server inside, and its answer read with bounds

The sandbox's side is the kernel's (`cloche.kernel.ports`); the front end that serves
ports to clients (routes, previews, websockets) is `cloche.server.http.ports`.
"""
