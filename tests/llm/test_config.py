"""The LLM settings of `cloche serve`: flags, environment, and the key's handling."""

from __future__ import annotations

import pytest

from cloche.cli import build_parser
from cloche.commands.serve import config_from_args
from cloche.errors import ConfigError


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_no_llm_without_a_base_url():
    assert parse().llm is None


def test_the_key_comes_from_the_environment_only(monkeypatch):
    monkeypatch.setenv("CLOCHE_LLM_API_KEY", "sk-secret-canary")
    config = parse("--llm-base-url", "http://127.0.0.1:9/v1", "--llm-model", "m")
    assert config.llm is not None
    assert config.llm.api_key == "sk-secret-canary"
    assert "sk-secret-canary" not in repr(config)
    with pytest.raises(SystemExit):
        parse("--llm-api-key", "x")


def test_every_llm_setting_is_a_flag_and_an_environment_variable(monkeypatch):
    monkeypatch.setenv("CLOCHE_LLM_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("CLOCHE_LLM_MODEL", "env-model")
    monkeypatch.setenv("CLOCHE_LLM_MAX_CALLS", "7")
    monkeypatch.setenv("CLOCHE_LLM_LOG_PROMPTS", "yes")
    config = parse("--llm-timeout", "12.5", "--rlm-max-iterations", "3")
    assert config.llm is not None
    assert (config.llm.model, config.llm.max_calls, config.llm.log_prompts) == (
        "env-model",
        7,
        True,
    )
    assert (config.llm.timeout_s, config.llm.rlm_max_iterations) == (12.5, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--llm-base-url", "http://x/v1"], "--llm-base-url needs --llm-model"),
        (["--llm-model", "m"], "--llm-model needs --llm-base-url"),
        (
            ["--llm-base-url", "http://x/v1", "--llm-model", "m", "--llm-max-calls", "0"],
            "--llm-max-calls must be a positive number",
        ),
    ],
)
def test_bad_llm_settings_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)
