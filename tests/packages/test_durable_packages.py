"""Packages installed into a session are part of it: pause, snapshot and fork keep them."""

from __future__ import annotations

import cloche


def test_installed_packages_survive_pause_snapshot_and_fork(pkg_server, session):
    installed = session.run("%pip install tabulate==0.9.0\nimport tabulate\ntabulate.__version__")
    assert installed.text == "'0.9.0'", installed
    assert session.pause().state == "paused"
    assert session.run("tabulate.tabulate([[1, 2]])").ok  # the module, still imported
    # A fresh import from the site directory, in a copy and in a restored snapshot.
    probe = "import sys; sys.modules.pop('tabulate'); import tabulate; tabulate.__version__"
    (copy,) = session.fork(1)
    snapshot = session.snapshot()
    with cloche.Client(f"http://127.0.0.1:{pkg_server.http_port}") as client:
        with client.create_session(snapshot=snapshot) as restored:
            assert restored.run(probe).text == "'0.9.0'"
        client.delete_snapshot(snapshot.id)
    try:
        assert copy.run(probe).text == "'0.9.0'"
    finally:
        copy.close()
