"""envd's HTTP routes: `GET /files` (download), `POST /files` (upload), `GET /health`.

Files are read and written inside the sandbox as the user named by `?username=` (or the
request's `Authorization: Basic`), `user` by default; relative paths are from that user's
home. A download is gzip-compressed when the client accepts it; an upload is the raw body
(`application/octet-stream`, possibly `Content-Encoding: gzip`) to `?path=`, or
`multipart/form-data` with one or more files, each named by its part's filename (or
`?path=` for a single one). The answer lists `{name, type, path}` of what was written.
"""

from __future__ import annotations

import posixpath
import zlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cloche.errors import ClocheError, PathRefused, SessionLost, SessionNotFound
from cloche.server.e2b.errors import GONE, E2BError, error_json, from_exception
from cloche.server.e2b.routing import Reach, Where

MAX_FILES = 1000  # parts of one multipart upload
READ_CHUNK = 1 << 20


def _where(reach: Reach, request: Request) -> Where:
    where = reach.where(request.headers)
    user = request.query_params.get("username")
    if user:
        where = Where(where.manager, where.id, where.owner, user)
    return where


def _answer(exc: Exception) -> Response:
    if isinstance(exc, (SessionNotFound, SessionLost)):
        return error_json(502, f"The sandbox {GONE}")
    return from_exception(exc)


async def health(reach: Reach, request: Request) -> Response:
    """204 while the sandbox lives (no token needed, as envd's), 502 once it is gone."""
    sandbox_id = request.headers.get("e2b-sandbox-id") or ""
    sandbox = reach.sandboxes.known(sandbox_id)
    if sandbox is None:
        return error_json(502, f"The sandbox {sandbox_id} {GONE}")
    try:
        await reach.manager.info(sandbox.id, sandbox.owner)
    except (SessionNotFound, SessionLost):
        return error_json(502, f"The sandbox {sandbox_id} {GONE}")
    return Response(status_code=204)


async def download(reach: Reach, request: Request) -> Response:
    try:
        where = _where(reach, request)
        path = request.query_params.get("path")
        if not path:
            raise E2BError(400, "path is required")
        size, pieces = await where.manager.fs_read(
            where.id, path, user=where.user, owner=where.owner
        )
    except (E2BError, ClocheError) as exc:
        return _answer(exc)
    headers = {"Content-Disposition": f'attachment; filename="{posixpath.basename(path)}"'}
    if "gzip" in request.headers.get("accept-encoding", ""):
        headers["Content-Encoding"] = "gzip"
        return StreamingResponse(
            _gzipped(pieces), media_type="application/octet-stream", headers=headers
        )
    headers["Content-Length"] = str(size)
    return StreamingResponse(pieces, media_type="application/octet-stream", headers=headers)


async def _gzipped(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)
    async for piece in pieces:
        packed = packer.compress(piece)
        if packed:
            yield packed
    yield packer.flush()


async def _body(request: Request) -> AsyncIterator[bytes]:
    """The request's body, unpacked when it is gzip (Content-Encoding)."""
    if request.headers.get("content-encoding", "").lower() != "gzip":
        async for chunk in request.stream():
            yield chunk
        return
    unpacker = zlib.decompressobj(31)
    async for chunk in request.stream():
        try:
            data = unpacker.decompress(chunk)
        except zlib.error as exc:
            raise PathRefused("(body)", f"the body is not valid gzip: {exc}") from None
        if data:
            yield data
    if not unpacker.eof:
        raise PathRefused("(body)", "the gzip body ended early")


async def _parts(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(READ_CHUNK):
        yield chunk


def _written(path: str) -> dict[str, Any]:
    return {"name": posixpath.basename(path), "type": "file", "path": path}


async def upload(reach: Reach, request: Request) -> Response:
    try:
        where = _where(reach, request)
        kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        path = request.query_params.get("path")
        written = []
        if kind == "multipart/form-data":
            async with request.form(max_files=MAX_FILES, max_fields=MAX_FILES) as form:
                uploads = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
                if not uploads:
                    raise E2BError(400, "the multipart body holds no file")
                for item in uploads:
                    target = path if path and len(uploads) == 1 else item.filename
                    if not target:
                        raise E2BError(400, "a file part without a filename (its path)")
                    entry = await where.manager.fs_write(
                        where.id, target, _parts(item), user=where.user, owner=where.owner
                    )
                    written.append(_written(entry.path))
        else:
            if not path:
                raise E2BError(400, "path is required for an application/octet-stream upload")
            entry = await where.manager.fs_write(
                where.id, path, _body(request), user=where.user, owner=where.owner
            )
            written.append(_written(entry.path))
    except (E2BError, ClocheError) as exc:
        return _answer(exc)
    return JSONResponse(written)
