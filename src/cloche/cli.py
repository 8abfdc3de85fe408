"""The `cloche` command line. `cloche serve --help` lists every server setting."""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.handlers
import os
import queue
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloche.commands import add_commands
from cloche.config import Limits, LLMConfig, PackageConfig, ServerConfig, default_state_dir
from cloche.errors import ConfigError
from cloche.server.logs import LOG_FORMATS, make_formatter


@dataclass(frozen=True)
class _Option:
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


def _default_runtime_dir() -> Path | None:
    """The sandbox runtime that the install script puts next to the virtualenv."""
    candidate = Path(sys.prefix).parent / ".runtime" / "site-packages"
    return candidate if candidate.is_dir() else None


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
    _Option("--host", str, _config.host, "address to listen on"),
    _Option(
        "--tcp-port", int, _config.tcp_port, "port of the REPL TCP protocol (0: any free port)"
    ),
    _Option("--http-port", int, _config.http_port, "port of the HTTP API (0: any free port)"),
    _Option(
        "--backend",
        str,
        _config.backend,
        "sandbox backend: gvisor (auto picks it; never falls back), or unsafe-local, "
        "which is NOT isolated",
        ("auto", "gvisor", "unsafe-local"),
    ),
    _Option(
        "--platform",
        str,
        _config.platform,
        "runsc platform (auto tries systrap, then ptrace)",
        ("auto", "systrap", "ptrace"),
    ),
    _Option("--pool-size", int, _config.pool_size, "started sandboxes kept ready for new sessions"),
    _Option(
        "--data-pool-size",
        int,
        _config.data_pool_size,
        "sandboxes with the data stack imported kept ready (~190 MiB each)",
    ),
    _Option(
        "--pool-max",
        int,
        _config.pool_max,
        "ready sandboxes a pool may grow to under bursts of new sessions (memory budget: "
        "lean ~15 MiB, data ~190 MiB each); it shrinks back when they stop",
    ),
    _Option(
        "--data-template",
        _flag,
        _config.data_template,
        "refill the data pool from a checkpoint of one started sandbox (~4x faster; ~50 MiB "
        "more per data session; they share its str hash seed); no: start each afresh",
    ),
    _Option("--max-sessions", int, _config.max_sessions, "sessions held at once; beyond, refused"),
    _Option(
        "--max-queued-cells",
        int,
        _config.max_queued_cells,
        "cells that may wait behind the running one in a session",
    ),
    _Option(
        "--history-cells",
        int,
        _config.history_cells,
        "cells each session's history keeps (GET /v1/sessions/{id}/cells; 0: none)",
    ),
    _Option(
        "--history-output-bytes",
        int,
        _config.history_output_bytes,
        "stdout and stderr each kept per history entry; the rest is cut with a marker",
    ),
    _Option(
        "--cell-slots",
        int,
        _config.cell_slots,
        "cells of all sessions running at once; the rest wait their turn in arrival order "
        "(0: four per core; a large number turns the turns off)",
    ),
    _Option(
        "--cell-slice",
        float,
        _config.cell_slice_s,
        "seconds a cell holds its turn; a longer one runs on at a low CPU weight",
    ),
    _Option(
        "--cell-timeout",
        float,
        _limits.cell_timeout_s,
        "wall time of a cell, seconds (a request may ask for less)",
    ),
    _Option(
        "--interrupt-grace",
        float,
        _limits.interrupt_grace_s,
        "seconds a cell may ignore an interrupt before its sandbox is killed",
    ),
    _Option("--memory-mib", int, _limits.memory_mib, "address space of a session, MiB (RLIMIT_AS)"),
    _Option("--nproc", int, _limits.nproc, "processes and threads in a session (RLIMIT_NPROC)"),
    _Option("--nofile", int, _limits.nofile, "open file descriptors in a session (RLIMIT_NOFILE)"),
    _Option("--disk-mib", int, _limits.disk_mib, "size of the working directory, and of /tmp, MiB"),
    _Option("--output-limit", int, _limits.output_bytes, "stdout+stderr kept per cell, bytes"),
    _Option(
        "--idle-timeout",
        float,
        _limits.idle_timeout_s,
        "seconds without a cell after which a session is closed",
    ),
    _Option("--lifetime", float, _limits.lifetime_s, "seconds after which any session is closed"),
    _Option("--cpu-quota", float, None, "CPU cores per sandbox (cgroup quota); default unlimited"),
    _Option(
        "--freeze-idle",
        float,
        _limits.freeze_idle_s,
        "seconds idle after which a session's sandbox is frozen (no CPU; thawed by its next "
        "cell; not while it is busy on its own; sleeping threads pause); 0 = never",
    ),
    _Option(
        "--pause-idle",
        float,
        _limits.pause_idle_s,
        "seconds idle after which a session is paused to disk (no memory; its next request "
        "resumes it); 0 = never",
    ),
    _Option(
        "--resume-at-start",
        _flag,
        _config.resume_at_start,
        "resume the sessions paused at the last shutdown as the server starts (most recently "
        "used first, one per core, while there is room); no: each on its next request",
    ),
    _Option(
        "--data-dir",
        Path,
        _config.data_dir,
        "where paused sessions, snapshots and session records live (root-only); a restarted "
        "server on the same directory resumes its sessions",
    ),
    _Option("--data-max-mib", int, _config.data_max_mib, "disk budget of --data-dir, MiB"),
    _Option(
        "--templates-dir",
        Path,
        None,
        "where templates are built and kept (root-only) [default: <--data-dir>/templates]",
    ),
    _Option(
        "--template-max-mib",
        int,
        _config.template_max_mib,
        "largest tarball or image uploaded as a template build's body, MiB",
    ),
    _Option(
        "--max-paused-sessions",
        int,
        _config.max_paused_sessions,
        "sessions paused on disk at once (not counted by --max-sessions)",
    ),
    _Option("--max-fork", int, _config.max_fork, "copies one fork request may make"),
    _Option(
        "--quota-wait",
        float,
        _config.quota_wait_s,
        "seconds a request over one of its tenant's quotas (--tokens) waits for room (a "
        "close, a pause) before it is refused with 429; 0: refused at once",
    ),
    _Option("--max-frame-bytes", int, _config.max_frame_bytes, "largest request frame, bytes"),
    _Option("--max-connections", int, _config.max_connections, "open TCP connections at once"),
    _Option(
        "--connection-timeout",
        float,
        _config.connection_idle_timeout_s,
        "seconds a TCP connection may stay silent (or take to send a frame)",
    ),
    _Option(
        "--cluster",
        str,
        None,
        "serve sessions held on the nodes of a Ray cluster (needs cloche[cluster]): local:N "
        "starts one of N nodes here; auto joins this machine's; HOST:PORT (the head's GCS) "
        "a remote one, from inside its network",
    ),
    _Option(
        "--node-grace",
        float,
        _config.node_grace_s,
        "seconds a drain moves a node's sessions at most (a pod leaving: its preStop runs "
        "`cloche nodes leave`); what is left is reported failed. Fits Kubernetes' 30 s",
    ),
    _Option(
        "--cluster-agent-port",
        int,
        _config.cluster_agent_port,
        "port of each node agent's data path in cluster mode (0: any free port)",
    ),
    _Option("--state-dir", Path, default_state_dir(), "where per-server runsc state lives"),
    _Option(
        "--runtime-dir",
        Path,
        None,
        "site-packages importable inside sandboxes (default: .runtime/ beside the venv)",
    ),
    _Option(
        "--profiles",
        Path,
        None,
        "TOML file of profiles built from requirements ([profiles.NAME] requirements, "
        "preload, pool, memory_mib)",
    ),
    _Option(
        "--egress-policy",
        Path,
        None,
        "TOML file of egress policies ([policies.NAME] allow, deny, limits): sessions reach "
        "the hosts their policy names through a proxy on this host; without it, no network",
    ),
    _Option(
        "--secrets",
        Path,
        None,
        "TOML file of secrets ([secrets.NAME] value, hosts), readable by its owner only: "
        "sessions whose policy names one hold a placeholder, and the egress proxy puts the "
        "value into their requests to its hosts",
    ),
    _Option(
        "--egress-audit",
        Path,
        None,
        "where egress records go, a JSON line per connection (default: "
        "<data-dir>/egress/audit.jsonl, rotated at 64 MiB)",
    ),
    _Option(
        "--packages",
        str,
        "on",
        "`%%pip install` in sessions: on, off, or allow-list:FILE (project names, one a line)",
    ),
    _Option(
        "--package-index",
        str,
        None,
        "index the server fetches wheels from (default: pip's configuration, i.e. PyPI)",
    ),
    _Option(
        "--package-max-mib",
        int,
        _packages.max_mib,
        "packages installed into one session, MiB unpacked",
    ),
    _Option("--package-cache-dir", Path, _packages.cache_dir, "the wheel cache shared by sessions"),
    _Option(
        "--llm-base-url",
        str,
        None,
        "OpenAI-compatible endpoint behind llm_query and /v1/chat/completions (RLM); its key "
        "is read from the environment variable CLOCHE_LLM_API_KEY only",
    ),
    _Option("--llm-model", str, None, "model of LLM calls that name none"),
    _Option("--llm-max-calls", int, _llm.max_calls, "LLM calls per session"),
    _Option("--llm-max-tokens", int, _llm.max_tokens, "LLM tokens per session (prompt+answer)"),
    _Option("--llm-concurrency", int, _llm.concurrency, "LLM calls in flight per session"),
    _Option(
        "--llm-timeout",
        float,
        _llm.timeout_s,
        "seconds a cell may wait for LLM answers in all (not counted by --cell-timeout)",
    ),
    _Option(
        "--llm-session-time",
        float,
        _llm.session_time_s,
        "seconds a session's cells may wait for LLM answers in all",
    ),
    _Option("--llm-max-prompt-chars", int, _llm.max_prompt_chars, "characters of one prompt"),
    _Option("--llm-max-retries", int, _llm.max_retries, "retries of a failed LLM call (429, 5xx)"),
    _Option(
        "--llm-log-prompts",
        _flag,
        _llm.log_prompts,
        "log prompts and answers at debug level (otherwise only their sizes)",
    ),
    _Option("--rlm-max-iterations", int, _llm.rlm_max_iterations, "root-model turns of an RLM run"),
    _Option(
        "--rlm-output-chars",
        int,
        _llm.rlm_output_chars,
        "REPL output shown to the RLM's root model per code block, characters",
    ),
    _Option(
        "--events-buffer",
        int,
        _config.events_buffer,
        "events kept for clients of GET /v1/events that resume with Last-Event-ID; also "
        "the events that may wait for each webhook receiver (beyond, dropped and counted)",
    ),
    _Option(
        "--webhook-secret",
        str,
        None,
        "key that signs webhooks (whsec_<base64>, as Standard Webhooks); default: one made "
        "once and kept in <data-dir>/webhook-secret (0600)",
    ),
    _Option(
        "--webhook-retry",
        float,
        _config.webhook_retry_s,
        "seconds after an event within which a failing webhook receiver is retried (backoff "
        "0.5 s doubling to 60 s); then the event is dropped and counted",
    ),
    _Option("--log-level", str, "info", "log level", ("debug", "info", "warning", "error")),
    _Option(
        "--log-format",
        str,
        "logfmt",
        "log lines as text with key=value pairs (logfmt), or one JSON object per line (json)",
        LOG_FORMATS,
    ),
)


def _env_default(parser: argparse.ArgumentParser, option: _Option) -> Any:
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


def _add_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the server",
        description="Run the cloche server. Every option can also be set by the environment "
        "variable shown, e.g. CLOCHE_TCP_PORT=9000.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
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
        "--cluster-insecure",
        action="store_true",
        default=_flag(os.environ.get("CLOCHE_CLUSTER_INSECURE", "no")),
        help="join a Ray cluster (--cluster auto|HOST:PORT) that does not enforce "
        "Ray's token authentication, or start local:N without it, with a warning at every "
        "start: anyone who reaches its ports can run code on its machines "
        "[env CLOCHE_CLUSTER_INSECURE]",
    )
    parser.set_defaults(handler=_serve)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig that `cloche serve` arguments describe."""
    tokens = set(args.token)
    if args.token_file is not None:
        try:
            lines = Path(args.token_file).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"can't read --token-file {args.token_file}: {exc}") from exc
        tokens |= {line.strip() for line in lines if line.strip()}
    limits = Limits(
        cell_timeout_s=args.cell_timeout,
        interrupt_grace_s=args.interrupt_grace,
        memory_mib=args.memory_mib,
        nproc=args.nproc,
        nofile=args.nofile,
        disk_mib=args.disk_mib,
        output_bytes=args.output_limit,
        idle_timeout_s=args.idle_timeout,
        lifetime_s=args.lifetime,
        cpu_quota=args.cpu_quota,
        freeze_idle_s=args.freeze_idle,
        pause_idle_s=args.pause_idle,
    )
    for flag, value in (("--freeze-idle", args.freeze_idle), ("--pause-idle", args.pause_idle)):
        if not value >= 0:  # NaN too
            raise ConfigError(f"{flag} must be 0 (never) or more, not {value}")
    if not 0 <= args.quota_wait < float("inf"):  # NaN too
        raise ConfigError(
            f"--quota-wait must be seconds, 0 (refuse at once) or more, not {args.quota_wait}"
        )
    for name, flag in (
        ("cell_timeout_s", "--cell-timeout"),
        ("memory_mib", "--memory-mib"),
        ("nproc", "--nproc"),
        ("nofile", "--nofile"),
        ("disk_mib", "--disk-mib"),
        ("output_bytes", "--output-limit"),
        ("idle_timeout_s", "--idle-timeout"),
        ("lifetime_s", "--lifetime"),
    ):
        if not getattr(limits, name) > 0:  # NaN too
            raise ConfigError(f"{flag} must be a positive number, not {getattr(limits, name)}")
    for flag, value in (
        ("--events-buffer", args.events_buffer),
        ("--webhook-retry", args.webhook_retry),
        ("--template-max-mib", args.template_max_mib),
    ):
        if not value > 0:  # NaN too
            raise ConfigError(f"{flag} must be a positive number, not {value}")
    return ServerConfig(
        host=args.host,
        tcp_port=args.tcp_port,
        http_port=args.http_port,
        backend=args.backend,
        platform=args.platform,
        pool_size=max(0, args.pool_size),
        data_pool_size=max(0, args.data_pool_size),
        pool_max=max(0, args.pool_max),
        data_template=args.data_template,
        resume_at_start=args.resume_at_start,
        max_sessions=args.max_sessions,
        max_queued_cells=args.max_queued_cells,
        history_cells=args.history_cells,
        history_output_bytes=args.history_output_bytes,
        cell_slots=args.cell_slots,
        cell_slice_s=args.cell_slice,
        max_frame_bytes=args.max_frame_bytes,
        max_connections=args.max_connections,
        connection_idle_timeout_s=args.connection_timeout,
        limits=limits,
        state_dir=args.state_dir,
        data_dir=args.data_dir,
        data_max_mib=args.data_max_mib,
        max_paused_sessions=args.max_paused_sessions,
        max_fork=args.max_fork,
        runtime_dir=args.runtime_dir or _default_runtime_dir(),
        tokens=frozenset(tokens),
        admin_tokens=frozenset(args.admin_token),
        tokens_file=args.tokens,
        quota_wait_s=args.quota_wait,
        llm=_llm_config(args),
        packages=_package_config(args),
        profiles_file=args.profiles,
        egress_policy=args.egress_policy,
        egress_audit=args.egress_audit,
        egress_secrets=args.secrets,
        cluster=args.cluster,
        cluster_agent_port=args.cluster_agent_port,
        node_grace_s=args.node_grace,
        cluster_insecure=args.cluster_insecure,
        events_buffer=args.events_buffer,
        webhooks=tuple(args.webhook),
        webhook_secret=args.webhook_secret,
        webhook_retry_s=args.webhook_retry,
        templates_dir=args.templates_dir,
        template_max_mib=args.template_max_mib,
    )


def _package_config(args: argparse.Namespace) -> PackageConfig:
    """--packages on|off|allow-list:FILE, --package-index, --package-max-mib."""
    from cloche.packages.requirements import read_allow_list

    mode: str = args.packages
    allow_list = None
    if mode.startswith("allow-list:"):
        allow_list = read_allow_list(Path(mode.split(":", 1)[1]))
    elif mode not in ("on", "off"):
        raise ConfigError(f"--packages must be on, off or allow-list:FILE, not {mode!r}")
    if args.package_max_mib <= 0:
        raise ConfigError(f"--package-max-mib must be positive, not {args.package_max_mib}")
    return PackageConfig(
        enabled=mode != "off",
        allow_list=allow_list,
        index_url=args.package_index,
        max_mib=args.package_max_mib,
        cache_dir=args.package_cache_dir,
    )


def _llm_config(args: argparse.Namespace) -> LLMConfig | None:
    """The LLM backend the arguments describe, or None without --llm-base-url."""
    if not args.llm_base_url:
        if args.llm_model:
            raise ConfigError("--llm-model needs --llm-base-url")
        return None
    if not args.llm_model:
        raise ConfigError("--llm-base-url needs --llm-model (the model of calls that name none)")
    config = LLMConfig(
        base_url=args.llm_base_url,
        model=args.llm_model,
        api_key=os.environ.get("CLOCHE_LLM_API_KEY", ""),
        max_calls=args.llm_max_calls,
        max_tokens=args.llm_max_tokens,
        concurrency=args.llm_concurrency,
        timeout_s=args.llm_timeout,
        session_time_s=args.llm_session_time,
        max_prompt_chars=args.llm_max_prompt_chars,
        max_retries=max(0, args.llm_max_retries),
        log_prompts=args.llm_log_prompts,
        rlm_max_iterations=args.rlm_max_iterations,
        rlm_output_chars=args.rlm_output_chars,
    )
    for name, flag in (
        ("max_calls", "--llm-max-calls"),
        ("max_tokens", "--llm-max-tokens"),
        ("concurrency", "--llm-concurrency"),
        ("timeout_s", "--llm-timeout"),
        ("session_time_s", "--llm-session-time"),
        ("max_prompt_chars", "--llm-max-prompt-chars"),
        ("rlm_max_iterations", "--rlm-max-iterations"),
        ("rlm_output_chars", "--rlm-output-chars"),
    ):
        if not getattr(config, name) > 0:  # NaN too
            raise ConfigError(f"{flag} must be a positive number, not {getattr(config, name)}")
    return config


class _Handoff(logging.handlers.QueueHandler):
    """Queues records as they are, for the writing thread to format. (The arguments of
    cloche's log lines are str and numbers, which nothing changes after the call.)"""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def _serve(args: argparse.Namespace) -> int:
    from cloche.server.app import Server

    # Log lines are formatted and written by a thread of their own: a line per cell is a
    # write(2) and ~0.1 ms of formatting, which the event loop shouldn't spend between cells.
    output = logging.StreamHandler(sys.stderr)
    output.setFormatter(make_formatter(args.log_format))
    lines: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    writer = logging.handlers.QueueListener(lines, output)
    logging.basicConfig(level=args.log_level.upper(), handlers=[_Handoff(lines)])
    writer.start()
    try:
        config = config_from_args(args)
        asyncio.run(Server(config).serve_forever())
    except ConfigError as exc:
        print(f"cloche serve: {exc}", file=sys.stderr)
        return 2
    finally:
        writer.stop()  # every line queued so far is written
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloche", description=__doc__)
    subparsers = parser.add_subparsers(title="commands", required=True)
    _add_serve(subparsers)
    add_commands(subparsers)  # run, repl, sessions, tool-schema, mcp: clients of a server
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
