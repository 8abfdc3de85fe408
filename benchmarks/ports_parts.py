"""The programs of bench_ports.py: the app (run in sessions and on the host), the floors'
programs run in a session, the clients, and the raw HTTP client used on both sides.

- APP `PORT`: stdlib HTTP/1.1, keep-alive, TCP_NODELAY (as dev servers set it: else each
  small body waits ~40 ms for the peer's delayed ACK), `GET /mib/N` sends N MiB with
  sendfile, any other GET 2 bytes.
- FLOOR_RELAY `DOOR`: the sandbox's own relay (`cloche.kernel.ports.Relay`) driven by hand,
  connecting to a door of the bench's: the path without cloche's front end.
- DOOR_APP `DOOR`: the app's own handler serving connections it makes to a door of the
  bench's: a server reached with no relay and no loopback TCP (the unix socket between the
  host and gVisor alone).
- IN_SANDBOX `PORT COUNT MIB`: the raw client inside the session, to the app on its
  loopback: the latencies of COUNT requests and a MIB MiB download (MIB 0: none), as JSON.
- CLIENT, MANY: httpx in a fresh Python of the host (one client for both sides).
"""

from __future__ import annotations

import inspect
import socket
import textwrap
import time

APP = textwrap.dedent(
    """
    import http.server, socket, sys, tempfile
    BLOB = tempfile.TemporaryFile()  # sent with sendfile(2)
    BLOB.write(b"x" * (16 << 20))
    BLOB.flush()
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True
        def do_GET(self):
            mib = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/mib/") else 0
            self.send_response(200)
            self.send_header("Content-Length", str(mib << 20 if mib else 2))
            self.end_headers()
            if not mib:
                self.wfile.write(b"ok")
                return
            self.wfile.flush()
            left = mib << 20
            while left:
                sent = self.connection.sendfile(BLOB, 0, min(left, 16 << 20))
                if not sent:
                    break
                left -= sent
        def log_message(self, *args):
            pass
    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 128
        allow_reuse_address = True
        def handle_error(self, request, client_address):
            pass  # a client that stops reading (the many-at-once phase) resets its connection
    if __name__ == "__main__":
        server = Server(("127.0.0.1", int(sys.argv[1])), Handler)
        print(server.server_address[1], flush=True)
        server.serve_forever()
    """
)
FLOOR_RELAY = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "/opt/cloche")
    from cloche.kernel import ports
    relay = ports.Relay()
    opened = relay.handle({"op": "ports.open", "door": sys.argv[1], "spare": 2})
    print(json.dumps(opened), flush=True)
    while True:
        relay.step(relay.timeout())
    """
)
DOOR_APP = textwrap.dedent(
    """
    import socket, sys, threading
    from app import Handler
    class OnTheDoor(Handler):
        disable_nagle_algorithm = False  # a unix socket has no Nagle
    def serve():
        while True:
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(sys.argv[1])
            try:
                OnTheDoor(sock, ("door", 0), None)  # serves the connection until it ends
            except OSError:
                pass
            sock.close()
    for _ in range(2):  # two connections wait at the door
        threading.Thread(target=serve, daemon=True).start()
    threading.Event().wait()
    """
)
CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import httpx
    def latencies(url, count, headers):
        taken = []
        with httpx.Client(headers=headers, timeout=600) as client:
            client.get(url).read()  # the connection, kept alive from now on
            for _ in range(count):
                started = time.perf_counter()
                client.get(url).read()
                taken.append((time.perf_counter() - started) * 1000)
        return taken
    def download(url, headers):
        with httpx.Client(headers=headers, timeout=600) as client:
            started = time.perf_counter()
            size = 0
            with client.stream("GET", url) as answer:
                for piece in answer.iter_raw(1 << 20):
                    size += len(piece)
            return size / (1 << 20) / (time.perf_counter() - started)
    print(json.dumps(eval(sys.argv[1])))
    """
)
MANY = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import httpx
    async def one(client, url, until):
        trace = [[time.monotonic(), 0.0]]
        try:
            async with client.stream("GET", url) as answer:
                answer.raise_for_status()
                got = 0
                async for piece in answer.aiter_raw():  # as it comes: the first byte timed
                    got += len(piece)
                    trace.append([time.monotonic(), got / (1 << 20)])
                    if time.monotonic() >= until:
                        break
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return trace
    async def main(urls, seconds, headers):
        limits = httpx.Limits(max_connections=len(urls) + 10)
        async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as client:
            until = time.monotonic() + seconds
            return await asyncio.gather(*(one(client, u, until) for u in urls))
    urls, seconds, headers = json.loads(sys.argv[1])
    print(json.dumps(asyncio.run(main(urls, seconds, headers))))
    """
)


def raw_loop(sock: socket.socket, first: bytes, path: str, count: int) -> list[float]:
    """GETs of path on one connection (after first, a relay's `C <port>` line, answered
    `K`); the times of count of them after one more, in ms (count 0: the one alone)."""
    sock.settimeout(600)
    if first:
        sock.sendall(first)
        if sock.recv(2) != b"K\n":
            raise RuntimeError("the relay did not connect")
    reader = sock.makefile("rb", buffering=1 << 20)
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    def get() -> None:
        sock.sendall(request)
        length = 0
        while (line := reader.readline()) != b"\r\n":
            if not line:
                raise RuntimeError("the connection ended early")
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        left = length
        while left:
            got = reader.read1(min(left, 1 << 20))
            if not got:
                raise RuntimeError("the connection ended early")
            left -= len(got)

    get()
    taken = []
    for _ in range(count):
        started = time.perf_counter()
        get()
        taken.append((time.perf_counter() - started) * 1000)
    sock.close()
    return taken


def raw_download(sock: socket.socket, first: bytes, mib: int) -> float:
    """A mib MiB download with the raw client: MiB/s."""
    started = time.perf_counter()
    raw_loop(sock, first, f"/mib/{mib}", 0)
    return mib / (time.perf_counter() - started)


# The same raw client, run inside the session against the app on its loopback.
IN_SANDBOX = (
    "import json, socket, sys, time\n\n"
    + inspect.getsource(raw_loop)
    + "\n\n"
    + inspect.getsource(raw_download)
    + textwrap.dedent(
        """
        port, count, mib = (int(a) for a in sys.argv[1:4])
        out = {"latency_ms": raw_loop(socket.create_connection(("127.0.0.1", port)), b"",
                                      "/small", count)}
        if mib:
            out["mib_s"] = raw_download(socket.create_connection(("127.0.0.1", port)), b"", mib)
        print(json.dumps(out))
        """
    )
)
