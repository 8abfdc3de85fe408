"""Sessions' doors: the policy a session asked for, its egress door on the host and the
door's end in its sandbox (the proxy variables a silent cell sets); and its ports door,
opened when a port is first asked for.

The policies, the proxy and the secrets are `cloche.network.egress`'s, the ports' door
`cloche.network.ports`'; this is only how sessions hold them, so that pause, snapshot, fork,
restart and moves keep a session's egress, and no checkpoint meets a connection to the host.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from cloche.errors import CheckpointFailed, ClocheError, EgressRefused, NotSupported, SandboxError
from cloche.network.ports.door import PortDoor
from cloche.sessions.kernel import KernelClient
from cloche.sessions.result import CellStatus
from cloche.sessions.session import Session

if TYPE_CHECKING:
    from cloche.network.egress.policy import Policy
    from cloche.network.egress.proxy import Door
    from cloche.network.egress.service import Egress

log = logging.getLogger("cloche.session")

EgressAsk = str | Mapping[str, Any] | None  # a policy's name, or {"policy", "allow"}
DOOR_OPEN_TIMEOUT_S = 30.0
_OPEN_DOOR = "from cloche.kernel import egress as _egress\n_egress.open_door({args})"
_DROP_CONNECTIONS = "from cloche.kernel import egress as _egress\n_egress.drop_connections()"


class SessionDoors:
    """The doors of one manager's sessions, by session id, over the server's egress (none
    when the server has no --egress-policy)."""

    def __init__(self, egress: Egress | None) -> None:
        self.egress = egress
        self._doors: dict[str, Door] = {}
        self._ports: dict[str, tuple[KernelClient, PortDoor]] = {}  # by session: its kernel's

    def policy_for(self, asked: EgressAsk) -> Policy | None:
        """The policy a new session gets for what it asked (None: no egress).

        Raises:
            EgressRefused: an unknown policy, a rule wider than it, or no egress here.
        """
        if self.egress is None:
            if asked is not None:
                raise EgressRefused(
                    "this server gives sessions no egress (start it with --egress-policy)"
                )
            return None
        return self.egress.policy_for(asked)

    def policy_again(self, described: dict[str, Any] | None, of: str) -> Policy | None:
        """A session's (or snapshot's) egress policy as recorded, under today's ceiling: one
        the ceiling no longer gives is dropped (no egress), and said so."""
        if described is None:
            return None
        asked = {k: v for k, v in described.items() if k != "placeholders"}
        try:
            if self.egress is None:
                raise EgressRefused("this server has no --egress-policy")
            return self.egress.policy_for(asked)
        except EgressRefused as exc:
            log.warning("session %s loses its egress %s: %s", of, described, exc)
            return None

    async def open(self, session: Session, policy: Policy) -> None:
        """Open the session's door on the host, and its end in the sandbox (a silent cell:
        the proxy address on the sandbox's loopback and the proxy variables)."""
        assert self.egress is not None and session.kernel is not None
        sandbox = session.kernel.sandbox
        if sandbox.door_dir is None or sandbox.door_inside is None:
            raise EgressRefused("this session's sandbox has no door for egress")
        await self.close(session.id)
        session.placeholders = self.egress.placeholders(policy, session.placeholders)
        door = await self.egress.open_door(
            session.id,
            owner_tag(session.owner_key),
            policy,
            sandbox.door_dir,
            session.placeholders,
        )
        self._doors[session.id] = door
        session.egress = policy
        inside = sandbox.door_inside
        args = (
            f"door={inside + '/door.sock'!r}, ca_bundle={inside + '/ca.pem'!r}, "
            f"env={session.placeholders!r}"
        )
        result = await session.kernel.execute(
            _OPEN_DOOR.format(args=args), timeout_s=DOOR_OPEN_TIMEOUT_S, silent=True
        )
        if result.status is not CellStatus.OK:
            why = result.error["evalue"] if result.error else result.message
            raise SandboxError(f"session {session.id}: its egress did not open: {why}")

    async def shut_for_checkpoint(self, session: Session) -> None:
        """Close a session's door and end its connections in the sandbox, before its image
        is saved (gVisor cannot save a socket connected to the host).

        Raises:
            CheckpointFailed: its connections did not end; the door is open again.
        """
        policy = session.egress
        assert session.kernel is not None and policy is not None
        await self.close(session.id)
        ended = await session.kernel.execute(
            _DROP_CONNECTIONS, timeout_s=DOOR_OPEN_TIMEOUT_S, silent=True
        )
        if ended.status is not CellStatus.OK:
            why = ended.error["evalue"] if ended.error else ended.message
            await self.open(session, policy)
            raise CheckpointFailed(f"its egress connections did not end: {why}")

    async def close(self, session_id: str) -> None:
        door = self._doors.pop(session_id, None)
        if door is not None:
            await door.close()
        await self.close_ports(session_id)

    async def close_all(self) -> None:
        doors = list(self._doors.values())
        self._doors.clear()
        ports = [door for _, door in self._ports.values()]
        self._ports.clear()
        await asyncio.gather(*(door.close() for door in doors), *(p.close() for p in ports))

    # -- ports -----------------------------------------------------------------------------

    async def ports_door(self, session: Session) -> PortDoor:
        """The ports door of the session's sandbox as it runs now (made the first time)."""
        kernel = session.kernel
        assert kernel is not None
        held = self._ports.get(session.id)
        if held is not None and held[0] is kernel:
            return held[1]
        await self.close_ports(session.id)  # of a sandbox it had before
        sandbox = kernel.sandbox
        if sandbox.door_dir is None or sandbox.door_inside is None:
            raise NotSupported("this session's sandbox has no door: its ports can't be reached")
        door = PortDoor(session.id, sandbox.door_dir, sandbox.door_inside, _relay_asker(kernel))
        self._ports[session.id] = (kernel, door)
        return door

    def ports_of(self, session: Session) -> PortDoor | None:
        """The session's ports door, if its sandbox has one now."""
        held = self._ports.get(session.id)
        return held[1] if held is not None and held[0] is session.kernel else None

    async def shut_ports(self, session: Session) -> PortDoor | None:
        """End the connections of the session's ports door, on both sides, before its
        image is saved; the door, to reopen (`PortDoor.reopen`) if the sandbox runs on.

        Raises:
            CheckpointFailed: its relay did not say it had ended them.
        """
        door = self.ports_of(session)
        if door is None:
            return None
        try:
            await door.shut()
        except ClocheError as exc:
            door.reopen()
            raise CheckpointFailed(f"its ports' connections did not end: {exc}") from exc
        return door

    async def close_ports(self, session_id: str) -> None:
        held = self._ports.pop(session_id, None)
        if held is not None:
            await held[1].close()


def _relay_asker(kernel: KernelClient) -> Callable[..., Awaitable[dict[str, Any]]]:
    """How a ports door asks its sandbox's relay (`ports.open`, `ports.shut`): the sandbox
    thawed first, as a cell's run does. An idle session's sandbox is frozen, and its relay
    could not answer: a checkpoint's `ports.shut` waited out its deadline, and the pause
    (for idleness, at shutdown) failed."""

    async def ask(op: str, **fields: Any) -> dict[str, Any]:
        kernel.sandbox.thaw()
        return await kernel.processes.request(op, **fields)

    return ask


def placeholders_of(described: dict[str, Any] | None) -> dict[str, str]:
    """The secrets' placeholders a recorded egress keeps."""
    kept = (described or {}).get("placeholders") or {}
    return {str(k): str(v) for k, v in kept.items()} if isinstance(kept, dict) else {}


def egress_record(session: Session) -> dict[str, Any] | None:
    """A session's egress as its record keeps it: the policy asked for, and its secrets'
    placeholders (which are in its memory: a copy or a restore goes on with them)."""
    if session.egress is None:
        return None
    return {**session.egress.describe(), "placeholders": dict(session.placeholders)}


def owner_tag(key: str | None) -> str:
    """A short, non-secret tag for a token in logs."""
    return "-" if key is None else key[:8]
