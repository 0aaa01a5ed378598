"""Responses cut short are visible (proxy/cuts.py): counted by cause in /metrics, not
as a plain 200, and logged once at warning level. Real replica processes, a real
sluice-proxy process."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.harness import BASE_ARGS, metric, scrape
from tests.support.poll import until
from tests.support.processes import Proxy, ProxyFactory, ReplicaFactory

CUT = "sluice_responses_cut_total"


async def read_until_cut(url: str, after_first: asyncio.Event) -> tuple[int, int, str]:
    """GET `url`, reading its body: (status, body bytes received, how it ended)."""
    got = 0
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        try:
            async for chunk in resp.content.iter_any():
                got += len(chunk)
                after_first.set()
        except aiohttp.ClientPayloadError as exc:
            return resp.status, got, type(exc).__name__
        return resp.status, got, "complete"


def cut_lines(proxy: Proxy) -> list[str]:
    return [line for line in proxy.stderr_text().splitlines() if "cut response:" in line]


async def test_a_stream_on_a_sigkilled_replica_ends_at_once_and_is_counted(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    (replica,) = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[replica])
    first = asyncio.Event()
    # A 60 s stream, one event every 0.2 s; the query string is never logged.
    reader = asyncio.create_task(
        read_until_cut(f"{proxy.url}/sse?n=300&interval=0.2&token=s3cret", first))
    await asyncio.wait_for(first.wait(), 10)
    replica.kill()  # SIGKILL
    # The client's stream ends visibly (an incomplete chunked body), well before its 60 s.
    status, got, ending = await asyncio.wait_for(reader, 10)
    assert (status, ending) == (200, "ClientPayloadError") and got > 0
    samples = await scrape(proxy.admin_url)
    assert metric(samples, CUT, cause="upstream_eof") + metric(
        samples, CUT, cause="upstream_reset") == 1
    assert metric(samples, "sluice_responses_total", code="200") == 0  # not a plain 200
    (line,) = await until(lambda: cut_lines(proxy), what="the cut's log line")
    assert "WARNING" in line and f"replica={replica.url}" in line
    assert "GET /sse " in line and "s3cret" not in line
    assert "status=200" in line and "bytes=" in line and "duration=" in line


async def test_idle_timeout_and_a_reset_mid_body_are_counted_by_cause(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    (replica,) = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--stream-idle-timeout", "0.5",
                                       replicas=[replica])  # fmt: skip
    # A stream that goes quiet for 30 s after its first event: cut by the idle timeout.
    status, _, ending = await read_until_cut(f"{proxy.url}/sse?n=2&interval=30",
                                             asyncio.Event())  # fmt: skip
    assert (status, ending) == (200, "ClientPayloadError")
    # The replica aborts its connection after the first chunk.
    status, _, ending = await read_until_cut(f"{proxy.url}/stream_then_die", asyncio.Event())
    assert (status, ending) == (200, "ClientPayloadError")
    # A complete stream is a 200, not a cut.
    status, _, ending = await read_until_cut(f"{proxy.url}/sse?n=3&interval=0.01",
                                             asyncio.Event())  # fmt: skip
    assert (status, ending) == (200, "complete")
    samples = await scrape(proxy.admin_url)
    assert metric(samples, CUT, cause="idle_timeout") == 1
    assert metric(samples, CUT, cause="upstream_eof") + metric(
        samples, CUT, cause="upstream_reset") == 1
    assert metric(samples, "sluice_responses_total", code="200") == 1
    await until(lambda: len(cut_lines(proxy)) == 2, what="one log line per cut")
    lines = cut_lines(proxy)
    assert any("cause=idle_timeout" in line for line in lines)
