"""E2B's network options onto cloche's egress, within the server's ceiling.

- nothing, or `allow_internet_access: true` (the openai-agents and pydantic-ai clients send
  it by default): the tenant's default policy, as a `/v1` session gets (possibly none);
  never a 403.
- `network.allowOut: [...]`: the tenant's (or the server's default) policy narrowed to
  those hosts and networks; one wider than the policy is a 403 naming the rule.
- `allow_internet_access: false`, or `denyOut: ["0.0.0.0/0"]` without allowOut: nothing
  reachable (the default policy narrowed to no rule; no egress on a server without any).
- Other `denyOut` entries can't be expressed by allow rules: 400.
"""

from __future__ import annotations

from typing import Any

from cloche.server.e2b.errors import E2BError
from cloche.sessions.manager import EgressAsk

ALL_TRAFFIC = "0.0.0.0/0"
NOTHING = "nothing"  # a marker: no egress at all, whatever the default


def egress_of(allow_internet: bool | None, network: dict[str, Any] | None) -> EgressAsk:
    """What a create asks of cloche's egress.

    Raises:
        E2BError: 400 for options that can't be expressed.
    """
    network = network or {}
    allow = network.get("allowOut")
    deny = network.get("denyOut")
    if allow is not None and (
        not isinstance(allow, list) or not all(isinstance(a, str) for a in allow)
    ):
        raise E2BError(400, "network.allowOut must be a list of hosts, addresses or CIDRs")
    if deny is not None and (
        not isinstance(deny, list) or not all(isinstance(d, str) for d in deny)
    ):
        raise E2BError(400, "network.denyOut must be a list of addresses or CIDRs")
    if deny and set(deny) != {ALL_TRAFFIC}:
        raise E2BError(
            400,
            f"network.denyOut {deny!r}: this server's egress is allow rules only; deny all "
            f"({ALL_TRAFFIC!r}) and list what is allowed in allowOut",
        )
    if allow:
        return {"allow": list(allow)}
    if allow_internet is False or deny:
        return NOTHING
    return None
