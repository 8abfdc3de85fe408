"""The terminal on a session's page of the inspector: typed in real headless Chromium
(Debian's) against a real gVisor server, under the pages' Content-Security-Policy; and its
websocket under /ui, which needs the sign-in cookie, the page's CSRF token and this server's
Origin."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from support import ServerThread, make_config, require_gvisor

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install -e .[dev]")
expect = playwright_api.expect

pytestmark = pytest.mark.timeout(300)
CHROMIUM = "/usr/bin/chromium"
ALPHA, BETA = "alpha-token", "beta-token"
WAIT_MS = 90_000  # a busy 2-core machine
STRICT_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "frame-src 'self'"
)
expect.set_options(timeout=WAIT_MS)


@pytest.fixture(scope="module")
def guarded(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    config = make_config(state_root, tokens=frozenset({ALPHA, BETA}), pool_size=2)
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def base(guarded) -> str:
    return f"http://127.0.0.1:{guarded.http_port}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if shutil.which(CHROMIUM) is None:
        pytest.fail("the browser tests need Debian's chromium: run scripts/install.sh --dev")
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser, base) -> Iterator[Any]:
    """A signed-in page of ALPHA's, with what it (and its frames) logged in `page.console`."""
    context = browser.new_context(base_url=base)
    opened = context.new_page()
    opened.set_default_timeout(WAIT_MS)
    opened.console = []
    opened.on("console", lambda message: opened.console.append(message.text))
    opened.goto("/ui/")
    opened.get_by_label("Token").fill(ALPHA)
    opened.get_by_role("button", name="Sign in").click()
    expect(opened.get_by_role("heading", name="Sessions")).to_be_visible()
    yield opened
    context.close()


def api(base: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120)


def shells(base: str, session_id: str) -> list[Any]:
    with api(base, ALPHA) as client:
        listed = client.get(f"/v1/sessions/{session_id}/commands")
        assert listed.status_code == 200, listed.text
        return list(listed.json()["commands"])


def until(check, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_the_terminal_on_a_session_s_page_answers_what_is_typed(page, base, tmp_path):
    page.get_by_role("button", name="New session").click()
    expect(page).to_have_url(re.compile(r"/ui/sessions/[0-9a-f-]{36}"))
    session_id = page.url.split("/ui/sessions/")[1].split("?")[0]
    shown = page.goto(page.url)
    assert shown is not None and shown.headers["content-security-policy"] == STRICT_CSP
    with page.expect_response(re.compile(r"/terminal$")) as framed:
        page.get_by_role("button", name="Open a terminal").click()
    answer = framed.value
    terminal_csp = answer.headers["content-security-policy"]
    assert "script-src 'self'" in terminal_csp and "frame-ancestors 'self'" in terminal_csp
    assert answer.headers["cache-control"] == "no-store"
    frame = page.frame_locator("#terminal-frame")
    expect(frame.locator("#terminal-status")).to_contain_text("connected")
    assert frame.locator("script:not([src])").count() == 0  # its scripts are files only
    frame.locator(".xterm").click()
    page.keyboard.type("echo $((6*7))")
    page.keyboard.press("Enter")
    expect(frame.locator(".xterm-rows")).to_contain_text("42")
    page.screenshot(path=str(tmp_path / "terminal.png"), full_page=True)
    assert [s["pty"] for s in shells(base, session_id)] == [True]
    page.keyboard.type("exit 3")
    page.keyboard.press("Enter")
    expect(frame.locator("#terminal-status")).to_have_text("the shell exited with 3")
    until(lambda: shells(base, session_id) == [])
    page.get_by_role("button", name="Close the terminal").click()
    page.get_by_role("button", name="Open a terminal").click()  # a new shell
    expect(frame.locator("#terminal-status")).to_contain_text("connected")
    until(lambda: len(shells(base, session_id)) == 1)
    page.get_by_role("button", name="Close the terminal").click()  # it is hung up
    until(lambda: shells(base, session_id) == [])
    violations = [text for text in page.console if "Content Security Policy" in text]
    assert violations == []
    with api(base, ALPHA) as client:
        client.delete(f"/v1/sessions/{session_id}")


def sign_in(base: str, token: str) -> tuple[httpx.Client, str]:
    """A client signed in to the inspector as a browser would be (its cookie), and a
    session's page's CSRF token."""
    client = httpx.Client(base_url=base, timeout=120)
    form = client.get("/ui/login")
    login_csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert login_csrf is not None, form.text
    signed = client.post("/ui/login", data={"token": token, "csrf_token": login_csrf[1]})
    assert signed.status_code == 303, signed.text
    listed = client.get("/ui/")
    csrf = re.search(r'<meta name="csrf-token" content="([^"]+)">', listed.text)
    assert csrf is not None
    return client, csrf[1]


def socket(
    base: str, session_id: str, *, cookie: str | None, csrf: str, origin: str | None
) -> ClientConnection:
    url = base.replace("http://", "ws://") + f"/ui/sessions/{session_id}/pty?csrf_token={csrf}"
    headers = {"Cookie": f"cloche_ui={cookie}"} if cookie else {}
    return connect(
        url,
        additional_headers=headers,
        origin=origin,  # type: ignore[arg-type]
        proxy=None,
        open_timeout=60,
    )


def closed_with(ws: ClientConnection) -> int:
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=60)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code


def test_the_socket_needs_the_sign_in_its_csrf_token_and_this_origin(base):
    client, csrf = sign_in(base, ALPHA)
    cookie = client.cookies["cloche_ui"]
    with api(base, ALPHA) as alpha:
        session_id = alpha.post("/v1/sessions").json()["id"]
    try:
        with socket(base, session_id, cookie=None, csrf=csrf, origin=base) as ws:
            assert closed_with(ws) == 4401
        with socket(base, session_id, cookie=cookie, csrf="guess", origin=base) as ws:
            assert closed_with(ws) == 4403
        elsewhere = "http://evil.example"
        with socket(base, session_id, cookie=cookie, csrf=csrf, origin=elsewhere) as ws:
            assert closed_with(ws) == 4403
        with socket(base, session_id, cookie=cookie, csrf=csrf, origin=None) as ws:
            assert closed_with(ws) == 4403
        with socket(base, session_id, cookie=cookie, csrf=csrf, origin=base) as ws:
            ws.send(b"echo $((6*7))X\r")
            seen = b""
            while b"42X" not in seen:
                frame = ws.recv(timeout=60)
                seen += frame if isinstance(frame, bytes) else b""
        other, other_csrf = sign_in(base, BETA)
        theirs = other.cookies["cloche_ui"]
        with socket(base, session_id, cookie=theirs, csrf=other_csrf, origin=base) as ws:
            assert closed_with(ws) == 4404  # another user's session is not found
        other.close()
    finally:
        client.close()
        with api(base, ALPHA) as alpha:
            alpha.delete(f"/v1/sessions/{session_id}")
