"""Typed, frozen configuration. Units are in the names; defaults are the secure ones."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """What one session may use. See the limits table in the execution spec."""

    cell_timeout_s: float = 30.0
    interrupt_grace_s: float = 2.0
    memory_mib: int = 1024  # RLIMIT_AS of the sandboxed interpreter
    nproc: int = 64  # RLIMIT_NPROC inside the sandbox
    disk_mib: int = 256  # working directory, and /tmp, each
    output_bytes: int = 1 * MIB  # stdout + stderr kept per cell
    nofile: int = 1024  # RLIMIT_NOFILE
    idle_timeout_s: float = 30 * 60.0
    lifetime_s: float = 24 * 3600.0
    pids_cgroup: int = 512  # host-side backstop; gVisor's own threads count too
    cpu_quota: float | None = None  # cores; None = unlimited
    # Seconds a session may sit idle before its sandbox is frozen (cgroup freezer): an idle
    # runsc sandbox burns 2-3% of a core; a frozen one nothing, and thaws in its next cell.
    # One whose sandbox is busy on its own (a background thread) is left running; one that
    # is frozen pauses its sleeping threads too. 0: never. (Pooled sandboxes are not frozen:
    # one killed from outside while frozen would die only when thawed, after being handed out.)
    freeze_idle_s: float = 30.0
    # Seconds a session may sit idle before it is paused to disk (`--pause-idle`): its
    # sandbox is checkpointed and stopped, and its next request brings it back. 0: never.
    pause_idle_s: float = 600.0

    @property
    def cgroup_memory_mib(self) -> int:
        """The host cgroup backstop: the rlimit, plus /tmp (held in the sentry), plus slack."""
        return self.memory_mib + self.disk_mib + 128


@dataclass(frozen=True)
class LLMConfig:
    """The language model that cells reach through `llm_query`, and what a session may spend.

    The key and the endpoint stay on the host: the sandbox sees neither.
    """

    base_url: str  # an OpenAI-compatible endpoint, e.g. https://api.openai.com/v1
    model: str  # used when a call names no model
    api_key: str = field(default="", repr=False)  # from CLOCHE_LLM_API_KEY only
    max_calls: int = 1000  # model requests per session (each prompt of a batch is one)
    max_tokens: int = 2_000_000  # prompt + completion tokens per session
    concurrency: int = 8  # requests in flight per session
    timeout_s: float = 300.0  # LLM waiting per cell, not counted by --cell-timeout
    session_time_s: float = 3600.0  # LLM waiting per session, in all
    max_prompt_chars: int = 2_000_000  # one prompt
    max_batch: int = 1024  # prompts in one llm_query_batched request
    max_retries: int = 2  # retries of a failed request by the client (429, 5xx, network)
    log_prompts: bool = False  # log prompts and answers (at debug level)
    rlm_max_iterations: int = 20  # root-model turns of one RLM run
    rlm_output_chars: int = 20_000  # REPL output shown to the root model per code block


def default_data_dir() -> Path:
    """Where paused sessions and snapshots live: /var/lib/cloche as root."""
    if os.geteuid() == 0:
        return Path("/var/lib/cloche")
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "cloche"


def default_package_cache_dir() -> Path:
    """Where downloaded wheels are kept across restarts (shared by every session)."""
    if os.geteuid() == 0:
        return Path("/var/cache/cloche/packages")
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache) if cache else Path.home() / ".cache") / "cloche" / "packages"


@dataclass(frozen=True)
class PackageConfig:
    """`%pip install` in sessions: the host fetches wheels, the sandbox only sees files."""

    enabled: bool = True  # --packages on|off
    allow_list: frozenset[str] | None = None  # normalised project names; None: any
    index_url: str | None = None  # --package-index; None: pip's own configuration (PyPI)
    max_mib: int = 512  # unpacked packages per session
    cache_dir: Path = field(default_factory=default_package_cache_dir)
    timeout_s: float = 300.0  # one install (resolve, download, unpack); the cell's clock waits


def default_state_dir() -> Path:
    """Where per-server state lives: /run/cloche as root, else a private tmp dir."""
    if os.geteuid() == 0:
        return Path("/run/cloche")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "cloche" if runtime else Path(f"/tmp/cloche-{os.geteuid()}")  # noqa: S108


@dataclass(frozen=True)
class ServerConfig:
    """Everything `cloche serve` is told."""

    host: str = "127.0.0.1"
    tcp_port: int = 8000
    http_port: int = 8080
    backend: str = "auto"
    pool_size: int = 2  # ready `lean` sandboxes
    data_pool_size: int = 1  # ready `data` sandboxes (the data stack imported)
    # Each pool grows to the largest recent burst of new sessions, up to this many ready
    # sandboxes (lean ~15 MiB each, data ~190 MiB), and shrinks back when demand falls.
    pool_max: int = 8
    # Refill the data pool by restoring a checkpoint of one started sandbox: ~4x faster than
    # starting and importing, for ~50 MiB more per data session and one shared hash seed.
    data_template: bool = True
    max_sessions: int = 100
    max_queued_cells: int = 16  # per session, beyond the running one
    # Sessions paused at shutdown are resumed at the next start, most recently used first.
    resume_at_start: bool = True
    history_cells: int = 200  # cells each session's history keeps (--history-cells)
    history_output_bytes: int = 64 * 1024  # of stdout and of stderr, per history entry
    # Cells of all sessions run at most this many at once; the rest wait their turn, in the
    # order they came (sessions/gate.py). 0: four per core.
    cell_slots: int = 0
    # A cell holds its turn this long at most; one that runs longer gives it up and runs on
    # at a low CPU weight, behind the short cells.
    cell_slice_s: float = 0.05
    max_frame_bytes: int = 16 * MIB
    max_connections: int = 1024
    connection_idle_timeout_s: float = 300.0
    limits: Limits = field(default_factory=Limits)
    state_dir: Path = field(default_factory=default_state_dir)
    runtime_dir: Path | None = None  # site-packages for code inside the sandbox
    # Paused sessions, snapshots and the records of sessions (root-only: images hold memory).
    data_dir: Path = field(default_factory=default_data_dir)
    data_max_mib: int = 20 * 1024  # disk budget of data_dir
    max_paused_sessions: int = 5000
    max_fork: int = 16  # copies one fork request may make
    pause_concurrency: int = 4  # sessions paused at once at shutdown
    tokens: frozenset[str] = frozenset()  # --token: users without quotas
    admin_tokens: frozenset[str] = frozenset()  # --admin-token: admins without quotas
    tokens_file: Path | None = None  # --tokens: TOML of tenants (role, quotas, egress)
    # Seconds a request over one of its tenant's quotas waits for room, then 429.
    quota_wait_s: float = 10.0
    platform: str = "auto"  # runsc platform: auto, systrap, ptrace
    # Commands never run as root inside the sandbox (--no-root): nothing there has uid 0.
    no_root: bool = False
    start_concurrency: int = 0  # sandboxes started at once by the pool; 0 = number of cores
    # A sandbox's start, until its kernel answers: a pool's refill, a restore, the platform's
    # probe at start-up. Raise it on a slow machine (an emulated CPU: 10-20x slower).
    sandbox_start_timeout_s: float = 60.0
    llm: LLMConfig | None = None  # llm_query and the RLM endpoint; None: off
    packages: PackageConfig = field(default_factory=PackageConfig)
    profiles_file: Path | None = None  # --profiles: TOML of profiles built from requirements
    # --egress-policy: TOML of named policies; sessions get egress only through it. None: none.
    egress_policy: Path | None = None
    egress_audit: Path | None = None  # JSON lines of egress; None: <data_dir>/egress/audit.jsonl
    egress_secrets: Path | None = None  # --secrets: values the proxy puts into requests
    # --preview-domain: ports served at {port}-{id}.DOMAIN too, and preview URLs name it
    preview_domain: str | None = None
    # --cluster: sessions on the nodes of a Ray cluster (local:N, auto, HOST:PORT);
    # None: in this process
    cluster: str | None = None
    cluster_agent_port: int = 7100  # each node agent's data path (0: any free port)
    # A drain (a node's pod leaving: its preStop) moves sessions for this long at most; what
    # is left is reported failed. Fits Kubernetes' default grace of 30 s.
    node_grace_s: float = 25.0
    # A node whose agent answers nothing on the data path (heartbeats every 0.5 s, or any
    # other reply) for this long is declared dead, for good. Chosen from heartbeats measured
    # on 2 shared cores starved by CPU hogs (benchmarks/bench_heartbeats.py, results in
    # benchmarks/results/heartbeats.md): idle, round trips up to 0.65 s; 16 hogs (load
    # 19-29), up to 5.96 s (p99 5.93 s) and 6.47 s between two answers, 7.15 s while a drain
    # ran (load 39-68); 32 hogs (load 45-69), up to 14.7 s and 15.2 s between two answers
    # while a drain ran. 30 s is twice the worst; the old 5 s took a live, starved agent for
    # dead mid-drain at a load of 16-18. A frozen machine is declared dead this late; a
    # killed agent at once (its connection ends).
    node_deadline_s: float = 30.0
    # Join a Ray cluster that does not enforce token authentication (with a warning).
    cluster_insecure: bool = False
    # Events (GET /v1/events, webhooks): the last this many are kept for Last-Event-ID,
    # and this many may wait for each webhook receiver.
    events_buffer: int = 10_000
    webhooks: tuple[str, ...] = ()  # --webhook: URLs every event is POSTed to
    # --webhook-secret (whsec_<base64>); None: the one kept in <data_dir>/webhook-secret
    webhook_secret: str | None = field(default=None, repr=False)
    webhook_retry_s: float = 3600.0  # an event not delivered within this is dropped
    # Templates (a session's system from an image), each <templates_dir>/<name>/; None:
    # <data_dir>/templates. Root-only: images hold setuid files.
    templates_dir: Path | None = None
    template_max_mib: int = 8192  # a tarball or image uploaded as a build's body, MiB
    # Volumes (files that outlive sessions), each <volumes_dir>/<owner>/<name>/; None:
    # <data_dir>/volumes. Root-only but for the volumes' own files.
    volumes_dir: Path | None = None
    volume_max_mib: int = 10240  # the largest size one volume may have, MiB

    @property
    def templates_root(self) -> Path:
        """Where templates are built and kept: --templates-dir, or <data_dir>/templates."""
        return self.templates_dir or self.data_dir / "templates"

    @property
    def volumes_root(self) -> Path:
        """Where volumes are kept: --volumes-dir, or <data_dir>/volumes."""
        return self.volumes_dir or self.data_dir / "volumes"
