"""`cloche serve`: its flags, their environment variables, and the ServerConfig they make."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cloche.cli import build_parser
from cloche.commands.serve import config_from_args
from cloche.config import Limits, ServerConfig
from cloche.errors import ConfigError

CLOCHE = Path(sys.executable).parent / "cloche"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's CLOCHE_* settings must not change what these tests see."""
    for name in list(os.environ):
        if name.startswith("CLOCHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "200")


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def config_of(*argv: str, tmp_path: Path) -> ServerConfig:
    fixed = ["--state-dir", str(tmp_path / "state"), "--runtime-dir", str(tmp_path / "rt")]
    return config_from_args(serve_args(*fixed, *argv))


def serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def run_cloche(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if not CLOCHE.exists():
        pytest.skip(f"no cloche entry point next to {sys.executable}")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    return subprocess.run(
        [str(CLOCHE), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environment, **(env or {})},
    )


# help


EXPECTED_FLAGS = {
    "--host",
    "--tcp-port",
    "--http-port",
    "--backend",
    "--platform",
    "--pool-size",
    "--max-sessions",
    "--max-queued-cells",
    "--cell-timeout",
    "--interrupt-grace",
    "--memory-mib",
    "--nproc",
    "--nofile",
    "--disk-mib",
    "--output-limit",
    "--idle-timeout",
    "--lifetime",
    "--cpu-quota",
    "--max-frame-bytes",
    "--max-connections",
    "--connection-timeout",
    "--state-dir",
    "--runtime-dir",
    "--log-level",
    "--token",
    "--token-file",
}


def test_serve_help_does_document_every_flag_with_its_env_var(capsys):
    text = serve_help(capsys)
    flags = set(re.findall(r"\[(--[a-z-]+)[ \]]", text))
    assert flags >= EXPECTED_FLAGS
    for flag in flags:
        env = "CLOCHE_" + flag.removeprefix("--").upper().replace("-", "_")
        assert f"[env {env}" in text, flag


def test_serve_help_does_show_the_secure_defaults(capsys):
    text = serve_help(capsys)
    assert "[env CLOCHE_HOST] (default: 127.0.0.1)" in text
    assert "[env CLOCHE_CELL_TIMEOUT] (default: 30.0)" in text
    assert "[env CLOCHE_MEMORY_MIB] (default: 1024)" in text
    assert "{auto,gvisor,unsafe-local}" in text
    assert "NOT isolated" in text


def test_cloche_entry_point_does_print_the_serve_help():
    done = run_cloche("serve", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "usage: cloche serve" in text
    assert "[env CLOCHE_TCP_PORT]" in text and "[env CLOCHE_TOKEN_FILE]" in text


def test_cloche_does_require_a_command():
    done = run_cloche()
    assert done.returncode == 2
    assert "usage: cloche" in done.stderr


# defaults and the environment


def test_serve_defaults_do_match_the_server_config_defaults(tmp_path):
    config = config_of(tmp_path=tmp_path)
    assert config == ServerConfig(state_dir=tmp_path / "state", runtime_dir=tmp_path / "rt")


def test_env_vars_do_change_the_defaults(monkeypatch, tmp_path):
    env = {
        "CLOCHE_HOST": "0.0.0.0",
        "CLOCHE_TCP_PORT": "9000",
        "CLOCHE_HTTP_PORT": "9001",
        "CLOCHE_BACKEND": "unsafe-local",
        "CLOCHE_PLATFORM": "ptrace",
        "CLOCHE_POOL_SIZE": "5",
        "CLOCHE_MAX_SESSIONS": "7",
        "CLOCHE_MAX_QUEUED_CELLS": "3",
        "CLOCHE_CELL_TIMEOUT": "2.5",
        "CLOCHE_INTERRUPT_GRACE": "0.5",
        "CLOCHE_MEMORY_MIB": "512",
        "CLOCHE_NPROC": "32",
        "CLOCHE_DISK_MIB": "64",
        "CLOCHE_OUTPUT_LIMIT": "4096",
        "CLOCHE_IDLE_TIMEOUT": "60",
        "CLOCHE_LIFETIME": "3600",
        "CLOCHE_CPU_QUOTA": "1.5",
        "CLOCHE_MAX_FRAME_BYTES": "1024",
        "CLOCHE_MAX_CONNECTIONS": "10",
        "CLOCHE_CONNECTION_TIMEOUT": "5",
        "CLOCHE_STATE_DIR": str(tmp_path / "state"),
        "CLOCHE_RUNTIME_DIR": str(tmp_path / "rt"),
        "CLOCHE_LOG_LEVEL": "debug",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = serve_args()
    assert args.log_level == "debug"
    assert config_from_args(args) == ServerConfig(
        host="0.0.0.0",
        tcp_port=9000,
        http_port=9001,
        backend="unsafe-local",
        platform="ptrace",
        pool_size=5,
        max_sessions=7,
        max_queued_cells=3,
        max_frame_bytes=1024,
        max_connections=10,
        connection_idle_timeout_s=5.0,
        limits=Limits(
            cell_timeout_s=2.5,
            interrupt_grace_s=0.5,
            memory_mib=512,
            nproc=32,
            disk_mib=64,
            output_bytes=4096,
            idle_timeout_s=60.0,
            lifetime_s=3600.0,
            cpu_quota=1.5,
        ),
        state_dir=tmp_path / "state",
        runtime_dir=tmp_path / "rt",
    )


def test_env_var_does_show_as_the_default_in_help(monkeypatch, capsys):
    monkeypatch.setenv("CLOCHE_TCP_PORT", "9123")
    assert "[env CLOCHE_TCP_PORT] (default: 9123)" in serve_help(capsys)


def test_flag_does_override_its_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("CLOCHE_TCP_PORT", "9000")
    monkeypatch.setenv("CLOCHE_MEMORY_MIB", "512")
    config = config_of("--tcp-port", "7000", tmp_path=tmp_path)
    assert config.tcp_port == 7000
    assert config.limits.memory_mib == 512


def test_empty_env_var_does_leave_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("CLOCHE_TCP_PORT", "")
    monkeypatch.setenv("CLOCHE_TOKEN", "")
    config = config_of(tmp_path=tmp_path)
    assert config.tcp_port == ServerConfig().tcp_port
    assert config.tokens == frozenset()


@pytest.mark.parametrize(
    ("name", "value", "flag"),
    [
        ("CLOCHE_TCP_PORT", "nine", "--tcp-port"),
        ("CLOCHE_CELL_TIMEOUT", "30s", "--cell-timeout"),
        ("CLOCHE_BACKEND", "docker", "--backend"),
        ("CLOCHE_LOG_LEVEL", "verbose", "--log-level"),
    ],
)
def test_invalid_env_var_does_exit_with_a_usage_error_naming_it(
    monkeypatch, capsys, name, value, flag
):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        build_parser()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{name}='{value}'" in err
    assert flag in err


def test_invalid_flag_choice_does_exit_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        serve_args("--backend", "docker")
    assert exited.value.code == 2
    assert "--backend" in capsys.readouterr().err


# config_from_args


def test_config_from_args_does_build_the_limits_from_flags(tmp_path):
    config = config_of(
        "--cell-timeout",
        "12.5",
        "--interrupt-grace",
        "1",
        "--memory-mib",
        "256",
        "--nproc",
        "16",
        "--disk-mib",
        "32",
        "--output-limit",
        "1000",
        "--idle-timeout",
        "90",
        "--lifetime",
        "600",
        "--cpu-quota",
        "0.5",
        tmp_path=tmp_path,
    )
    assert config.limits == Limits(
        cell_timeout_s=12.5,
        interrupt_grace_s=1.0,
        memory_mib=256,
        nproc=16,
        disk_mib=32,
        output_bytes=1000,
        idle_timeout_s=90.0,
        lifetime_s=600.0,
        cpu_quota=0.5,
    )


def test_the_data_template_is_on_unless_turned_off(monkeypatch, tmp_path):
    assert config_of(tmp_path=tmp_path).data_template is True
    assert config_of("--data-template", "no", tmp_path=tmp_path).data_template is False
    monkeypatch.setenv("CLOCHE_DATA_TEMPLATE", "off")
    assert config_of(tmp_path=tmp_path).data_template is False


def test_config_from_args_does_clamp_a_negative_pool_size_to_zero(tmp_path):
    assert config_of("--pool-size", "-3", tmp_path=tmp_path).pool_size == 0


def test_config_from_args_does_merge_repeated_tokens_and_the_token_file(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text("from-file-1\n\n   from-file-2  \n   \nshared\n")
    config = config_of(
        "--token",
        "flag-1",
        "--token",
        "flag-2",
        "--token",
        "shared",
        "--token-file",
        str(token_file),
        tmp_path=tmp_path,
    )
    assert config.tokens == {"flag-1", "flag-2", "from-file-1", "from-file-2", "shared"}


def test_config_from_args_does_merge_env_tokens_with_flag_tokens(monkeypatch, tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text("from-file\n")
    monkeypatch.setenv("CLOCHE_TOKEN", "env-1,,env-2")
    monkeypatch.setenv("CLOCHE_TOKEN_FILE", str(token_file))
    config = config_of("--token", "flag", tmp_path=tmp_path)
    assert config.tokens == {"env-1", "env-2", "flag", "from-file"}


def test_config_from_args_does_raise_config_error_for_an_unreadable_token_file(tmp_path):
    with pytest.raises(ConfigError, match="--token-file"):
        config_of("--token-file", str(tmp_path / "missing"), tmp_path=tmp_path)


@pytest.mark.parametrize(
    ("flag", "value", "name"),
    [
        ("--cell-timeout", "0", "cell_timeout_s"),
        ("--cell-timeout", "-1.5", "cell_timeout_s"),
        ("--cell-timeout", "nan", "cell_timeout_s"),
        ("--memory-mib", "0", "memory_mib"),
        ("--nproc", "-1", "nproc"),
        ("--disk-mib", "0", "disk_mib"),
        ("--output-limit", "0", "output_bytes"),
        ("--idle-timeout", "0", "idle_timeout_s"),
        ("--lifetime", "-60", "lifetime_s"),
        ("--sandbox-start-timeout", "0", "sandbox_start_timeout_s"),
        ("--sandbox-start-timeout", "nan", "sandbox_start_timeout_s"),
    ],
)
def test_config_from_args_does_raise_config_error_for_a_non_positive_limit(
    tmp_path, flag, value, name
):
    with pytest.raises(ConfigError, match=f"{flag} must be a positive number"):
        config_of(f"{flag}={value}", tmp_path=tmp_path)


def test_config_from_args_does_accept_an_infinite_timeout(tmp_path):
    assert config_of("--lifetime", "inf", tmp_path=tmp_path).limits.lifetime_s == math.inf


def test_a_slow_machine_may_give_sandboxes_longer_to_start(tmp_path):
    assert config_of(tmp_path=tmp_path).sandbox_start_timeout_s == 60.0
    config = config_of("--sandbox-start-timeout", "600", tmp_path=tmp_path)
    assert config.sandbox_start_timeout_s == 600.0


def test_cloche_serve_does_exit_2_with_the_config_error(tmp_path):
    # Free ports and no pool, in case the check ever lets it start a server.
    safe = ["--tcp-port", "0", "--http-port", "0", "--pool-size", "0", "--state-dir", str(tmp_path)]
    done = run_cloche("serve", *safe, "--memory-mib", "0")
    assert done.returncode == 2
    assert "cloche serve: --memory-mib must be a positive number" in done.stderr
