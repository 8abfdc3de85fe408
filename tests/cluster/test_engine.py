"""Bad --cluster settings are told at once, clearly, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloche.cluster.engine import Engine
from cloche.errors import ConfigError
from support import make_config, require_cluster


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("local:x", "local:N takes 1 to 16 nodes"),
        ("local:0", "local:N takes 1 to 16 nodes"),
        ("local:99", "local:N takes 1 to 16 nodes"),
        ("nonsense", "must be local:N, auto or HOST:PORT"),
        ("ray://127.0.0.1:10001", r"Ray Client\) is not supported: a front end sends cells"),
        ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1"),
    ],
)
def test_a_bad_cluster_setting_is_refused_with_what_to_give(
    tmp_path: Path, spec: str, message: str
) -> None:
    require_cluster()
    engine = Engine(make_config(tmp_path, cluster=spec))
    with pytest.raises(ConfigError, match=message):
        engine.open()
    assert not engine.local
