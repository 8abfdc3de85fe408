"""The settings of `cloche serve`: each flag with its type, default and help, and the
environment variable that sets it too.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloche.config import Limits, LLMConfig, PackageConfig, ServerConfig, default_state_dir
from cloche.server.logs import LOG_FORMATS


@dataclass(frozen=True)
class Option:
    """One setting of `cloche serve`: its flag, and the CLOCHE_ variable named after it."""

    flag: str
    kind: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        return "CLOCHE_" + self.flag.removeprefix("--").upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def _flag(text: str) -> bool:
    """A yes/no setting: true/false, yes/no, on/off, 1/0."""
    value = {"true": True, "yes": True, "on": True, "1": True}.get(text.lower())
    if value is None and text.lower() not in ("false", "no", "off", "0"):
        raise ValueError(f"not a yes/no value: {text!r}")
    return bool(value)


_limits = Limits()
_config = ServerConfig()
_llm = LLMConfig(base_url="", model="")
_packages = PackageConfig()
SERVE_OPTIONS = (
    Option("--host", str, _config.host, "address to listen on"),
    Option("--tcp-port", int, _config.tcp_port, "port of the REPL TCP protocol (0: any free port)"),
    Option("--http-port", int, _config.http_port, "port of the HTTP API (0: any free port)"),
    Option(
        "--backend",
        str,
        _config.backend,
        "sandbox backend: gvisor (auto picks it; never falls back), or unsafe-local, "
        "which is NOT isolated",
        ("auto", "gvisor", "unsafe-local"),
    ),
    Option(
        "--platform",
        str,
        _config.platform,
        "runsc platform (auto tries systrap, then ptrace)",
        ("auto", "systrap", "ptrace"),
    ),
    Option("--pool-size", int, _config.pool_size, "started sandboxes kept ready for new sessions"),
    Option(
        "--data-pool-size",
        int,
        _config.data_pool_size,
        "sandboxes with the data stack imported kept ready (~190 MiB each)",
    ),
    Option(
        "--pool-max",
        int,
        _config.pool_max,
        "ready sandboxes a pool may grow to under bursts of new sessions (memory budget: "
        "lean ~15 MiB, data ~190 MiB each); it shrinks back when they stop",
    ),
    Option(
        "--data-template",
        _flag,
        _config.data_template,
        "refill the data pool from a checkpoint of one started sandbox (~4x faster; ~50 MiB "
        "more per data session; they share its str hash seed); no: start each afresh",
    ),
    Option("--max-sessions", int, _config.max_sessions, "sessions held at once; beyond, refused"),
    Option(
        "--max-queued-cells",
        int,
        _config.max_queued_cells,
        "cells that may wait behind the running one in a session",
    ),
    Option(
        "--history-cells",
        int,
        _config.history_cells,
        "cells each session's history keeps (GET /v1/sessions/{id}/cells; 0: none)",
    ),
    Option(
        "--history-output-bytes",
        int,
        _config.history_output_bytes,
        "stdout and stderr each kept per history entry; the rest is cut with a marker",
    ),
    Option(
        "--cell-slots",
        int,
        _config.cell_slots,
        "cells of all sessions running at once; the rest wait their turn in arrival order "
        "(0: four per core; a large number turns the turns off)",
    ),
    Option(
        "--cell-slice",
        float,
        _config.cell_slice_s,
        "seconds a cell holds its turn; a longer one runs on at a low CPU weight",
    ),
    Option(
        "--sandbox-start-timeout",
        float,
        _config.sandbox_start_timeout_s,
        "seconds a sandbox may take to start and answer (raise it on a slow machine)",
    ),
    Option(
        "--cell-timeout",
        float,
        _limits.cell_timeout_s,
        "wall time of a cell, seconds (a request may ask for less)",
    ),
    Option(
        "--interrupt-grace",
        float,
        _limits.interrupt_grace_s,
        "seconds a cell may ignore an interrupt before its sandbox is killed",
    ),
    Option("--memory-mib", int, _limits.memory_mib, "address space of a session, MiB (RLIMIT_AS)"),
    Option("--nproc", int, _limits.nproc, "processes and threads in a session (RLIMIT_NPROC)"),
    Option("--nofile", int, _limits.nofile, "open file descriptors in a session (RLIMIT_NOFILE)"),
    Option("--disk-mib", int, _limits.disk_mib, "size of the working directory, and of /tmp, MiB"),
    Option("--output-limit", int, _limits.output_bytes, "stdout+stderr kept per cell, bytes"),
    Option(
        "--idle-timeout",
        float,
        _limits.idle_timeout_s,
        "seconds without a cell after which a session is closed",
    ),
    Option("--lifetime", float, _limits.lifetime_s, "seconds after which any session is closed"),
    Option("--cpu-quota", float, None, "CPU cores per sandbox (cgroup quota); default unlimited"),
    Option(
        "--freeze-idle",
        float,
        _limits.freeze_idle_s,
        "seconds idle after which a session's sandbox is frozen (no CPU; thawed by its next "
        "cell; not while it is busy on its own; sleeping threads pause); 0 = never",
    ),
    Option(
        "--pause-idle",
        float,
        _limits.pause_idle_s,
        "seconds idle after which a session is paused to disk (no memory; its next request "
        "resumes it); 0 = never",
    ),
    Option(
        "--resume-at-start",
        _flag,
        _config.resume_at_start,
        "resume the sessions paused at the last shutdown as the server starts (most recently "
        "used first, one per core, while there is room); no: each on its next request",
    ),
    Option(
        "--data-dir",
        Path,
        _config.data_dir,
        "where paused sessions, snapshots and session records live (root-only); a restarted "
        "server on the same directory resumes its sessions",
    ),
    Option("--data-max-mib", int, _config.data_max_mib, "disk budget of --data-dir, MiB"),
    Option(
        "--templates-dir",
        Path,
        None,
        "where templates are built and kept (root-only) [default: <--data-dir>/templates]",
    ),
    Option(
        "--template-max-mib",
        int,
        _config.template_max_mib,
        "largest tarball or image uploaded as a template build's body, MiB",
    ),
    Option(
        "--volumes-dir",
        Path,
        None,
        "where volumes are kept, each an ext4 image of its size (root-only); found again at "
        "start [default: <--data-dir>/volumes]",
    ),
    Option(
        "--volume-max-mib",
        int,
        _config.volume_max_mib,
        "the largest size one volume may have, MiB (each is allocated in full on disk)",
    ),
    Option(
        "--max-paused-sessions",
        int,
        _config.max_paused_sessions,
        "sessions paused on disk at once (not counted by --max-sessions)",
    ),
    Option("--max-fork", int, _config.max_fork, "copies one fork request may make"),
    Option(
        "--quota-wait",
        float,
        _config.quota_wait_s,
        "seconds a request over one of its tenant's quotas (--tokens) waits for room (a "
        "close, a pause) before it is refused with 429; 0: refused at once",
    ),
    Option("--max-frame-bytes", int, _config.max_frame_bytes, "largest request frame, bytes"),
    Option("--max-connections", int, _config.max_connections, "open TCP connections at once"),
    Option(
        "--connection-timeout",
        float,
        _config.connection_idle_timeout_s,
        "seconds a TCP connection may stay silent (or take to send a frame)",
    ),
    Option(
        "--cluster",
        str,
        None,
        "serve sessions held on the nodes of a Ray cluster (needs cloche[cluster]): local:N "
        "starts one of N nodes here; auto joins this machine's; HOST:PORT (the head's GCS) "
        "a remote one, from inside its network",
    ),
    Option(
        "--node-grace",
        float,
        _config.node_grace_s,
        "seconds a drain moves a node's sessions at most (a pod leaving: its preStop runs "
        "`cloche nodes leave`); what is left is reported failed. Fits Kubernetes' 30 s",
    ),
    Option(
        "--node-deadline",
        float,
        _config.node_deadline_s,
        "seconds a node's agent may answer nothing (heartbeats every 0.5 s) before its node "
        "is declared dead for good (2 starved cores answered up to 15 s late)",
    ),
    Option(
        "--cluster-agent-port",
        int,
        _config.cluster_agent_port,
        "port of each node agent's data path in cluster mode (0: any free port)",
    ),
    Option("--state-dir", Path, default_state_dir(), "where per-server runsc state lives"),
    Option(
        "--runtime-dir",
        Path,
        None,
        "site-packages importable inside sandboxes (default: .runtime/ beside the venv)",
    ),
    Option(
        "--profiles",
        Path,
        None,
        "TOML file of profiles built from requirements ([profiles.NAME] requirements, "
        "preload, pool, memory_mib)",
    ),
    Option(
        "--egress-policy",
        Path,
        None,
        "TOML file of egress policies ([policies.NAME] allow, deny, limits): sessions reach "
        "the hosts their policy names through a proxy on this host; without it, no network",
    ),
    Option(
        "--secrets",
        Path,
        None,
        "TOML file of secrets ([secrets.NAME] value, hosts), readable by its owner only: "
        "sessions whose policy names one hold a placeholder, and the egress proxy puts the "
        "value into their requests to its hosts",
    ),
    Option(
        "--egress-audit",
        Path,
        None,
        "where egress records go, a JSON line per connection (default: "
        "<data-dir>/egress/audit.jsonl, rotated at 64 MiB)",
    ),
    Option(
        "--preview-domain",
        str,
        None,
        "serve a session's ports at {port}-{session id}.DOMAIN too (a wildcard DNS name that "
        "reaches this server: preview.example.com, https://preview.example.com behind a TLS "
        "proxy, or localhost:8080 for a browser on this machine); preview URLs name it",
    ),
    Option(
        "--packages",
        str,
        "on",
        "`%%pip install` in sessions: on, off, or allow-list:FILE (project names, one a line)",
    ),
    Option(
        "--package-index",
        str,
        None,
        "index the server fetches wheels from (default: pip's configuration, i.e. PyPI)",
    ),
    Option(
        "--package-max-mib",
        int,
        _packages.max_mib,
        "packages installed into one session, MiB unpacked",
    ),
    Option("--package-cache-dir", Path, _packages.cache_dir, "the wheel cache shared by sessions"),
    Option(
        "--llm-base-url",
        str,
        None,
        "OpenAI-compatible endpoint behind llm_query and /v1/chat/completions (RLM); its key "
        "is read from the environment variable CLOCHE_LLM_API_KEY only",
    ),
    Option("--llm-model", str, None, "model of LLM calls that name none"),
    Option("--llm-max-calls", int, _llm.max_calls, "LLM calls per session"),
    Option("--llm-max-tokens", int, _llm.max_tokens, "LLM tokens per session (prompt+answer)"),
    Option("--llm-concurrency", int, _llm.concurrency, "LLM calls in flight per session"),
    Option(
        "--llm-timeout",
        float,
        _llm.timeout_s,
        "seconds a cell may wait for LLM answers in all (not counted by --cell-timeout)",
    ),
    Option(
        "--llm-session-time",
        float,
        _llm.session_time_s,
        "seconds a session's cells may wait for LLM answers in all",
    ),
    Option("--llm-max-prompt-chars", int, _llm.max_prompt_chars, "characters of one prompt"),
    Option("--llm-max-retries", int, _llm.max_retries, "retries of a failed LLM call (429, 5xx)"),
    Option(
        "--llm-log-prompts",
        _flag,
        _llm.log_prompts,
        "log prompts and answers at debug level (otherwise only their sizes)",
    ),
    Option("--rlm-max-iterations", int, _llm.rlm_max_iterations, "root-model turns of an RLM run"),
    Option(
        "--rlm-output-chars",
        int,
        _llm.rlm_output_chars,
        "REPL output shown to the RLM's root model per code block, characters",
    ),
    Option(
        "--events-buffer",
        int,
        _config.events_buffer,
        "events kept for clients of GET /v1/events that resume with Last-Event-ID; also "
        "the events that may wait for each webhook receiver (beyond, dropped and counted)",
    ),
    Option(
        "--webhook-secret",
        str,
        None,
        "key that signs webhooks (whsec_<base64>, as Standard Webhooks); default: one made "
        "once and kept in <data-dir>/webhook-secret (0600)",
    ),
    Option(
        "--webhook-retry",
        float,
        _config.webhook_retry_s,
        "seconds after an event within which a failing webhook receiver is retried (backoff "
        "0.5 s doubling to 60 s); then the event is dropped and counted",
    ),
    Option("--log-level", str, "info", "log level", ("debug", "info", "warning", "error")),
    Option(
        "--log-format",
        str,
        "logfmt",
        "log lines as text with key=value pairs (logfmt), or one JSON object per line (json)",
        LOG_FORMATS,
    ),
)


def _env_default(parser: argparse.ArgumentParser, option: Option) -> Any:
    """The option's default, or its environment variable checked as the flag would be."""
    raw = os.environ.get(option.env)
    if raw in (None, ""):
        return option.default
    try:
        value = option.kind(raw)
    except ValueError:
        parser.error(f"{option.env}={raw!r} is not a valid value for {option.flag}")
    if option.choices is not None and value not in option.choices:
        parser.error(f"{option.env}={raw!r}: {option.flag} must be one of {option.choices}")
    return value


def add_settings(parser: argparse.ArgumentParser) -> None:
    """Give `cloche serve`'s parser every setting, each defaulting to its variable's value."""
    for option in SERVE_OPTIONS:
        parser.add_argument(
            option.flag,
            type=option.kind,
            default=_env_default(parser, option),
            choices=option.choices,
            help=f"{option.help} [env {option.env}]",
        )
    parser.add_argument(
        "--token",
        action="append",
        default=[t for t in os.environ.get("CLOCHE_TOKEN", "").split(",") if t],
        help="accept only requests carrying this token (repeatable) [env CLOCHE_TOKEN, "
        "comma-separated]; each session belongs to the token that created it",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=os.environ.get("CLOCHE_TOKEN_FILE") or None,
        help="file with one accepted token per line [env CLOCHE_TOKEN_FILE]",
    )
    parser.add_argument(
        "--admin-token",
        action="append",
        default=[t for t in os.environ.get("CLOCHE_ADMIN_TOKEN", "").split(",") if t],
        help="accept this token as an admin's (repeatable): it may also view the cluster, "
        "drain and resume nodes, and list every tenant's sessions (?all=true) "
        "[env CLOCHE_ADMIN_TOKEN, comma-separated]",
    )
    parser.add_argument(
        "--tokens",
        type=Path,
        default=os.environ.get("CLOCHE_TOKENS") or None,
        help="TOML file of tenants, readable by its owner only: [tokens.NAME] token (or "
        "token_sha256), role (user or admin), max_live_sessions, max_paused_sessions, "
        "max_running_cells, max_snapshot_bytes, egress (a policy name), webhook, "
        "webhook_secret [env CLOCHE_TOKENS]",
    )
    parser.add_argument(
        "--webhook",
        action="append",
        default=[u for u in os.environ.get("CLOCHE_WEBHOOK", "").split(",") if u],
        help="POST every event to this URL, signed with --webhook-secret (repeatable) "
        "[env CLOCHE_WEBHOOK, comma-separated]",
    )
    parser.add_argument(
        "--no-root",
        action="store_true",
        default=_flag(os.environ.get("CLOCHE_NO_ROOT", "no")),
        help="no command runs as root inside a sandbox (a request for it is a 403): nothing "
        "there ever has uid 0 [env CLOCHE_NO_ROOT]",
    )
    parser.add_argument(
        "--cluster-insecure",
        action="store_true",
        default=_flag(os.environ.get("CLOCHE_CLUSTER_INSECURE", "no")),
        help="join a Ray cluster (--cluster auto|HOST:PORT) that does not enforce "
        "Ray's token authentication, or start local:N without it, with a warning at every "
        "start: anyone who reaches its ports can run code on its machines "
        "[env CLOCHE_CLUSTER_INSECURE]",
    )
