"""/metrics tells the pool's hits and misses per profile and how long cells wait for their
session, against a real gVisor server."""

from __future__ import annotations

import asyncio
import re

import httpx

from support import ServerThread


def scrape(server: ServerThread) -> str:
    return httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=60).text


def value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match[1])


def test_metrics_count_pool_hits_and_misses_per_profile(make_server):
    server = make_server(pool_size=1, pool_max=1)
    manager = server.server.manager
    before = scrape(server)
    assert value(before, 'cloche_pool_hits_total{profile="lean"}') == 0
    assert value(before, 'cloche_pool_misses_total{profile="data"}') == 0

    async def three() -> list[str]:
        infos = await asyncio.gather(*(manager.create() for _ in range(3)))
        return [info.id for info in infos]

    sessions = server.call(three())
    after = scrape(server)
    hits = value(after, 'cloche_pool_hits_total{profile="lean"}')
    misses = value(after, 'cloche_pool_misses_total{profile="lean"}')
    assert (hits, misses) == (1, 2)  # one was ready; the other two were started at once
    assert value(after, 'cloche_pool_target{profile="lean"}') == 1
    for session_id in sessions:
        server.call(manager.close(session_id))


def test_metrics_tell_how_long_cells_waited_for_their_session(make_server):
    server = make_server(pool_size=1)
    manager = server.server.manager
    session_id = server.call(manager.create()).id

    async def two_at_once() -> None:
        # The first takes the session at once; the second waits for its second of sleep.
        await asyncio.gather(
            manager.execute(session_id, "import time; time.sleep(1)"),
            manager.execute(session_id, "2"),
        )

    server.call(two_at_once())
    text = scrape(server)
    count = value(text, "cloche_cell_queue_wait_seconds_count")
    waited_under_half_a_second = value(text, 'cloche_cell_queue_wait_seconds_bucket{le="0.5"}')
    assert count == 2
    assert waited_under_half_a_second == 1
    server.call(manager.close(session_id))
