"""Templates over the HTTP API, behind `AsyncClient.templates()`, `template()`,
`build_template()` and `delete_template()` (and the blocking `Client`'s same verbs).

A template is answered as its JSON record: `name`, `state` (building, ready, failed),
`error`, `log` (the builder's last lines), `progress`, `source`, `env`, `shell`, `python`,
`python_version`, `user`, `size_bytes`, `created_at`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

from cloche.errors import RequestTimeout, TemplateFailed

if TYPE_CHECKING:
    from cloche.client._wire import Wire

Template = dict[str, Any]
WAIT_POLL_S = 1.0


async def _chunks(path: Path) -> Any:
    """A file's content in pieces, read in a thread."""
    file = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(file.read, 1 << 20):
            yield chunk
    finally:
        file.close()


async def list_all(client: Wire) -> list[Template]:
    response = await client._request("GET", "/v1/templates")
    templates: list[Template] = response.json()["templates"]
    return templates


async def get(client: Wire, name: str) -> Template:
    response = await client._request("GET", f"/v1/templates/{quote(name, safe='')}")
    template: Template = response.json()
    return template


async def build(
    client: Wire,
    name: str,
    *,
    from_tar: str | None = None,
    from_image: str | None = None,
    dockerfile: str | None = None,
    context: str | None = None,
    upload: str | Path | None = None,
    kind: Literal["tar", "image"] = "tar",
) -> Template:
    """Start a build; see `AsyncClient.build_template`."""
    if upload is not None:
        params = {"name": name, "kind": kind}
        content = _chunks(Path(upload))
        headers = {"Content-Type": "application/x-tar"}
        response = await client._request(
            "POST", "/v1/templates", params=params, content=content, headers=headers
        )
    else:
        body = {
            "name": name,
            "from_tar": from_tar,
            "from_image": from_image,
            "dockerfile": dockerfile,
            "context": context,
        }
        sent = {key: value for key, value in body.items() if value is not None}
        response = await client._request("POST", "/v1/templates", json=sent)
    template: Template = response.json()
    return template


async def wait(client: Wire, name: str, timeout_s: float | None = None) -> Template:
    """Poll a template until it is ready; raises TemplateFailed (with the builder's last
    line) when it failed, RequestTimeout after timeout_s."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        template = await get(client, name)
        if template["state"] == "ready":
            return template
        if template["state"] == "failed":
            raise TemplateFailed(f"template {name} failed to build: {template['error']}")
        if deadline is not None and time.monotonic() > deadline:
            raise RequestTimeout(f"template {name} is still building after {timeout_s:g} s")
        await asyncio.sleep(WAIT_POLL_S)


async def delete(client: Wire, name: str) -> None:
    await client._request("DELETE", f"/v1/templates/{quote(name, safe='')}")
