"""A cluster's front end offers no volumes (README, "Volumes": a volume is one machine's
file system): every volume verb, and a session asking for volumes, is NotSupported (501),
saying why; checked on the class, without starting Ray (tests/cluster/test_cluster.py
asks a running cluster over HTTP)."""

from __future__ import annotations

import inspect

import pytest

from cloche.cluster.manager import ClusterSessionManager
from cloche.errors import NotSupported
from cloche.sessions.volumes import VolumeVerbs

VERBS = [name for name, _ in inspect.getmembers(VolumeVerbs) if not name.startswith("_")]


@pytest.mark.parametrize("verb", VERBS)
async def test_every_volume_verb_is_not_supported_over_a_cluster(verb: str) -> None:
    method = getattr(ClusterSessionManager, verb)
    assert method is getattr(VolumeVerbs, verb), f"{verb} is overridden: say so in README"
    arguments = {"name": "data", "size_mib": 4, "path": "f", "chunks": None}
    wanted = [p for p in inspect.signature(method).parameters if p in arguments]
    with pytest.raises(NotSupported, match="--cluster"):
        await method(object(), *(arguments[p] for p in wanted))


async def test_a_session_with_volumes_is_not_supported_over_a_cluster() -> None:
    with pytest.raises(NotSupported, match="--cluster"):
        await ClusterSessionManager.create(object(), volumes=[{"name": "data"}])  # type: ignore[arg-type]
