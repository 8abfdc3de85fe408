"""Templates (`/v1/templates`): a session's system built from an image. Any token lists and
reads them; only an admin builds or deletes one. The manager does the work.

A build is `POST /v1/templates` with `{name, from_tar | from_image | dockerfile, context?}`
(paths on the server), or with the tarball itself as the body and `?name=&kind=tar|image`
(streamed to disk, up to --template-max-mib); either answers 202 at once, in state building.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cloche.errors import TemplateRefused
from cloche.sandbox.images import TemplateInfo, TemplateSource
from cloche.server.http.auth import caller_of, owner_of, require_admin
from cloche.server.http.sessions import ERRORS, _manager
from cloche.server.tenants import Caller

# Bodies here may be a whole image: the BodyLimit middleware gives this path
# --template-max-mib; a JSON body is read up to JSON_MAX_BYTES only.
UPLOAD_PATH = re.compile(r"^/v1/templates/?$")
JSON_MAX_BYTES = 64 * 1024

router = APIRouter(
    prefix="/v1/templates",
    tags=["templates"],
    responses=ERRORS | {403: ERRORS[400], 501: ERRORS[400]},
)


class TemplateBuild(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=200, description="1-32 of a-z, 0-9, - and _ (as profiles)")
    from_tar: str | None = Field(
        default=None,
        description="A root filesystem tarball on the server (docker export, mmdebstrap)",
    )
    from_image: str | None = Field(
        default=None,
        description="An image: docker-archive:PATH, oci-archive:PATH, oci:DIR[:TAG], or an "
        "image of the server's Docker engine, docker-daemon:NAME:TAG or NAME:TAG",
    )
    dockerfile: str | None = Field(
        default=None, description="A Dockerfile on the server, built by its Docker engine"
    )
    context: str | None = Field(
        default=None, description="The Dockerfile's build context (default: its directory)"
    )

    def source(self) -> TemplateSource:
        given = [
            (kind, ref)
            for kind, ref in (
                ("tar", self.from_tar),
                ("image", self.from_image),
                ("dockerfile", self.dockerfile),
            )
            if ref is not None
        ]
        if len(given) != 1:
            raise TemplateRefused("give exactly one of from_tar, from_image and dockerfile")
        if self.context is not None and given[0][0] != "dockerfile":
            raise TemplateRefused("context goes with a dockerfile only")
        kind, ref = given[0]
        return TemplateSource(kind, ref, self.context)  # type: ignore[arg-type]


class TemplateUser(BaseModel):
    name: str
    uid: int
    gid: int
    home: str


class TemplateOut(BaseModel):
    name: str
    state: Literal["building", "ready", "failed"]
    error: str | None = Field(description="Why it failed: the builder's own last line")
    log: list[str] = Field(description="The builder's last lines (skopeo, umoci, docker, ...)")
    progress: dict[str, Any] = Field(
        description="While building: phase (queued, extracting, building, saving, copying, "
        "unpacking, finishing), and read_bytes/total_bytes/members, or step/steps"
    )
    source: dict[str, Any] = Field(description="{kind: tar|image|dockerfile|builtin, ref}")
    env: list[str] = Field(description="The image's environment, K=V")
    shell: str | None = Field(description="/bin/bash, else /bin/sh; null: the image has none")
    python: str | None = Field(
        description="The image's python3 (>= 3.9) cells run on; null: cloche's interpreter"
    )
    python_version: str | None
    user: TemplateUser | None = Field(description="Who runs cells, commands and terminals")
    size_bytes: int
    created_at: str = Field(description="ISO 8601")
    working_dir: str | None = Field(description="The image config's WorkingDir")
    image_user: str | None = Field(description="The image config's User")
    built_in: bool


class TemplateList(BaseModel):
    templates: list[TemplateOut]


def _out(info: TemplateInfo) -> dict[str, Any]:
    return info.to_json()


_BUILD_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": TemplateBuild.model_json_schema()},
        "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
    },
    "description": "JSON naming a source on the server; or, with ?name=, the tarball itself "
    "(a root filesystem with kind=tar, a docker-archive with kind=image)",
}


@router.post(
    "",
    status_code=202,
    response_model=TemplateOut,
    summary="Build a template (an admin's token); 202 at once, in state building",
    openapi_extra={"requestBody": _BUILD_BODY},
)
async def build_template(
    request: Request,
    name: str | None = Query(
        default=None, max_length=200, description="With the tarball as the body: its name"
    ),
    kind: Literal["tar", "image"] = Query(
        default="tar",
        description="With the tarball as the body: a root filesystem, or a "
        "docker-archive (docker save)",
    ),
    caller: Caller = Depends(caller_of),  # noqa: B008
) -> dict[str, Any]:
    require_admin(caller, "build templates")
    manager = _manager(request)
    if name is not None:
        source = TemplateSource(kind, "upload")
        return _out(await manager.build_template(name, source, upload=request.stream()))
    body = await _json_body(request)
    return _out(await manager.build_template(body.name, body.source()))


async def _json_body(request: Request) -> TemplateBuild:
    """The JSON body, read up to JSON_MAX_BYTES, as a TemplateBuild."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > JSON_MAX_BYTES:
            raise TemplateRefused(
                f"a JSON body is at most {JSON_MAX_BYTES // 1024} KiB here; send a tarball as "
                "the body with ?name=NAME&kind=tar|image"
            )
    try:
        return TemplateBuild.model_validate(json.loads(raw or b"null"))
    except ValueError as exc:
        errors = exc.errors() if isinstance(exc, ValidationError) else None
        if errors is None:
            raise TemplateRefused(f"the body is not JSON: {exc}") from None
        raise RequestValidationError(
            [{**error, "loc": ("body", *error.get("loc", ()))} for error in errors]
        ) from None


@router.get("", response_model=TemplateList, summary="Templates, built-in and built here")
async def list_templates(
    request: Request,
    owner: str | None = Depends(owner_of),  # noqa: B008  # any token may read them
) -> dict[str, Any]:
    return {"templates": [_out(info) for info in await _manager(request).templates()]}


@router.get(
    "/{name}",
    response_model=TemplateOut,
    summary="A template: state, progress, and on failure the builder's own lines",
)
async def get_template(
    name: str,
    request: Request,
    owner: str | None = Depends(owner_of),  # noqa: B008
) -> dict[str, Any]:
    return _out(await _manager(request).template(name))


@router.delete(
    "/{name}",
    status_code=204,
    response_class=Response,
    summary="Delete a template (an admin's token); 409 while sessions use it",
)
async def delete_template(
    name: str,
    request: Request,
    caller: Caller = Depends(caller_of),  # noqa: B008
) -> Response:
    require_admin(caller, "delete templates")
    await _manager(request).delete_template(name)
    return Response(status_code=204)
