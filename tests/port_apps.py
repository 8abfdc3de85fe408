# ruff: noqa: E501  (the apps are sources run inside a session, kept as one would write them)
"""Servers for tests of ports, as source to run inside a session (stdlib only: the sandbox's
runtime has no web framework), and a helper that starts one and waits for its port.

- ECHO (`app.py PORT [ADDRESS [NAME]]`): HTTP/1.1, keeps connections alive, names itself
  in `X-App-Name`. `POST` answers its body; `GET /log` the requests it has seen; `GET /x`
  the request's head as JSON ({"app", "path", "headers"}); `GET /stream` sends a chunk, then
  waits until `POST /release` before it sends the last one and ends; `GET /cookie` sets
  cookies.
- WEBSOCKET: a websocket echo server (RFC 6455, by hand): text as text, binary as binary,
  the subprotocol it prefers among those offered (`chat` over `superchat`), pings answered.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

ECHO = r"""
import http.server, json, sys, threading
released = threading.Event()
NAME = sys.argv[3] if len(sys.argv) > 3 else "app"
seen = []
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def parse_request(self):
        ok = super().parse_request()
        if ok and self.path != "/log":
            seen.append(self.command + " " + self.path)
        return ok
    def _send(self, body, status=200, kind="application/octet-stream", extra=()):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("X-App-Name", NAME)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        if self.path == "/release":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            released.set()
            return self._send(b"released")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if not size:
                    self.rfile.readline()
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
        else:
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(data)
    def do_GET(self):
        if self.path.startswith("/stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            first = b"first piece\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(first), first))
            self.wfile.flush()
            released.wait(600)
            released.clear()
            last = b"last piece\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
            return
        if self.path == "/log":
            return self._send(json.dumps(seen).encode(), kind="application/json")
        if self.path.startswith("/cookie"):
            return self._send(b"cookies", extra=[("Set-Cookie", "app=1; Path=/; Domain=example.com"), ("Set-Cookie", "cloche_preview=forged; Path=/")])
        body = json.dumps({"app": NAME, "path": self.path, "headers": [[k.lower(), v] for k, v in self.headers.items()]}).encode()
        self._send(body, kind="application/json")
    do_PUT = do_POST
    do_DELETE = do_GET
http.server.ThreadingHTTPServer.allow_reuse_address = True
server = http.server.ThreadingHTTPServer((sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1", int(sys.argv[1])), Handler)

server.serve_forever()
"""

WEBSOCKET = r"""
import base64, hashlib, socket, struct, sys, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PREFERRED = ["chat", "superchat"]
def read_exactly(conn, n):
    data = b""
    while len(data) < n:
        piece = conn.recv(n - len(data))
        if not piece:
            raise EOFError
        data += piece
    return data
def send_frame(conn, opcode, payload):
    head = bytes([0x80 | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack(">H", n)
    else:
        head += bytes([127]) + struct.pack(">Q", n)
    conn.sendall(head + payload)
def serve(conn):
    try:
        talk(conn)
    except (EOFError, OSError):
        conn.close()
def talk(conn):
    request = b""
    while b"\r\n\r\n" not in request:
        piece = conn.recv(4096)
        if not piece:
            return
        request += piece
    lines = request.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        if b":" in line:
            name, value = line.split(b":", 1)
            headers[name.strip().lower()] = value.strip()
    if b"sec-websocket-key" not in headers:
        body = b"not a websocket"
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return conn.close()
    accept = base64.b64encode(hashlib.sha1(headers[b"sec-websocket-key"] + GUID).digest())
    offered = [p.strip().decode() for p in headers.get(b"sec-websocket-protocol", b"").split(b",") if p.strip()]
    chosen = next((p for p in PREFERRED if p in offered), None)
    answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n"
    if chosen:
        answer += b"Sec-WebSocket-Protocol: " + chosen.encode() + b"\r\n"
    conn.sendall(answer + b"\r\n")
    message, kind = b"", 1
    while True:
        first, second = read_exactly(conn, 2)
        fin, opcode = first & 0x80, first & 0x0F
        n = second & 0x7F
        if n == 126:
            n = struct.unpack(">H", read_exactly(conn, 2))[0]
        elif n == 127:
            n = struct.unpack(">Q", read_exactly(conn, 8))[0]
        mask = read_exactly(conn, 4) if second & 0x80 else b"\0\0\0\0"
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(read_exactly(conn, n)))
        if opcode == 8:
            send_frame(conn, 8, payload[:2] or struct.pack(">H", 1000))
            return conn.close()
        if opcode == 9:
            send_frame(conn, 10, payload)
            continue
        if opcode in (1, 2):
            message, kind = payload, opcode
        elif opcode == 0:
            message += payload
        if fin and opcode in (0, 1, 2):
            if message == b"close-me":
                send_frame(conn, 8, struct.pack(">H", 4001) + b"asked to")
                return conn.close()
            send_frame(conn, kind, message)
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(16)
while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


def start_app(
    http: httpx.Client,
    session_id: str,
    source: str,
    port: int,
    *extra: str,
    name: str = "app.py",
    timeout_s: float = 120.0,
) -> int:
    """Put an app's source in the session, start it in the background, and wait (polling
    the session's ports, with a deadline) until it listens; its pid."""
    put = http.put(f"/v1/sessions/{session_id}/files/{name}", content=source.encode())
    assert put.status_code in (200, 201, 204), put.text
    started = http.post(
        f"/v1/sessions/{session_id}/commands",
        json={"cmd": " ".join(["python3", name, str(port), *extra]), "background": True},
    )
    assert started.status_code == 201, started.text
    wait_for_port(http, session_id, port, timeout_s)
    pid: int = started.json()["pid"]
    return pid


def wait_for_port(http: httpx.Client, session_id: str, port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    listed: Any = None
    while time.monotonic() < deadline:
        listed = http.get(f"/v1/sessions/{session_id}/ports")
        if listed.status_code == 200 and {"port": port} in listed.json()["ports"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"port {port} never listened: {listed.text if listed else None}")
