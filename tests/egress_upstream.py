"""Upstreams for the egress tests: HTTP(S) servers on 127.0.0.2, in threads of the test.

They serve JSON echoes of the request (recording each Authorization header they saw),
downloads of N MiB at /mib/N, a package index of one wheel, and a redirect to a host no
policy names.
"""

from __future__ import annotations

import http.server as http_server
import json
import secrets
import ssl
import threading
from pathlib import Path

UPSTREAM_HOST = "127.0.0.2"


def _wheel() -> bytes:
    """A wheel of one module, `hello_cloche` 1.0, for a package index of the test's own."""
    import io
    import zipfile

    files = {
        "hello_cloche/__init__.py": "GREETING = 'hello'\n",
        "hello_cloche-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: hello-cloche\n"
        "Version: 1.0\n",
        "hello_cloche-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "hello_cloche-1.0.dist-info/RECORD,,\n"
    files["hello_cloche-1.0.dist-info/RECORD"] = record
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


WHEEL = "hello_cloche-1.0-py3-none-any.whl"
INDEX = {  # path: (content type, body)
    "/simple/hello-cloche/": (
        "text/html",
        f'<html><body><a href="/files/{WHEEL}">{WHEEL}</a></body></html>'.encode(),
    ),
    f"/files/{WHEEL}": ("application/octet-stream", _wheel()),
}


AUTHORIZATIONS: list[tuple[str, str | None]] = []  # (path, Authorization) as upstreams saw them
SECRET_VALUE = "real-token-" + secrets.token_hex(8)  # the value only the host holds


class _Handler(http_server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith("/mib/"):  # a download of that many MiB
            size = int(self.path.rsplit("/", 1)[1]) << 20
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            for _ in range(size >> 20):
                self.wfile.write(bytes(1 << 20))
            return
        if self.path in INDEX:
            kind, content = INDEX[self.path]
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)
            return
        if self.path.startswith("/redirect"):  # to a host no policy names
            self.send_response(302)
            self.send_header("Location", "http://example.com/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        AUTHORIZATIONS.append((self.path, self.headers.get("Authorization")))
        body = json.dumps({"path": self.path, "host": self.headers.get("Host")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Upstream:
    """An HTTP (or, given a context, HTTPS) server on 127.0.0.2, in a thread."""

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        self.server = http_server.ThreadingHTTPServer((UPSTREAM_HOST, 0), _Handler)
        if context is not None:
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def write_secrets(directory: Path, port: int) -> Path:
    """A --secrets file (owner-only) with API_TOKEN = SECRET_VALUE for UPSTREAM_HOST:port."""
    path = directory / "secrets.toml"
    path.write_text(
        f'[secrets.API_TOKEN]\nvalue = "{SECRET_VALUE}"\nhosts = ["{UPSTREAM_HOST}:{port}"]\n'
    )
    path.chmod(0o600)
    return path
