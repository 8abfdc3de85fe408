"""`/v1/templates` through a real server: any token lists and reads, only an admin builds or
deletes (a user: 403); a tarball as the body or a path on the server becomes a template; a
failed build shows the builder's own lines; a template in use can't be deleted (409); a
restarted server finds its templates again."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import cloche
from cloche.errors import (
    Forbidden,
    NotSupported,
    TemplateExists,
    TemplateFailed,
    TemplateNotFound,
    TemplateRefused,
)
from cloche.sandbox.images import TemplateSource
from cloche.sessions.manager import SessionManager
from images_support import member, small_root
from support import ServerThread, make_config, require_gvisor

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="building templates needs root (chroot)"),
]
USER, ADMIN = "user-token", "admin-token"


def config(state_root: Path, data_dir: Path, **overrides: Any) -> Any:
    return make_config(
        state_root,
        pool_size=0,
        tokens=frozenset({USER}),
        admin_tokens=frozenset({ADMIN}),
        data_dir=data_dir,
        **overrides,
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("templates-data")


@pytest.fixture(scope="module")
def server(state_root: Path, data_dir: Path) -> Iterator[ServerThread]:
    require_gvisor()
    with ServerThread(config(state_root, data_dir, template_max_mib=1)) as running:
        yield running


def http(server: ServerThread, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


@pytest.fixture
def admin(server: ServerThread) -> Iterator[httpx.Client]:
    with http(server, ADMIN) as client:
        yield client


@pytest.fixture
def user(server: ServerThread) -> Iterator[httpx.Client]:
    with http(server, USER) as client:
        yield client


def ended(client: httpx.Client, name: str, timeout_s: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.get(f"/v1/templates/{name}")
        assert answer.status_code == 200, answer.text
        if answer.json()["state"] != "building":
            return dict(answer.json())
        assert time.monotonic() < deadline, answer.json()
        time.sleep(0.1)


def upload(client: httpx.Client, name: str, tarball: Path, kind: str = "tar") -> httpx.Response:
    return client.post(
        "/v1/templates",
        params={"name": name, "kind": kind},
        content=tarball.read_bytes(),
        headers={"Content-Type": "application/x-tar"},
    )


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["type"], error["message"]


def test_any_token_reads_but_only_an_admin_builds_or_deletes(user, admin, tmp_path) -> None:
    listed = user.get("/v1/templates")
    assert listed.status_code == 200
    python = listed.json()["templates"][0]
    assert (python["name"], python["state"], python["built_in"]) == ("python", "ready", True)
    assert user.get("/v1/templates/python").json() == python
    tarball = small_root(tmp_path / "root.tar")
    status, kind, message = error_of(upload(user, "mine", tarball))
    assert (status, kind) == (403, "forbidden") and "only an admin may build templates" in message
    status, kind, _ = error_of(user.post("/v1/templates", json={"name": "m", "from_tar": "/x"}))
    assert (status, kind) == (403, "forbidden")
    assert upload(admin, "shared", tarball).status_code == 202
    assert ended(user, "shared")["state"] == "ready"
    status, kind, message = error_of(user.delete("/v1/templates/shared"))
    assert (status, kind) == (403, "forbidden") and "delete templates" in message
    assert admin.delete("/v1/templates/shared").status_code == 204


def test_a_tarball_sent_as_the_body_becomes_a_template(admin, tmp_path) -> None:
    answer = upload(admin, "body", small_root(tmp_path / "root.tar"))
    assert answer.status_code == 202, answer.text
    assert (answer.json()["name"], answer.json()["state"]) == ("body", "building")
    done = ended(admin, "body")
    assert done["state"] == "ready", done["error"]
    assert done["source"] == {"kind": "tar", "ref": "upload"}
    assert done["user"] == {"name": "user", "uid": 1000, "gid": 1000, "home": "/home/user"}
    assert done["shell"] == "/bin/sh" and done["python"] is None and done["error"] is None
    names = [t["name"] for t in admin.get("/v1/templates").json()["templates"]]
    assert names[0] == "python" and "body" in names
    assert admin.delete("/v1/templates/body").status_code == 204
    assert error_of(admin.get("/v1/templates/body"))[:2] == (404, "not_found")
    assert error_of(admin.delete("/v1/templates/body"))[:2] == (404, "not_found")


def test_a_path_on_the_server_becomes_a_template(admin, tmp_path) -> None:
    tarball = small_root(tmp_path / "root.tar")
    answer = admin.post("/v1/templates", json={"name": "onserver", "from_tar": str(tarball)})
    assert answer.status_code == 202, answer.text
    assert ended(admin, "onserver")["source"] == {"kind": "tar", "ref": str(tarball)}
    status, kind, message = error_of(
        admin.post("/v1/templates", json={"name": "onserver", "from_tar": str(tarball)})
    )
    assert (status, kind) == (409, "template_exists") and "delete it first" in message
    assert admin.delete("/v1/templates/onserver").status_code == 204


def test_a_failed_build_shows_the_builders_own_lines(admin, tmp_path) -> None:
    hostile = small_root(tmp_path / "hostile.tar", member("../../x", data=b"pwned"))
    assert upload(admin, "hostile", hostile).status_code == 202
    failed = ended(admin, "hostile")
    assert failed["state"] == "failed"
    assert "member '../../x': its member name '../../x' has a '..' component" in failed["error"]
    assert any("'../../x'" in line for line in failed["log"])
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not an image")
    body = {"name": "junk", "from_image": f"docker-archive:{junk}"}
    assert admin.post("/v1/templates", json=body).status_code == 202
    failed = ended(admin, "junk")
    assert failed["error"].startswith("skopeo copy failed:")
    assert any(str(junk) in line for line in failed["log"])  # skopeo's own words
    for name in ("hostile", "junk"):
        assert admin.delete(f"/v1/templates/{name}").status_code == 204


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"name": "a", "from_tar": "/x.tar", "from_image": "x:1"}, 400, "exactly one of"),
        ({"name": "a"}, 400, "exactly one of"),
        ({"name": "a", "from_tar": "/x.tar", "context": "/"}, 400, "context goes with"),
        ({"name": "a", "from_tar": "relative.tar"}, 400, "must be absolute"),
        ({"name": "python", "from_tar": "/x.tar"}, 400, "built-in"),
        ({"name": "Bad Name", "from_tar": "/x.tar"}, 400, "1-32 of a-z"),
        ({"name": "a", "from_tar": "/x.tar", "extra": 1}, 400, "extra"),
        ({"from_tar": "/x.tar"}, 400, "name"),
    ],
)
def test_bad_builds_are_refused_naming_what_is_wrong(admin, body, status, words) -> None:
    answer = admin.post("/v1/templates", json=body)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]


def test_a_body_that_is_not_json_or_too_large_is_refused(server, admin) -> None:
    answer = admin.post("/v1/templates", content=b"{oops", headers={"Content-Type": "x"})
    assert error_of(answer)[:2] == (400, "template_refused")
    answer = admin.post(
        "/v1/templates",
        params={"name": "huge"},
        content=b"x" * (2 << 20),  # the server's --template-max-mib is 1 here
        headers={"Content-Type": "application/x-tar"},
    )
    assert answer.status_code == 413, answer.text
    streamed = admin.post(
        "/v1/templates",
        params={"name": "huge"},
        content=iter([b"x" * (512 << 10)] * 4),  # chunked: no length declared
        headers={"Content-Type": "application/x-tar"},
    )
    assert streamed.status_code == 413, streamed.text
    assert error_of(admin.get("/v1/templates/huge"))[0] == 404
    uploads = server.server.manager.template_catalog.root / ".uploads"  # type: ignore[attr-defined]
    assert list(uploads.iterdir()) == []


def test_a_template_sessions_use_cant_be_deleted(server, admin, tmp_path) -> None:
    assert upload(admin, "used", small_root(tmp_path / "root.tar")).status_code == 202
    assert ended(admin, "used")["state"] == "ready"
    catalogue = server.server.manager.template_catalog  # type: ignore[attr-defined]
    real = catalogue.in_use  # the manager's: whether a live or paused session uses it
    catalogue.in_use = lambda name: name == "used"
    try:
        status, kind, message = error_of(admin.delete("/v1/templates/used"))
    finally:
        catalogue.in_use = real
    assert (status, kind) == (409, "template_in_use") and "close them first" in message
    assert admin.delete("/v1/templates/used").status_code == 204


def test_a_restarted_server_finds_its_templates_again(state_root, tmp_path) -> None:
    data_dir = tmp_path / "data"
    with ServerThread(config(state_root, data_dir)) as first, http(first, ADMIN) as client:
        assert upload(client, "lasting", small_root(tmp_path / "root.tar")).status_code == 202
        built = ended(client, "lasting")
    record = data_dir / "templates" / "lasting" / "template.json"
    assert json.loads(record.read_text())["state"] == "ready"
    # A build the server was killed in the middle of:
    (data_dir / "templates" / "cut").mkdir()
    cut = {**built, "name": "cut", "state": "building"}
    (data_dir / "templates" / "cut" / "template.json").write_text(json.dumps(cut))
    with ServerThread(config(state_root, data_dir)) as second, http(second, USER) as client:
        again = client.get("/v1/templates/lasting").json()
        assert again == built
        assert client.get("/v1/templates/cut").json()["error"].startswith("interrupted")


async def test_a_cluster_builds_no_templates_yet() -> None:
    """The cluster's manager keeps SessionManager's template verbs: only `python`, a 501."""
    pytest.importorskip("ray", reason="the cluster's manager needs cloche[cluster]")
    from cloche.cluster.manager import ClusterSessionManager

    verbs = ("templates", "template", "build_template", "delete_template")
    assert all(getattr(ClusterSessionManager, v) is getattr(SessionManager, v) for v in verbs)
    cluster: Any = object()  # the verbs use nothing of the manager
    assert [t.name for t in await SessionManager.templates(cluster)] == ["python"]
    with pytest.raises(TemplateNotFound, match="not yet offered over a cluster"):
        await SessionManager.template(cluster, "debian")
    with pytest.raises(NotSupported, match="--cluster"):
        await SessionManager.build_template(cluster, "debian", TemplateSource("tar", "/x.tar"))
    with pytest.raises(NotSupported, match="--cluster"):
        await SessionManager.delete_template(cluster, "debian")


def test_the_sdk_builds_waits_lists_and_deletes(server, tmp_path) -> None:
    url = f"http://127.0.0.1:{server.http_port}"
    tarball = small_root(tmp_path / "root.tar")
    with cloche.Client(url, ADMIN) as admin, cloche.Client(url, USER) as user:
        built = admin.build_template("sdk", upload=tarball, wait=True)
        assert built["state"] == "ready" and built["user"]["home"] == "/home/user"
        assert [t["name"] for t in user.templates()][:1] == ["python"]
        assert user.template("sdk") == built
        with pytest.raises(Forbidden, match="only an admin may build templates"):
            user.build_template("mine", from_tar=str(tarball))
        with pytest.raises(TemplateExists, match="delete it first"):
            admin.build_template("sdk", from_tar=str(tarball))
        with pytest.raises(TemplateRefused, match="must be absolute"):
            admin.build_template("other", from_tar="relative.tar")
        hostile = small_root(tmp_path / "hostile.tar", member("../x", data=b"x"))
        with pytest.raises(TemplateFailed, match="member '../x'"):
            admin.build_template("bad", upload=hostile, wait=True)
        admin.delete_template("sdk")
        admin.delete_template("bad")
        with pytest.raises(TemplateNotFound, match="Template sdk not found"):
            user.template("sdk")


def test_a_session_of_a_built_template_runs_on_the_images_python(
    server, admin, user, debian_tar
) -> None:
    """The seam with sessions: the catalogue's template is the sandbox's system, and the
    sessions made of it hold it (a delete is a 409 until they are closed)."""
    body = {"name": "debian", "from_tar": str(debian_tar)}
    assert admin.post("/v1/templates", json=body).status_code == 202
    assert ended(admin, "debian")["state"] == "ready"
    created = user.post("/v1/sessions", json={"template": "debian"})
    assert created.status_code == 201, created.text
    session = created.json()["id"]
    assert created.json()["template"] == "debian"
    code = "import sys, os, getpass, yaml\nprint(sys.executable, os.getcwd(), getpass.getuser())"
    ran = user.post(f"/v1/sessions/{session}/execute", json={"code": code}, timeout=120)
    assert ran.status_code == 200, ran.text
    assert ran.json()["stdout"] == "/usr/bin/python3.11 /home/user user\n", ran.json()
    status, kind, _ = error_of(admin.delete("/v1/templates/debian"))
    assert (status, kind) == (409, "template_in_use")
    assert user.delete(f"/v1/sessions/{session}").status_code == 204
    assert admin.delete("/v1/templates/debian").status_code == 204
