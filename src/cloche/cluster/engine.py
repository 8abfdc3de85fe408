"""Ray, as cloche uses it: the cluster to join (or a local one to start), the directory actor,
and one node agent actor pinned to each node that may run sandboxes.

Everything here blocks (Ray's API does): call it from a thread. Only this module and the
cluster manager import Ray, and only when --cluster is given (the `cluster` extra).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cloche.cluster import ray_auth
from cloche.cluster.agent import NodeAgent, NodeFigures
from cloche.cluster.directory import Directory
from cloche.cluster.tls import AgentTLS
from cloche.config import MIB, ServerConfig
from cloche.errors import ClocheError, ConfigError
from cloche.sessions.observer import EventSink

log = logging.getLogger("cloche.cluster")

NAMESPACE = "cloche"
NODE_RESOURCE = "cloche_node"  # a Ray node with this resource runs a node agent
DIRECTORY_NAME = "cloche-directory"
AGENT_EXIT_S = 30.0  # a local cluster's node agents, to exit once Ray's processes are stopped
LOCAL_OBJECT_STORE_BYTES = 128 * MIB  # per node of a local cluster (Ray's default: 30% of RAM)
LOOPBACK = "127.0.0.1"  # every process of a local cluster listens here, and only here
# Temp dirs of this process's local clusters that have ended. Ray's driver side makes an
# ended cluster's (empty) session directory again while a later cluster of the same process
# runs; each close, and the process's exit, removes them all again.
_ENDED_TEMPS: set[str] = set()
# Declare a silent node dead in ~2 s, not Ray's default ~16 s (measured on one machine).
LOCAL_SYSTEM_CONFIG = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


# Ray Client (ray://) runs a driver outside the cluster's network. A front end sends cells
# straight to each node's agent (--cluster-agent-port, on the node's cluster address): from
# outside, those are not reachable, and through Ray Client every cell would pay Ray's proxy.
RAY_CLIENT_REFUSED = (
    "--cluster ray://... (Ray Client) is not supported: a front end sends cells straight to "
    "each node's agent, which a driver outside the cluster's network cannot reach. Run "
    "cloche serve inside the cluster (on one of its machines, or a pod of its network) with "
    "--cluster auto or --cluster HOST:PORT of the head's GCS"
)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--cluster needs Ray: install cloche's cluster extra (pip install 'cloche[cluster]'"
            ", or ./run.sh --cluster ...)"
        ) from None
    return ray


@dataclass(frozen=True)
class RayNode:
    """A Ray node that may run a node agent."""

    ray_id: str
    ip: str
    index: int  # its place among the nodes, in the order Ray lists them


class Engine:
    """The front end's hold on the Ray cluster."""

    def __init__(
        self, config: ServerConfig, figures: Callable[[EventSink], NodeFigures] | None = None
    ) -> None:
        self.figures = figures  # what each node agent reports its figures to
        if not config.cluster:
            raise ConfigError("no --cluster given")
        self.config = config
        self.spec = config.cluster
        self.address = ""
        self.directory: Any = None
        self._local: Any = None  # ray.cluster_utils.Cluster we started (local:N)
        self._temp: str | None = None
        self._token: ray_auth.ClusterToken | None = None  # a local cluster's
        self._agent_class: Any = None
        self._nodes = 0  # of the local cluster

    @property
    def temp_dir(self) -> str | None:
        """Ray's sockets and logs of the local cluster (local:N), removed at its end."""
        return self._temp

    @property
    def local(self) -> bool:
        return self._local is not None

    def open(self) -> None:
        """Join (or start) the cluster and find (or make) its directory.

        Raises:
            ConfigError: a bad --cluster, Ray missing, or no cluster there.
        """
        ray = _ray()
        address: str = self.spec
        if self.spec.startswith("local:"):
            try:
                address = self._start_local(self.spec.removeprefix("local:"))
            except BaseException:
                self.close()
                raise
        elif self.spec.startswith("ray://"):
            raise ConfigError(RAY_CLIENT_REFUSED)
        elif self.spec != "auto" and ":" not in self.spec:
            raise ConfigError(f"--cluster must be local:N, auto or HOST:PORT, not {self.spec!r}")
        elif self.spec != "auto":
            _reachable(self.spec)  # Ray itself would wait minutes for a GCS that isn't there
            self._check_token_required(lambda: ray_auth.requires_token(self.spec))
            ray_auth.check_token(self.spec)  # Ray would retry for ~20 s, then say "can't"
        try:
            with _driver_on(address):
                ray.init(
                    address=address,
                    namespace=NAMESPACE,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
        except ray.exceptions.AuthenticationError as exc:
            self.close()
            raise ConfigError(
                f"the Ray cluster at {address} requires a token cloche was not given: "
                f"{ray_auth.HOW_TO_GIVE} ({exc})"
            ) from exc
        except (ConnectionError, RuntimeError, ValueError) as exc:
            self.close()
            raise ConfigError(
                f"can't join the Ray cluster at {address}: {exc} (if it requires a token: "
                f"{ray_auth.HOW_TO_GIVE})"
            ) from exc
        self.address = ray.get_runtime_context().gcs_address
        if self.spec == "auto":
            self._check_token_required(lambda: ray_auth.requires_token(self.address))
        self._agent_class = ray.remote(NodeAgent)
        head = _head_affinity(ray)
        self.directory = (
            ray.remote(Directory)
            .options(
                name=DIRECTORY_NAME,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                scheduling_strategy=head,
            )
            .remote()
        )

    def _check_token_required(self, ask: Callable[[], bool]) -> None:
        """Refuse (or, told --cluster-insecure, warn about) a cluster anyone may run code on;
        ask() says whether it requires a token."""
        try:
            required = ask()
        except ConfigError:
            self.close()
            raise
        if required:
            log.info("the Ray cluster at %s requires token authentication", self.spec)
            return
        if not self.config.cluster_insecure:
            self.close()
            raise ray_auth.refuse_open_cluster(self.spec)
        log.warning(
            "--cluster-insecure: the Ray cluster at %s does not enforce token authentication;"
            " anyone who can reach its ports can run code on its machines",
            self.spec,
        )

    def _start_local(self, count: str) -> str:
        from ray.cluster_utils import Cluster

        try:
            nodes = int(count)
        except ValueError:
            nodes = 0
        if not 1 <= nodes <= 16:
            raise ConfigError(f"--cluster local:N takes 1 to 16 nodes, not {count!r}")
        # Ray keeps its sockets and logs under RAY_TMPDIR (paths must stay short); ours alone.
        self._temp = tempfile.mkdtemp(prefix="cloche-ray-", dir="/tmp")
        os.environ["RAY_TMPDIR"] = self._temp
        # Only holders of this cluster's token may speak to it; its processes get it too.
        if self.config.cluster_insecure:
            log.warning(
                "--cluster-insecure: the local Ray cluster starts without token "
                "authentication; any process of this machine can run code through it as %s",
                "root" if os.geteuid() == 0 else "this user",
            )
        else:
            self._token = ray_auth.ClusterToken(self.config.state_dir)
            self._token.use()
        node = {
            "num_cpus": 0,
            "resources": {NODE_RESOURCE: 1},
            "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
            "node_ip_address": LOOPBACK,  # so Ray's servers bind loopback, not every address
        }
        # Made empty first, then its head added: a head that fails to start (a GCS too
        # busy to register it) leaves processes that only the cluster's shutdown ends.
        self._local = Cluster(initialize_head=False, shutdown_at_exit=False)
        self._local.add_node(
            **node,
            _system_config=LOCAL_SYSTEM_CONFIG,
            include_dashboard=False,  # cloche asks the GCS; no web port to guard
        )
        self._nodes = nodes
        for _ in range(nodes - 1):
            self._local.add_node(**node)
        address: str = self._local.address
        log.info("local Ray cluster of %d nodes at %s (temp %s)", nodes, address, self._temp)
        return address

    def nodes(self) -> list[RayNode]:
        """The live Ray nodes that may run sandboxes."""
        ray = _ray()
        found = [
            n
            for n in ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get(NODE_RESOURCE, 0) >= 1
        ]
        return [RayNode(n["NodeID"], n["NodeManagerAddress"], i) for i, n in enumerate(found)]

    def agent(
        self,
        node: RayNode,
        secret: str,
        egress_ca: tuple[bytes, bytes] | None,
        data_ca: tuple[bytes, bytes],
        predecessor: int | None = None,
    ) -> Any:
        """The node agent actor of a node, made if there is none (its `start` says its id);
        egress_ca: the cluster's interception CA, when sessions may carry secrets; data_ca:
        the data path's, which issues the agent its certificate (the agent never sees the
        CA's key); predecessor: the pid of the node's agent before, declared dead
        (`NodeAgent`)."""
        _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = self.node_config(node)
        # A new agent on a node whose agent died gets a new id: the old one's sessions stay lost.
        node_id = f"{node.ray_id[:12]}-{secrets.token_hex(3)}"
        tls = AgentTLS.issue(data_ca, node_id, node.ip)
        handle = self._agent_class.options(
            name=agent_name(node.ray_id),
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=100_000,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.ray_id, soft=False),
        ).remote(
            config,
            node_id,
            secret,
            node.ip,
            self.figures,
            egress_ca,
            watch_sigterm=True,
            tls=tls,
            membership=DirectoryMembership(self.directory),
            predecessor=predecessor,
        )
        return handle

    def agent_ended(self, ray_id: str, handle: Any, timeout_s: float) -> bool:
        """Whether the agent of a Ray node (its actor's handle, if one is held) has ended
        for good: Ray says its actor died, or no agent is named for that node. False while
        it may live (a frozen agent does not answer within timeout_s; blocking)."""
        ray = _ray()
        if handle is None:
            try:
                handle = ray.get_actor(agent_name(ray_id), namespace=NAMESPACE)
            except ValueError:  # none: a dead actor's name is free
                return True
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.ActorDiedError:
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False  # unavailable for now, or frozen: not known to be gone
        return False  # it answers: it learns its verdict and fences itself

    def node_config(self, node: RayNode) -> ServerConfig:
        """A node agent's settings: the front end's, with (on one machine) its own dirs."""
        config = self.config
        if self.local:
            config = replace(
                config,
                data_dir=config.data_dir / f"node-{node.index}",
                state_dir=config.state_dir / f"node-{node.index}",
                cluster_agent_port=0,
            )
            if config.egress_audit is not None:  # one file per node, as on many machines
                audit = config.egress_audit
                config = replace(
                    config, egress_audit=audit.with_name(f"{audit.stem}-node-{node.index}.jsonl")
                )
        return config

    def sweep(self) -> None:
        """After a local cluster's end: what its agents left (one killed -9 leaves its
        sandboxes' state, mounts and cgroups) goes, as a restarted server cleans its own."""
        from cloche.sandbox.registry import create_backend

        assert self.local, "only a local cluster's node directories are swept"
        for index in range(self._nodes):
            node = RayNode("", "", index)
            with contextlib.suppress(ClocheError, OSError):
                create_backend(self.node_config(node)).sweep()

    def close(self, agent_pids: Sequence[int] = ()) -> None:
        """Leave the cluster; stop it if it was ours (local:N), with every process of it:
        agent_pids, its node agents, are waited for (then killed) before their leftovers and
        Ray's temp dir go (an exiting worker still writes its logs there)."""
        ray = _ray()
        if ray.is_initialized():
            ray.shutdown()
        if self._local is not None:
            self._local.shutdown()
            # Ray's raylets started more than the cluster object tracks: the actors' worker
            # processes (given by pid: their titles are "ray::NodeAgent"...) and Ray's own
            # agents (they name our temp dir); each writes its logs there until it exits.
            # An agent declared dead is not stopped, nor given: it may still be there, or
            # be ending, holding its state dir (the sweep would pass it by and leave its
            # sandboxes running), so every worker of this cluster is waited for.
            assert self._temp is not None
            ours = [*_processes_naming(self._temp), *_workers_of(self._temp)]
            _wait_gone([*agent_pids, *ours], AGENT_EXIT_S)
            self.sweep()
            self._local = None
        if self._token is not None:
            self._token.forget()
            self._token = None
        if self._temp is not None:
            _ENDED_TEMPS.add(self._temp)
            _remove_ended_temps()
            os.environ.pop("RAY_TMPDIR", None)
            self._temp = None


def agent_name(ray_id: str) -> str:
    """The name of the agent actor of a Ray node (one at a time: freed when it dies)."""
    return f"cloche-agent-{ray_id}"


class DirectoryMembership:
    """A node agent's `Membership`: the directory's word on its node, asked over Ray from
    the agent's own process (its code asks the directory nothing else)."""

    def __init__(self, directory: Any) -> None:
        self._directory = directory

    async def state(self, node_id: str) -> str | None:
        state: str | None = await self._directory.node_state.remote(node_id)
        return state

    async def fenced(self, node_id: str) -> None:
        await self._directory.fenced.remote(node_id)

    def exit(self) -> None:
        """Ray ends the actor (its name freed for the next agent of the node) and its process."""
        ray = _ray()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


@atexit.register
def _remove_ended_temps() -> None:
    for temp in _ENDED_TEMPS:
        shutil.rmtree(temp, ignore_errors=True)


def _head_affinity(ray: Any) -> Any:
    """Pin to the head node (where the GCS lives: the directory dies with the cluster)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return NodeAffinitySchedulingStrategy(node["NodeID"], soft=True)
    return "DEFAULT"


@contextlib.contextmanager
def _driver_on(address: str) -> Iterator[None]:
    """While joining a cluster at a loopback address, keep this driver on loopback too.

    Ray's driver swaps a loopback address (the cluster's, and its own) for the machine's
    external one, where a loopback-only cluster doesn't listen; it does not when told that
    this machine runs no multi-node cluster.
    """
    from ray._private import ray_constants

    host = address.rpartition(":")[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _reachable(address: str) -> None:
    """Raises ConfigError when nothing answers at HOST:PORT."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"no Ray cluster answers at {address} ({exc}): give the head's GCS address "
            "(ray start --head prints it), or local:N"
        ) from exc


def _wait_gone(pids: Sequence[int], timeout_s: float) -> None:
    """Wait for processes to exit; kill those still there after timeout_s (blocking)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pids)
    while waiting:
        waiting = [pid for pid in waiting if _alive(pid)]
        if not waiting:
            return
        if time.monotonic() > deadline:
            for pid in waiting:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)  # polling: they are not our children (Ray's raylets started them)


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line holds text (a directory of ours alone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def _workers_of(temp: str) -> list[int]:
    """The Ray workers of the local cluster whose temp dir is temp: titled "ray::..." (their
    command lines name nothing of ours), with RAY_TMPDIR=temp in their environment."""
    found = []
    marker = f"RAY_TMPDIR={temp}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                titled = (entry / "cmdline").read_bytes().startswith(b"ray::")
                if titled and marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
