"""`cloche serve`: the server, configured by its settings (`commands/settings.py`); its
log lines formatted and written by a thread of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.handlers
import os
import queue
import sys
from pathlib import Path
from typing import Any

from cloche.commands.settings import add_settings
from cloche.config import Limits, LLMConfig, PackageConfig, ServerConfig
from cloche.errors import ConfigError
from cloche.server.logs import make_formatter


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the server",
        description="Run the cloche server. Every option can also be set by the environment "
        "variable shown, e.g. CLOCHE_TCP_PORT=9000.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_settings(parser)
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
        ("--node-deadline", args.node_deadline),
        ("--template-max-mib", args.template_max_mib),
        ("--sandbox-start-timeout", args.sandbox_start_timeout),
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
        sandbox_start_timeout_s=args.sandbox_start_timeout,
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
        preview_domain=args.preview_domain,
        cluster=args.cluster,
        cluster_agent_port=args.cluster_agent_port,
        node_grace_s=args.node_grace,
        node_deadline_s=args.node_deadline,
        cluster_insecure=args.cluster_insecure,
        events_buffer=args.events_buffer,
        webhooks=tuple(args.webhook),
        webhook_secret=args.webhook_secret,
        webhook_retry_s=args.webhook_retry,
        templates_dir=args.templates_dir,
        template_max_mib=args.template_max_mib,
        volumes_dir=args.volumes_dir,
        volume_max_mib=args.volume_max_mib,
        no_root=args.no_root,
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


def _default_runtime_dir() -> Path | None:
    """The sandbox runtime that the install script puts next to the virtualenv."""
    candidate = Path(sys.prefix).parent / ".runtime" / "site-packages"
    return candidate if candidate.is_dir() else None


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
