"""The catalogue of templates (sessions/templates.py) on a real directory with real builds:
builds answer at once and end ready or failed, one per name; the built-in `python` can't be
built over or deleted; a template in use can't be deleted; a build cut short (deleted, or its
server gone) leaves nothing but what it says; a new catalogue finds the templates again."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cloche.errors import (
    TemplateExists,
    TemplateFailed,
    TemplateInUse,
    TemplateNotFound,
    TemplateNotReady,
    TemplateRefused,
)
from cloche.sandbox.images import TemplateInfo, TemplateSource, TemplateState
from cloche.sessions.templates import Templates
from images_support import member, small_root

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="building templates needs root (chroot)"),
]


async def ended(templates: Templates, name: str, timeout_s: float = 300) -> TemplateInfo:
    deadline = time.monotonic() + timeout_s
    while (info := templates.get(name)).state is TemplateState.BUILDING:
        assert time.monotonic() < deadline, f"{name} still building: {info.progress}"
        await asyncio.sleep(0.05)
    return info


@pytest.fixture
async def catalogue(tmp_path: Path) -> AsyncIterator[Templates]:
    templates = Templates(tmp_path / "templates")
    await templates.open()
    yield templates
    await templates.close()


@pytest.fixture
def tiny(tmp_path: Path) -> TemplateSource:
    return TemplateSource("tar", str(small_root(tmp_path / "tiny.tar")))


def leftovers(templates: Templates) -> list[str]:
    return sorted(p.name for p in templates.root.iterdir() if p.name.startswith("."))


async def test_a_build_answers_at_once_then_is_ready(catalogue: Templates, tiny) -> None:
    started = await catalogue.build("tiny", tiny)
    assert started.state is TemplateState.BUILDING
    info = await ended(catalogue, "tiny")
    assert info.state is TemplateState.READY, info.error
    rootfs, ready = catalogue.ready("tiny")
    assert rootfs == catalogue.root / "tiny" / "rootfs" and rootfs.is_dir()
    assert ready is info and info.user["name"] == "user" and info.log[-1].startswith("built in")
    record = json.loads((catalogue.root / "tiny" / "template.json").read_text())
    assert record["state"] == "ready" and record["source"] == {"kind": "tar", "ref": tiny.ref}
    assert sorted(p.name for p in (catalogue.root / "tiny").iterdir()) == [
        "rootfs",
        "template.json",
    ]
    assert leftovers(catalogue) == []
    assert stat.S_IMODE(catalogue.root.stat().st_mode) == 0o700  # images hold setuid files


async def test_one_build_per_name_and_a_ready_one_is_deleted_first(catalogue, tiny) -> None:
    await catalogue.build("one", tiny)
    with pytest.raises(TemplateExists, match="being built"):
        await catalogue.build("one", tiny)
    with pytest.raises(TemplateNotReady):
        catalogue.ready("one")
    await ended(catalogue, "one")
    with pytest.raises(TemplateExists, match="delete it first"):
        await catalogue.build("one", tiny)
    await catalogue.delete("one")
    assert not (catalogue.root / "one").exists()
    with pytest.raises(TemplateNotFound):
        catalogue.get("one")
    await catalogue.build("one", tiny)
    assert (await ended(catalogue, "one")).state is TemplateState.READY


async def test_python_is_built_in_and_cant_be_built_over_or_deleted(catalogue, tiny) -> None:
    listed = catalogue.list()
    assert listed[0].name == "python" and listed[0].built_in
    assert catalogue.ready("python") == (None, listed[0])
    with pytest.raises(TemplateRefused, match="built-in"):
        await catalogue.build("python", tiny)
    with pytest.raises(TemplateRefused, match="built-in"):
        await catalogue.delete("python")


@pytest.mark.parametrize("name", ["", "UPPER", "-dash", "a/b", "..", "x" * 33, "a b"])
async def test_bad_names_are_refused(catalogue, tiny, name) -> None:
    with pytest.raises(TemplateRefused, match="1-32 of a-z"):
        await catalogue.build(name, tiny)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        (TemplateSource("tar", "relative.tar"), "from_tar 'relative.tar': a path on the server"),
        (TemplateSource("tar", "/nonexistent.tar"), "from_tar '/nonexistent.tar': no such file"),
        (TemplateSource("image", "docker://busybox"), "the docker: transport is not offered"),
        (TemplateSource("image", "oci:/nonexistent:v1"), "no such directory"),
        (TemplateSource("image", "-rm"), "not a REF"),
        (TemplateSource("dockerfile", "/nonexistent/Dockerfile"), "no such file"),
    ],
)
async def test_a_source_that_is_not_there_is_refused_at_once(catalogue, source, words) -> None:
    with pytest.raises(TemplateRefused, match=words):
        await catalogue.build("x", source)
    assert catalogue.list()[1:] == []


async def test_a_failed_build_leaves_only_its_record(catalogue, tmp_path) -> None:
    hostile = small_root(tmp_path / "hostile.tar", member("../x", data=b"pwned"))
    await catalogue.build("bad", TemplateSource("tar", str(hostile)))
    info = await ended(catalogue, "bad")
    assert info.state is TemplateState.FAILED
    assert "member '../x'" in str(info.error) and any("'../x'" in line for line in info.log)
    with pytest.raises(TemplateFailed, match="member '../x'"):
        catalogue.ready("bad")
    assert [p.name for p in (catalogue.root / "bad").iterdir()] == ["template.json"]
    assert leftovers(catalogue) == []
    await catalogue.build("bad", TemplateSource("tar", str(small_root(tmp_path / "ok.tar"))))
    assert (await ended(catalogue, "bad")).state is TemplateState.READY  # built over a failure


async def test_a_template_in_use_cant_be_deleted(catalogue, tiny) -> None:
    using: set[str] = {"used"}
    catalogue.in_use = using.__contains__
    await catalogue.build("used", tiny)
    await ended(catalogue, "used")
    with pytest.raises(TemplateInUse, match="close them first"):
        await catalogue.delete("used")
    assert catalogue.ready("used")[0] is not None
    using.clear()
    await catalogue.delete("used")
    with pytest.raises(TemplateNotFound):
        await catalogue.delete("used")


def helpers() -> list[int]:
    """The pids of cloche's rootfs helpers running now."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"sandbox/rootfs.py") for part in cmdline):
            found.append(int(pid))
    return found


async def test_deleting_a_build_under_way_stops_it_and_leaves_nothing(
    catalogue: Templates, debian_tar: Path
) -> None:
    await catalogue.build("big", TemplateSource("tar", str(debian_tar)))
    deadline = time.monotonic() + 120
    while catalogue.get("big").progress.get("phase") != "extracting" or not helpers():
        assert time.monotonic() < deadline, catalogue.get("big").progress
        await asyncio.sleep(0.01)
    await catalogue.delete("big")
    assert helpers() == []
    assert sorted(p.name for p in catalogue.root.iterdir()) == []
    with pytest.raises(TemplateNotFound):
        catalogue.get("big")


async def test_an_upload_is_received_then_built_and_one_too_large_refused(
    tmp_path: Path,
) -> None:
    templates = Templates(tmp_path / "templates", max_upload_bytes=64 * 1024)
    await templates.open()
    data = small_root(tmp_path / "tiny.tar").read_bytes()

    async def pieces(blob: bytes) -> AsyncIterator[bytes]:
        for start in range(0, len(blob), 1000):
            yield blob[start : start + 1000]

    started = await templates.build("up", TemplateSource("tar", "upload"), pieces(data))
    assert started.source == {"kind": "tar", "ref": "upload"}
    assert (await ended(templates, "up")).state is TemplateState.READY
    with pytest.raises(TemplateRefused, match="--template-max-mib"):
        await templates.build("big", TemplateSource("tar", "upload"), pieces(b"x" * 100_000))
    with pytest.raises(TemplateRefused, match="empty"):
        await templates.build("none", TemplateSource("tar", "upload"), pieces(b""))
    assert list((templates.root / ".uploads").iterdir()) == []
    assert [t.name for t in templates.list()] == ["python", "up"]
    await templates.close()


async def test_a_new_catalogue_finds_templates_and_fails_interrupted_builds(
    tmp_path: Path, tiny
) -> None:
    root = tmp_path / "templates"
    first = Templates(root)
    await first.open()
    await first.build("kept", tiny)
    await ended(first, "kept")
    await first.close()
    # What a server killed mid-build leaves: a record still building, a half rootfs, its
    # build directory and an upload.
    (root / "cut").mkdir()
    (root / "cut" / "rootfs").mkdir()
    interrupted = TemplateInfo("cut", TemplateState.BUILDING, {"kind": "tar", "ref": "/x.tar"})
    (root / "cut" / "template.json").write_text(json.dumps(interrupted.to_json()))
    (root / ".build-cut-0123abcd" / "rootfs").mkdir(parents=True)
    (root / ".uploads").mkdir()
    (root / ".uploads" / "0123.tar").write_bytes(b"half")
    (root / "broken").mkdir()
    (root / "broken" / "template.json").write_text("{not json")

    second = Templates(root)
    await second.open()
    assert second.get("kept").state is TemplateState.READY
    assert second.ready("kept")[0] == root / "kept" / "rootfs"
    cut = second.get("cut")
    assert cut.state is TemplateState.FAILED and "interrupted" in str(cut.error)
    assert [p.name for p in (root / "cut").iterdir()] == ["template.json"]
    assert json.loads((root / "cut" / "template.json").read_text())["state"] == "failed"
    assert second.get("broken").state is TemplateState.FAILED
    assert leftovers(second) == []
    assert [t.name for t in second.list()] == ["python", "broken", "cut", "kept"]
    await second.close()


async def test_stopping_the_catalogue_records_its_builds_failed(tmp_path, debian_tar) -> None:
    root = tmp_path / "templates"
    templates = Templates(root)
    await templates.open()
    await templates.build("slow", TemplateSource("tar", str(debian_tar)))
    await asyncio.sleep(0.5)
    await templates.close()
    assert helpers() == []
    record = json.loads((root / "slow" / "template.json").read_text())
    assert record["state"] == "failed" and "cancelled" in record["error"]
    assert leftovers(templates) == [] and not (root / "slow" / "rootfs").exists()
