"""State directories: a server cleans what a server that is gone left, and nothing else."""

from pathlib import Path

from cloche.sandbox.state import StateDir


def _cleaned_by_a_new_server(base: Path) -> list[str]:
    cleaned: list[str] = []
    state = StateDir(base)
    state.claim(lambda directory: cleaned.append(directory.name))
    state.release()
    return cleaned


def test_a_gone_servers_directory_is_cleaned(tmp_path):
    gone = tmp_path / "1234-abcdef"  # no lock file: its server is gone
    (gone / "sandboxes").mkdir(parents=True)
    unlocked = tmp_path / "99-012345"  # a lock file nobody holds
    unlocked.mkdir()
    (tmp_path / "99-012345.lock").touch()

    assert _cleaned_by_a_new_server(tmp_path) == ["1234-abcdef", "99-012345"]
    assert not gone.exists() and not unlocked.exists()
    assert not (tmp_path / "99-012345.lock").exists()


def test_a_live_servers_directory_is_left_alone(tmp_path):
    live = StateDir(tmp_path)
    live.claim(lambda directory: None)
    try:
        (live.path / "sandboxes").mkdir()
        assert _cleaned_by_a_new_server(tmp_path) == []
        assert (live.path / "sandboxes").is_dir()
    finally:
        live.release()


def test_directories_not_named_as_servers_are_left_alone(tmp_path):
    """A local cluster's node directories (each a node agent's base, with the agent's own
    directory and lock inside) beside a server given the same base: found in the full
    run, where a second server wiped a live cluster's nodes and a session's files with
    them."""
    node = tmp_path / "node-0"
    agent = StateDir(node)
    agent.claim(lambda directory: None)
    try:
        (tmp_path / "operators-notes").mkdir()
        assert _cleaned_by_a_new_server(tmp_path) == []
        assert agent.path.is_dir()
        assert (tmp_path / "operators-notes").is_dir()
    finally:
        agent.release()
