"""The inspector (/ui) and the offline docs (/docs), driven in real headless Chromium
(Debian's, installed by scripts/install.sh --dev) against a real gVisor server.

Every page is screenshotted into the test's temp dir. Untrusted output is the point of
several tests: what a cell prints or displays must never run in the inspector's origin.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from cloche.config import Limits
from support import NEVER_BEHIND_SLICE_S, ServerThread, make_config, require_gvisor

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install -e .[dev]")
expect = playwright_api.expect

pytestmark = pytest.mark.timeout(300)
CHROMIUM = "/usr/bin/chromium"
ALPHA, BETA, ADMIN = "alpha-token", "beta-token", "admin-token"
WAIT_MS = 90_000  # a busy 2-core machine: a sandbox start, a checkpoint, a poll
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "frame-src 'self'"
)
expect.set_options(timeout=WAIT_MS)


@pytest.fixture(scope="module")
def guarded(state_root) -> Iterator[ServerThread]:
    """A server with two users and an admin."""
    require_gvisor()
    config = make_config(
        state_root,
        tokens=frozenset({ALPHA, BETA}),
        admin_tokens=frozenset({ADMIN}),
        pool_size=2,
        # No test here is about time limits nor CPU placement: a cell has as long as the page
        # is waited for, level with the host's processes (support.NEVER_BEHIND_SLICE_S).
        limits=Limits(cell_timeout_s=WAIT_MS / 1000, interrupt_grace_s=1.0),
        cell_slice_s=NEVER_BEHIND_SLICE_S,
    )
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


class Watched:
    """A page in a fresh browser context, with what it logged and every dialog it opened."""

    def __init__(self, browser: Any, base: str, shots: Path) -> None:
        self.base = base
        self.context = browser.new_context(base_url=base)
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.console: list[str] = []
        self.dialogs: list[str] = []
        self.shots = shots
        self.page.on("console", lambda message: self.console.append(message.text))
        self.page.on("dialog", self._dialog)

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def csp_violations(self) -> list[str]:
        return [text for text in self.console if "Content Security Policy" in text]

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)

    def sign_in(self, token: str) -> None:
        self.page.goto("/ui/")
        expect(self.page).to_have_url(re.compile(r"/ui/login"))
        self.page.get_by_label("Token").fill(token)
        self.page.get_by_role("button", name="Sign in").click()
        expect(self.page.get_by_role("heading", name="Sessions")).to_be_visible()

    def new_session(self) -> str:
        """A session made with the list's button; its id."""
        self.page.goto("/ui/")
        self.page.get_by_role("button", name="New session").click()
        expect(self.page).to_have_url(re.compile(r"/ui/sessions/[0-9a-f-]{36}"))
        return self.page.url.split("/ui/sessions/")[1].split("?")[0]

    def run(self, code: str) -> None:
        self.page.get_by_label("Code").fill(code)
        self.page.get_by_role("button", name="Run").click()

    def csrf(self) -> str:
        token = self.page.locator('meta[name="csrf-token"]').get_attribute("content")
        assert token
        return str(token)


@pytest.fixture
def watched(browser, base, tmp_path) -> Iterator[Watched]:
    page = Watched(browser, base, tmp_path)
    yield page
    page.context.close()


@pytest.fixture
def alpha(watched) -> Watched:
    watched.sign_in(ALPHA)
    return watched


def api(base: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120)


def cell(page: Watched, count: int) -> Any:
    """The history's cell with this execution count."""
    return page.page.locator("#history article.cell").filter(
        has=page.page.locator(".count", has_text=f"[{count}]")
    )


def test_a_page_without_a_sign_in_goes_to_the_login(watched):
    response = watched.page.goto("/ui/snapshots")
    assert response is not None
    expect(watched.page).to_have_url(re.compile(r"/ui/login\?next=%2Fui%2Fsnapshots"))
    assert watched.page.locator('meta[name="csrf-token"]').count() == 0
    watched.page.get_by_label("Token").fill("not-a-token")
    watched.page.get_by_role("button", name="Sign in").click()
    expect(watched.page.get_by_text("That token is not one of this server's.")).to_be_visible()
    watched.page.get_by_label("Token").fill(ALPHA)
    watched.page.get_by_role("button", name="Sign in").click()
    expect(watched.page).to_have_url(re.compile(r"/ui/snapshots$"))
    watched.shot("snapshots")


def test_the_sign_in_cookie_is_http_only_and_strict(alpha):
    cookies = {c["name"]: c for c in alpha.context.cookies()}
    cookie = cookies["cloche_ui"]
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/ui"
    assert cookie["secure"] is False  # served over http here; https would make it Secure
    assert "cloche_ui_login" not in cookies
    assert alpha.page.evaluate("document.cookie") == ""


def test_a_cell_run_from_the_page_shows_its_output(alpha):
    session_id = alpha.new_session()
    alpha.run("print(1+1)")
    first = cell(alpha, 1)
    expect(first.locator("pre.out-stdout")).to_have_text("2")
    expect(first.locator(".status")).to_have_text("ok")
    alpha.page.reload()  # it is in the session's history, not only in the page
    expect(cell(alpha, 1).locator("pre.out-stdout")).to_have_text("2")
    alpha.shot("session")
    assert session_id in alpha.page.url
    assert alpha.csp_violations() == []


def test_a_cell_run_elsewhere_appears_on_the_open_page(alpha, base):
    session_id = alpha.new_session()
    with api(base, ALPHA) as client:
        ran = client.post(
            f"/v1/sessions/{session_id}/execute", json={"code": "print('from the api')"}
        )
        assert ran.status_code == 200, ran.text
    first = cell(alpha, 1)
    expect(first.locator("pre.out-stdout")).to_have_text("from the api")
    expect(first.locator(".via")).to_have_text("via http")


def test_metadata_labels_a_new_session_and_filters_the_list(alpha):
    alpha.page.goto("/ui/")
    alpha.page.locator(".new-session").get_by_label("Metadata").fill("team=red, run=7")
    alpha.page.get_by_role("button", name="New session").click()
    expect(alpha.page).to_have_url(re.compile(r"/ui/sessions/[0-9a-f-]{36}"))
    session_id = alpha.page.url.split("/ui/sessions/")[1].split("?")[0]
    expect(alpha.page.locator(".facts .meta")).to_have_text(["run=7", "team=red"])
    alpha.page.locator(".facts .meta", has_text="team=red").click()
    row = alpha.page.locator(f'tr[data-session="{session_id}"]')
    expect(row).to_have_count(1)
    for shown in alpha.page.locator("tr.session").all():
        expect(shown.locator(".meta", has_text="team=red")).to_have_count(1)
    alpha.page.locator(".filters").get_by_label("Metadata").fill("team=blue")
    alpha.page.get_by_role("button", name="Filter").click()
    expect(alpha.page).to_have_url(re.compile(r"meta=team%3Dblue"))
    expect(row).to_have_count(0)
    alpha.page.goto("/ui/?state=paused")
    expect(alpha.page.locator(f'tr[data-session="{session_id}"]')).to_have_count(0)
    alpha.page.goto("/ui/?state=idle&metadata.run=7")
    expect(alpha.page.locator(f'tr[data-session="{session_id}"]')).to_have_count(1)


def test_text_output_is_shown_as_text(alpha):
    alpha.new_session()
    alpha.run('print("<b>bold</b><img src=x onerror=alert(1)>")')
    out = cell(alpha, 1).locator("pre.out-stdout")
    expect(out).to_have_text("<b>bold</b><img src=x onerror=alert(1)>")
    assert out.locator("b").count() == 0
    assert out.locator("img").count() == 0
    assert alpha.dialogs == []


HOSTILE = """
class Hostile:
    def _repr_html_(self):
        return (
            "<p id='shown'>rendered, inert</p>"
            "<script>parent.window.__pwned = 1; alert('script'); fetch('/marker/script');</script>"
            "<img src='x' onerror=\\"parent.window.__pwned = 2; alert('onerror'); "
            "fetch('/marker/onerror')\\">"
            "<a id='nav' href='/marker/link' target='_top'>x</a>"
        )

class HostileSvg:
    def _repr_svg_(self):
        return (
            "<svg xmlns='http://www.w3.org/2000/svg' onload=\\"alert('svg')\\">"
            "<script>alert('svg script')</script><text x='5' y='20'>svg</text></svg>"
        )

display(Hostile())
HostileSvg()
"""


def test_html_and_svg_outputs_run_nothing_in_the_inspector(alpha):
    marked: list[str] = []

    def mark(route: Any) -> None:
        marked.append(route.request.url)
        route.abort()

    alpha.context.route("**/marker/**", mark)
    alpha.new_session()
    alpha.run(HOSTILE)
    frames = cell(alpha, 1).locator("iframe")
    expect(frames).to_have_count(2)
    for index in range(2):
        frame = frames.nth(index)
        assert frame.get_attribute("sandbox") == ""  # every restriction: no scripts, no origin
    shown = alpha.page.frame_locator("#history iframe >> nth=0").locator("#shown")
    expect(shown).to_have_text("rendered, inert")
    drawn = alpha.page.frame_locator("#history iframe >> nth=1").locator("svg text")
    expect(drawn).to_have_text("svg")
    alpha.page.reload()
    expect(alpha.page.frame_locator("#history iframe >> nth=0").locator("#shown")).to_be_visible()
    alpha.shot("hostile")
    assert alpha.page.evaluate("window.__pwned") is None
    assert alpha.dialogs == []
    assert marked == []
    # Nothing of it is in the inspector's own document, only in the frames' srcdoc.
    assert alpha.page.locator("#history script").count() == 0
    assert alpha.page.locator("#history img[onerror]").count() == 0


def test_a_plot_shows_as_an_image(alpha):
    alpha.new_session()
    alpha.run("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    image = cell(alpha, 1).locator("img.plot")
    expect(image).to_be_visible()
    assert (image.get_attribute("src") or "").startswith("data:image/png;base64,")
    assert alpha.page.evaluate("img => img.naturalWidth", image.element_handle()) > 0
    alpha.shot("plot")


def test_a_spinning_cell_is_interrupted_from_the_page(alpha):
    alpha.new_session()
    alpha.run("print('spinning', flush=True)\nwhile True:\n    pass")
    running = alpha.page.locator("#history article.status-running")
    expect(running.locator("pre.out-stdout")).to_have_text("spinning")  # it is in the loop
    expect(alpha.page.locator("#history .state")).to_have_text("busy")
    alpha.page.get_by_role("button", name="Interrupt").click()
    expect(alpha.page.get_by_text("The running cell was interrupted.")).to_be_visible()
    expect(cell(alpha, 1).locator(".status")).to_have_text("interrupted")
    alpha.run("print('after')")
    expect(cell(alpha, 2).locator("pre.out-stdout")).to_have_text("after")


def test_fork_shows_the_copies(alpha):
    session_id = alpha.new_session()
    alpha.run("x = 41")
    expect(cell(alpha, 1).locator(".status")).to_have_text("ok")
    alpha.page.get_by_label("Copies").fill("2")
    alpha.page.get_by_role("button", name="Fork").click()
    expect(alpha.page.get_by_text("Forked: the copies are marked below.")).to_be_visible()
    copies = alpha.page.locator("tr.session.copy")
    expect(copies).to_have_count(2)
    alpha.shot("forked")
    copy_id = copies.first.get_attribute("data-session")
    assert copy_id and copy_id != session_id
    alpha.page.goto(f"/ui/sessions/{copy_id}")
    alpha.run("print(x + 1)")
    expect(alpha.page.locator("#history pre.out-stdout").last).to_have_text("42")


def test_snapshot_pause_resume_and_close_from_the_page(alpha):
    session_id = alpha.new_session()
    alpha.run("kept = 'yes'")
    expect(cell(alpha, 1).locator(".status")).to_have_text("ok")
    alpha.page.get_by_label("Snapshot name").fill("before-pause")
    alpha.page.get_by_role("button", name="Snapshot").click()
    expect(alpha.page.get_by_text("Snapshot saved; the session goes on running.")).to_be_visible()
    row = alpha.page.locator("tr[data-snapshot]", has_text="before-pause")
    expect(row).to_have_count(1)
    alpha.shot("snapshots")
    row.get_by_role("button", name="New session from it").click()
    expect(alpha.page).to_have_url(re.compile(r"/ui/sessions/[0-9a-f-]{36}\?done=created"))
    assert session_id not in alpha.page.url
    alpha.run("print(kept)")
    expect(alpha.page.locator("#history pre.out-stdout").last).to_have_text("yes")

    alpha.page.goto(f"/ui/sessions/{session_id}")
    alpha.page.get_by_role("button", name="Pause").click()
    expect(alpha.page.locator("#history .state")).to_have_text("paused")
    alpha.page.get_by_role("button", name="Resume").click()
    expect(alpha.page.locator("#history .state")).to_have_text("idle")
    alpha.page.get_by_role("button", name="Close").click()
    expect(alpha.page.get_by_text("Session closed.")).to_be_visible()
    assert alpha.page.locator(f'tr[data-session="{session_id}"]').count() == 0


def test_a_change_without_the_csrf_token_is_refused(alpha, base):
    session_id = alpha.new_session()
    request = alpha.context.request  # the browser's cookies: signed in
    close = f"{base}/ui/sessions/{session_id}/close"
    refused = request.post(close, form={"code": "1"}, max_redirects=0)
    assert refused.status == 403
    assert "CSRF" in refused.text()
    wrong = request.post(close, form={"csrf_token": "guess"}, max_redirects=0)
    assert wrong.status == 403
    header_wrong = request.post(close, headers={"X-CSRF-Token": "guess"}, max_redirects=0)
    assert header_wrong.status == 403
    with api(base, ALPHA) as client:
        assert client.get(f"/v1/sessions/{session_id}").status_code == 200  # still there
    done = request.post(close, form={"csrf_token": alpha.csrf()}, max_redirects=0)
    assert done.status == 303
    with api(base, ALPHA) as client:
        assert client.get(f"/v1/sessions/{session_id}").status_code == 404


def test_a_change_without_a_sign_in_changes_nothing(watched, base):
    with api(base, ALPHA) as client:
        session_id = client.post("/v1/sessions").json()["id"]
        answer = watched.context.request.post(
            f"{base}/ui/sessions/{session_id}/close", form={"csrf_token": "x"}, max_redirects=0
        )
        assert answer.status == 303
        assert answer.headers["location"] == "/ui/login"
        assert client.get(f"/v1/sessions/{session_id}").status_code == 200
        client.delete(f"/v1/sessions/{session_id}")


def test_a_user_sees_only_their_own_sessions(watched, browser, base, tmp_path):
    with api(base, ALPHA) as client:
        theirs = client.post("/v1/sessions").json()["id"]
    try:
        watched.sign_in(BETA)
        mine = watched.new_session()
        watched.page.goto("/ui/")
        expect(watched.page.locator(f'tr[data-session="{mine}"]')).to_have_count(1)
        assert theirs not in watched.page.content()
        response = watched.page.goto(f"/ui/sessions/{theirs}")
        assert response is not None and response.status == 404
        assert theirs not in watched.page.locator("h1").inner_text()
        history = watched.context.request.get(f"{base}/ui/sessions/{theirs}/history")
        assert history.status == 286  # "gone", and nothing of it
        steal = watched.context.request.post(
            f"{base}/ui/sessions/{theirs}/run",
            form={"csrf_token": watched.csrf(), "code": "print('in')"},
            max_redirects=0,
        )
        assert steal.status == 404
    finally:
        with api(base, ALPHA) as client:
            client.delete(f"/v1/sessions/{theirs}")


def test_the_event_tail_shows_the_callers_events_as_they_happen(alpha, base):
    alpha.page.goto("/ui/events")
    tail = alpha.page.locator("#event-tail")
    with api(base, ALPHA) as mine, api(base, BETA) as theirs:
        other = theirs.post("/v1/sessions").json()["id"]
        created = mine.post("/v1/sessions").json()["id"]
        row = tail.locator("tr.event", has=alpha.page.locator(f'a[href="/ui/sessions/{created}"]'))
        expect(row.filter(has_text="session.created")).to_have_count(1)
        alpha.shot("events")
        assert tail.locator(f'a[href="/ui/sessions/{other}"]').count() == 0
        mine.delete(f"/v1/sessions/{created}")
        expect(row.filter(has_text="session.closed")).to_have_count(1)
        theirs.delete(f"/v1/sessions/{other}")
    assert tail.locator(f'a[href="/ui/sessions/{other}"]').count() == 0
    assert alpha.csp_violations() == []


def test_an_admin_lists_every_tenants_sessions_but_opens_only_its_own(watched, base):
    with api(base, ALPHA) as client:
        theirs = client.post("/v1/sessions").json()["id"]
    try:
        watched.sign_in(ADMIN)
        watched.page.goto("/ui/")
        assert watched.page.locator(f'tr[data-session="{theirs}"]').count() == 0
        watched.page.get_by_label("every tenant's").check()
        watched.page.get_by_role("button", name="Filter").click()
        row = watched.page.locator(f'tr[data-session="{theirs}"]')
        expect(row).to_have_count(1)
        assert row.locator("a").count() == 0  # the API's GET of it is its owner's too
        response = watched.page.goto(f"/ui/sessions/{theirs}")
        assert response is not None and response.status == 404
    finally:
        with api(base, ALPHA) as client:
            client.delete(f"/v1/sessions/{theirs}")


def test_a_user_gets_no_every_tenant_view_and_no_cluster(alpha):
    alpha.page.goto("/ui/?all=1")
    assert alpha.page.get_by_label("every tenant's").count() == 0
    assert alpha.page.locator("nav").get_by_text("Cluster").count() == 0
    response = alpha.page.goto("/ui/cluster")
    assert response is not None and response.status == 404  # and not a cluster here anyway


PAGES = ["/ui/", "/ui/snapshots", "/ui/profiles", "/ui/events"]


def test_pages_carry_a_strict_csp_and_no_inline_script_or_style(alpha):
    session_id = alpha.new_session()
    for path in [*PAGES, f"/ui/sessions/{session_id}"]:
        response = alpha.page.goto(path)
        assert response is not None and response.status == 200, path
        headers = response.headers
        assert headers["content-security-policy"] == CSP
        assert "unsafe" not in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "no-referrer"
        assert headers["cache-control"] == "no-store"
        assert alpha.page.locator("script:not([src])").count() == 0, path
        assert alpha.page.locator("style, [style]").count() == 0, path
        assert alpha.page.locator("[onclick], [onload], [onerror], [onsubmit]").count() == 0
        name = urlsplit(path).path.strip("/").replace("/", "-") or "sessions"
        alpha.shot(name[:60])
    alpha.page.goto("/ui/login")  # signed in: on to the sessions
    expect(alpha.page.get_by_role("heading", name="Sessions")).to_be_visible()
    assert alpha.csp_violations() == []
    assert alpha.dialogs == []


def test_the_login_page_and_static_files_carry_the_headers_too(base):
    with httpx.Client(base_url=base) as client:
        for path in ("/ui/login", "/ui/static/ui.js", "/ui/nothing-here"):
            response = client.get(path)
            assert response.headers["content-security-policy"] == CSP, path
            assert response.headers["x-content-type-options"] == "nosniff", path
        assert client.get("/ui/nothing-here").status_code == 404
        redirect = client.get("/ui")
        assert redirect.status_code == 307 and redirect.headers["location"] == "/ui/"
        assert redirect.headers["content-security-policy"] == CSP


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append(value)


def test_the_docs_reference_only_their_own_server(base):
    with httpx.Client(base_url=base) as client:
        docs = client.get("/docs")
        assert docs.status_code == 200
        links = _Links()
        links.feed(docs.text)
        assert len(links.urls) == 4  # two scripts, stylesheet, icon
        assert "<script>" not in docs.text  # no inline script: its CSP allows none
        assert "script-src 'self';" in docs.headers["content-security-policy"]
        for url in links.urls:
            absolute = urljoin(f"{base}/docs", url)
            assert absolute.startswith(f"{base}/"), url
            assert client.get(absolute).status_code == 200, url
        assert "cdn" not in docs.text.lower()
        assert client.get("/redoc").status_code == 404


def test_the_docs_render_offline(watched, base):
    blocked: list[str] = []

    def only_here(route: Any) -> None:
        if route.request.url.startswith(f"{base}/"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    watched.context.route("**/*", only_here)
    watched.page.goto("/docs")
    expect(watched.page.locator(".swagger-ui .info .title")).to_contain_text("cloche")
    expect(watched.page.locator(".opblock").first).to_be_visible()
    watched.shot("docs")
    assert blocked == []
    assert watched.csp_violations() == []


def test_without_tokens_the_inspector_is_open_but_changes_still_need_the_csrf_token(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as client:
        listed = client.get("/ui/", follow_redirects=True)
        assert listed.status_code == 200
        assert [r.headers["location"] for r in listed.history] == [
            "/ui/login?next=%2Fui%2F",
            "/ui/",
        ]
        assert "cloche_ui" in client.cookies
        found = re.search(r'<meta name="csrf-token" content="([^"]+)">', listed.text)
        assert found is not None
        assert client.post("/ui/sessions", data={"profile": "lean"}).status_code == 403
        made = client.post("/ui/sessions", data={"profile": "lean", "csrf_token": found[1]})
        assert made.status_code == 303
        session_id = made.headers["location"].split("/ui/sessions/")[1].split("?")[0]
        assert client.get(f"/v1/sessions/{session_id}").status_code == 200  # no token needed
        client.delete(f"/v1/sessions/{session_id}")
