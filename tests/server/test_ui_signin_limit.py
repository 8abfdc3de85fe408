"""The inspector's sign-in takes a bounded number of wrong tokens, per client address and in
all, against a real gVisor server (each address a loopback address of its own: 127.0.0.N)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Mount

from cloche.server.ui.throttle import SignInThrottle, address_key
from support import ServerThread, make_config, require_gvisor

pytestmark = pytest.mark.timeout(300)
ALPHA = "alpha-token"
PER_ADDRESS, EVERYONE, WINDOW_S = 3, 7, 600.0


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def guarded(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    config = make_config(state_root, tokens=frozenset({ALPHA}), pool_size=1)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def clock(guarded) -> Clock:
    """A fresh throttle with small limits on the running inspector, on a clock of the test's."""
    routes = guarded.server.http.app.routes  # type: ignore[union-attr]
    ui = next(r.app for r in routes if isinstance(r, Mount) and r.path == "/ui")
    moved = Clock()
    ui.state.sign_in_throttle = SignInThrottle(
        window_s=WINDOW_S, per_address=PER_ADDRESS, everyone=EVERYONE, clock=moved
    )
    return moved


def browser_at(server: ServerThread, address: str) -> httpx.Client:
    """A client whose connections come from address (any 127.x.y.z is this machine's)."""
    transport = httpx.HTTPTransport(local_address=address)
    base = f"http://127.0.0.1:{server.http_port}"
    return httpx.Client(base_url=base, transport=transport, timeout=60)


def sign_in(browser: httpx.Client, token: str) -> httpx.Response:
    """The login form filled in and sent, as a browser does (its CSRF cookie included)."""
    form = browser.get("/ui/login")
    assert form.status_code == 200, form.text
    assert "cloche_ui_login" in browser.cookies  # the value signed; the form holds it plain
    found = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert found, form.text
    data = {"csrf_token": found[1], "token": token, "next": "/ui/"}
    return browser.post("/ui/login", data=data)


def signed_in(response: httpx.Response) -> bool:
    return response.status_code == 303 and "cloche_ui" in response.cookies


def test_an_address_that_guesses_too_often_is_told_to_wait_even_with_the_right_token(
    guarded, clock
):
    with browser_at(guarded, "127.0.0.2") as guesser, browser_at(guarded, "127.0.0.3") as other:
        for n in range(PER_ADDRESS):
            assert sign_in(guesser, f"guess-{n}").status_code == 401
        clock.now += 60
        waited = sign_in(guesser, ALPHA)
        assert waited.status_code == 429, waited.text
        assert int(waited.headers["retry-after"]) == WINDOW_S - 60
        assert "Too many wrong tokens from your address" in waited.text
        assert "cloche_ui" not in waited.cookies
        assert signed_in(sign_in(other, ALPHA))  # another address is not held up


def test_the_right_token_works_again_once_the_window_has_passed(guarded, clock):
    with browser_at(guarded, "127.0.0.4") as guesser:
        for n in range(PER_ADDRESS):
            assert sign_in(guesser, f"guess-{n}").status_code == 401
        waited = sign_in(guesser, ALPHA)
        assert waited.status_code == 429
        clock.now += int(waited.headers["retry-after"]) - 1
        assert sign_in(guesser, ALPHA).status_code == 429
        clock.now += 1
        assert signed_in(sign_in(guesser, ALPHA))


def test_guesses_while_told_to_wait_do_not_count_nor_are_checked(guarded, clock):
    with browser_at(guarded, "127.0.0.5") as guesser:
        for n in range(PER_ADDRESS):
            assert sign_in(guesser, f"guess-{n}").status_code == 401
        first = int(sign_in(guesser, "more").headers["retry-after"])
        for _ in range(20):
            assert sign_in(guesser, "more").status_code == 429
        clock.now += first
        assert signed_in(sign_in(guesser, ALPHA))


def test_guesses_spread_over_many_addresses_meet_the_server_wide_limit(guarded, clock):
    addresses = [f"127.0.1.{n}" for n in range(1, EVERYONE + 1)]
    for address in addresses:  # one wrong token each: no address near its own limit
        with browser_at(guarded, address) as guesser:
            assert sign_in(guesser, "guess").status_code == 401
    with browser_at(guarded, "127.0.2.1") as newcomer:
        waited = sign_in(newcomer, ALPHA)
        assert waited.status_code == 429, waited.text
        assert "Too many wrong tokens to this server" in waited.text
        assert 1 <= int(waited.headers["retry-after"]) <= WINDOW_S
        clock.now += int(waited.headers["retry-after"])
        assert signed_in(sign_in(newcomer, ALPHA))


def test_a_token_taken_neither_counts_nor_clears_the_count(guarded, clock):
    with browser_at(guarded, "127.0.0.6") as user:
        for _ in range(PER_ADDRESS + 2):  # signing in often is no guessing
            assert signed_in(sign_in(user, ALPHA))
            user.cookies.clear()
        for n in range(PER_ADDRESS - 1):
            assert sign_in(user, f"guess-{n}").status_code == 401
        assert signed_in(sign_in(user, ALPHA))  # one's own token does not reset the count
        user.cookies.clear()
        assert sign_in(user, "guess-last").status_code == 401
        assert sign_in(user, ALPHA).status_code == 429


# -- the bookkeeping, on its own -----------------------------------------------------------


def throttle(**limits: Any) -> tuple[SignInThrottle, Clock]:
    clock = Clock()
    options = {"window_s": 60.0, "per_address": 3, "everyone": 1000} | limits
    return SignInThrottle(clock=clock, **options), clock


def test_memory_holds_at_most_max_addresses_and_forgets_them_after_the_window():
    limiter, clock = throttle(max_addresses=50)
    for n in range(10_000):
        limiter.refused(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}")
        assert limiter.addresses <= 50
    clock.now += 61
    assert limiter.check("10.0.0.1") is None
    assert limiter.addresses == 0


def test_an_ipv6_machine_counts_as_its_64_and_a_mapped_ipv4_as_itself():
    limiter, _ = throttle()
    for n in range(3):
        limiter.refused(f"2001:db8:1:2::{n + 1:x}")
    assert limiter.check("2001:db8:1:2:ffff::9") is not None
    assert limiter.check("2001:db8:1:3::1") is None
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"


def test_reaching_a_limit_is_logged_with_the_address(caplog):
    limiter, _ = throttle(everyone=4)
    with caplog.at_level("WARNING", logger="cloche.ui"):
        for _ in range(3):
            limiter.refused("192.0.2.1")
        limiter.refused("192.0.2.2")
    assert [r.getMessage() for r in caplog.records] == [
        "inspector sign-in: 3 wrong tokens from 192.0.2.1 in 60 s; its sign-ins wait",
        "inspector sign-in: 4 wrong tokens in 60 s; every sign-in waits",
    ]
