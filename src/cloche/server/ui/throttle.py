"""How many wrong tokens the inspector's sign-in takes: per client address and in all.

Each refused token counts against the address it came from and against the server as a
whole, for `WINDOW_S`. An address with `PER_ADDRESS` refusals in the window, or a server
with `EVERYONE` (guesses spread over many addresses), answers every sign-in with 429 and
`Retry-After` until the oldest of them leaves the window, without checking the token:
guesses made meanwhile learn nothing, and the right token works again once the window has
passed. A token taken does not count, nor does it clear the count (else one's own token
would reset the guessing of another's).

IPv6 addresses count by /64, what one machine is usually given. Memory is bounded: at most
`MAX_ADDRESSES` addresses are remembered (the least recently refused go first; the
server-wide count still holds the guesses of those forgotten), each with at most
`PER_ADDRESS` times, and an address whose refusals have all left the window is forgotten.
Reaching a limit is logged (a warning, naming the address).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("cloche.ui")
WINDOW_S = 600.0  # a refusal counts this long
PER_ADDRESS = 10  # refusals of one address (an IPv6 /64) in the window
EVERYONE = 100  # refusals of all addresses in the window
MAX_ADDRESSES = 4096  # addresses remembered at once


@dataclass(frozen=True)
class Throttled:
    """A sign-in refused before its token is looked at."""

    retry_after_s: int  # until the window has room again, at least 1
    everyone: bool  # the server-wide limit, not the address's own


def address_key(host: str | None) -> str:
    """What an address counts under: itself, an IPv6 address its /64."""
    if host is None:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class SignInThrottle:
    """The refused sign-ins of the last `window_s`, by address and in all."""

    def __init__(
        self,
        *,
        window_s: float = WINDOW_S,
        per_address: int = PER_ADDRESS,
        everyone: int = EVERYONE,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.per_address = per_address
        self.everyone = everyone
        self.max_addresses = max_addresses
        self.clock = clock
        self._all: deque[float] = deque(maxlen=everyone)
        self._by_address: OrderedDict[str, deque[float]] = OrderedDict()  # least recent first

    @property
    def addresses(self) -> int:
        """How many addresses are remembered now."""
        return len(self._by_address)

    def check(self, host: str | None) -> Throttled | None:
        """None if a sign-in from host may be tried now."""
        now = self.clock()
        since = self._forget(now)
        mine = self._by_address.get(address_key(host))
        while mine and mine[0] <= since:
            mine.popleft()
        if mine is not None and len(mine) >= self.per_address:
            return Throttled(self._wait(mine[0], now), everyone=False)
        if len(self._all) >= self.everyone:
            return Throttled(self._wait(self._all[0], now), everyone=True)
        return None

    def refused(self, host: str | None) -> None:
        """A wrong token came from host."""
        now = self.clock()
        self._forget(now)
        key = address_key(host)
        mine = self._by_address.pop(key, None)
        if mine is None:
            mine = deque(maxlen=self.per_address)
            while len(self._by_address) >= self.max_addresses:
                self._by_address.popitem(last=False)
        mine.append(now)
        self._by_address[key] = mine  # the most recent last
        self._all.append(now)
        if len(mine) == self.per_address:  # once per refusal that fills it: rare
            log.warning(
                "inspector sign-in: %d wrong tokens from %s in %g s; its sign-ins wait",
                len(mine),
                key,
                self.window_s,
            )
        if len(self._all) == self.everyone:
            log.warning(
                "inspector sign-in: %d wrong tokens in %g s; every sign-in waits",
                len(self._all),
                self.window_s,
            )

    def _forget(self, now: float) -> float:
        """Drop the refusals counted in all, and the addresses, that have left the window
        (an address's own older times go when it is looked at); the window's start."""
        since = now - self.window_s
        while self._all and self._all[0] <= since:
            self._all.popleft()
        while self._by_address:
            key, times = next(iter(self._by_address.items()))
            if times[-1] > since:  # its newest is in the window: so are the later ones'
                break
            del self._by_address[key]
        return since

    def _wait(self, oldest: float, now: float) -> int:
        return max(1, math.ceil(oldest + self.window_s - now))
