"""The engine scraper against real processes: a real llama-server, fakes of the vLLM,
SGLang and TGI metric formats (tests/support/engine_fake.py, with a real queue), a
plain replica with no metrics, a closed port and a server that never answers; the view
it publishes read back through a real redis-server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from controlplane.engines.scraper import EngineScraper, ScrapeTarget
from controlplane.store import Store
from tests.support.cancel import SwallowsCancel
from tests.support.engine_fakes import EngineFakeFactory
from tests.support.llama import LlamaFactory
from tests.support.ports import free_port
from tests.support.processes import ReplicaFactory


@pytest.fixture
async def scraper(store: Store) -> AsyncIterator[EngineScraper]:
    s = EngineScraper(store, timeout=1.0)
    await s.start()
    yield s
    await s.aclose()


async def test_run_ends_when_a_library_under_it_swallows_the_cancel(store: Store) -> None:
    # A scrape or a publish whose client library turns the cancel into a return (redis-py,
    # aiohttp now and then): run() used to carry on, so its controller never stepped down.
    scraper = EngineScraper(store)
    step = SwallowsCancel()  # the cancel turned into a return
    scraper.step = step  # type: ignore[method-assign]
    task = asyncio.create_task(scraper.run())
    assert await step.stops(task), f"still running after {step.calls} steps"
    assert step.calls == 1


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[int]:
    """Accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    port = free_port()
    server = await asyncio.start_server(hold, "127.0.0.1", port)
    try:
        yield port
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def load(session: aiohttp.ClientSession, url: str, n: int, hold: float) -> None:
    async def one() -> None:
        async with session.post(f"{url}/v1/completions?hold={hold}", data=b"{}") as r:
            await r.read()

    await asyncio.gather(*(one() for _ in range(n)))


async def test_every_engine_is_read_and_the_rest_is_unknown(
    store: Store,
    scraper: EngineScraper,
    engine_fakes: EngineFakeFactory,
    llama_factory: LlamaFactory,
    replica_factory: ReplicaFactory,
) -> None:
    vllm, sglang, tgi = [(await engine_fakes.astart(e))[0] for e in ("vllm", "sglang", "tgi")]
    (llama,) = await llama_factory.astart(1, slots=2, ctx=2048)
    (plain,) = await replica_factory.astart(1)
    closed = f"http://127.0.0.1:{free_port()}"
    async with silent_server() as silent_port:
        silent = f"http://127.0.0.1:{silent_port}"
        urls = [vllm.url, sglang.url, tgi.url, llama.url, plain.url, closed, silent]
        scraper.track("svc", [ScrapeTarget(i, url, interval=1.0) for i, url in enumerate(urls)])
        await scraper.step()
    view = await store.telemetry.read_engines("svc")
    assert view is not None and view.service == "svc"
    got = {int(k): v for k, v in view.replicas.items()}
    assert [got[i].engine for i in range(7)] == ["vllm", "sglang", "tgi", "llamacpp", "unknown",
                                                 "unknown", "unknown"]  # fmt: skip
    assert [got[i].url for i in range(7)] == urls
    for i in range(4):
        assert got[i].error is None and got[i].running == 0 and got[i].waiting == 0
    assert got[3].kv_capacity_tokens == 2048  # llama.cpp: /props n_ctx x total_slots
    assert got[3].slots == 2 and got[0].slots is None  # vLLM does not say
    assert got[4].error == "HTTP 404"
    assert got[5].error is not None and "Connect" in got[5].error
    assert got[6].error == "timeout"


async def test_a_queue_shows_within_one_scrape_and_clears_after(
    store: Store,
    scraper: EngineScraper,
    engine_fakes: EngineFakeFactory,
    llama_factory: LlamaFactory,
) -> None:
    (vllm,) = await engine_fakes.astart("vllm", slots=2)
    (llama,) = await llama_factory.astart(1, slots=2, ctx=2048)
    scraper.track("svc", [ScrapeTarget(1, vllm.url, interval=0.2),
                          ScrapeTarget(2, llama.url, interval=0.2)])  # fmt: skip
    await scraper.step()
    async with aiohttp.ClientSession() as session:
        fake_load = asyncio.create_task(load(session, vllm.url, 6, hold=3.0))
        body = {"messages": [{"role": "user", "content": "q " * 300}], "max_tokens": 400,
                "temperature": 0}  # fmt: skip
        real_load = [asyncio.create_task(session.post(f"{llama.url}/v1/chat/completions",
                                                      json=body)) for _ in range(5)]

        async def queued() -> bool:
            await scraper.step()
            view = await store.telemetry.read_engines("svc")
            assert view is not None
            fake, real = view.replicas["1"], view.replicas["2"]
            return (fake.running, fake.waiting) == (2, 4) and (real.waiting or 0) >= 1

        from tests.support.poll import until

        await until(queued, timeout=20, what="both engines to report their queue")
        await fake_load
        for task in real_load:
            (await task).release()

        async def drained() -> bool:
            await scraper.step()
            view = await store.telemetry.read_engines("svc")
            assert view is not None
            return all(r.running == 0 and r.waiting == 0 for r in view.replicas.values())

        await until(drained, timeout=20, what="both queues to drain")
    view = await store.telemetry.read_engines("svc")
    assert view is not None
    fake = view.replicas["1"]
    # The six requests finished in the interval before: vLLM's TTFT histogram moved.
    assert fake.tokens_per_s is not None


async def test_a_failing_replica_is_asked_less_and_less_often(
    store: Store, scraper: EngineScraper, tmp_path: Path
) -> None:
    now = [1000.0]
    s = EngineScraper(store, clock=lambda: now[0])
    try:
        s.track("svc", [ScrapeTarget(1, f"http://127.0.0.1:{free_port()}", interval=1.0)])
        seen = []
        for _ in range(40):  # 40 s of 1 s ticks
            await s.step()
            seen.append(s.scrapes)
            now[0] += 1.0
        # 2, 4, 8, 16 s of backoff, then every 30 s: 6 attempts, not 40.
        assert s.scrapes <= 6, seen
        view = await store.telemetry.read_engines("svc")
        assert view is not None and view.replicas["1"].engine == "unknown"
    finally:
        await s.aclose()


async def test_a_page_over_the_size_bound_is_not_parsed(
    store: Store, engine_fakes: EngineFakeFactory
) -> None:
    (vllm,) = await engine_fakes.astart("vllm")
    s = EngineScraper(store, max_bytes=1024)  # a vLLM page is several KiB
    try:
        s.track("svc", [ScrapeTarget(1, vllm.url)])
        await s.step()
        view = await s._store.telemetry.read_engines("svc")
        assert view is not None
        assert view.replicas["1"].error == "metrics page over 1024 bytes"
        assert view.replicas["1"].running is None
    finally:
        await s.aclose()


async def test_untracked_replicas_and_services_leave_the_view(
    store: Store, scraper: EngineScraper, engine_fakes: EngineFakeFactory
) -> None:
    a, b = await engine_fakes.astart("sglang", n=2)
    scraper.track("svc", [ScrapeTarget(1, a.url), ScrapeTarget(2, b.url)])
    await scraper.step()
    scraper.track("svc", [ScrapeTarget(2, b.url, interval=0.2)])
    assert set(scraper.view("svc").replicas) == {"2"}
    scraper.forget("svc")
    assert scraper.view("svc").replicas == {} and scraper.next_due() is None
