"""Stream resume (docs/resume.md) through a 2-worker sluice-proxy (`--workers 2`, the
workers share the port with SO_REUSEPORT and each keeps its own replica state), with
real llama-servers: a stream on each worker, the engines serving them SIGKILLed
half-way; both streams continue on the surviving engine, and each worker counts its
own resume.

The kernel picks the worker of a connection; the test opens streams (a new connection
each) until it has one in flight on each worker, seen on that worker's own admin port
(`sluice_replica_inflight`), and closes the others.
"""

from __future__ import annotations

import asyncio
import signal

import httpx2
import openai

from tests.support.harness import metric, scrape
from tests.support.llama import MODEL_ALIAS, LlamaFactory
from tests.support.poll import until
from tests.support.processes import ProxyFactory

TOKENS = 2000  # 5-10 s on one thread: time to find a stream on each worker
KILL_AFTER = 200  # content pieces each kept stream has read before the kill
TRIES = 20  # streams opened at most to find one per worker (a miss: 2**-19)


class OneStream:
    """A greedy streamed chat completion through the openai client, read in a task."""

    def __init__(self, proxy_url: str, prompt: str) -> None:
        self.messages = [{"role": "user", "content": prompt}]
        self.client = openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="none",
                                         max_retries=0)  # fmt: skip
        self.pieces: list[str] = []
        self.ids: set[str] = set()
        self.finished = False
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        stream = await self.client.chat.completions.create(
            model=MODEL_ALIAS, messages=self.messages, stream=True,  # type: ignore[arg-type]
            max_tokens=TOKENS, temperature=0,
            # ignore_eos: the random-weight model may end a story early, and a stream that
            # finished before the kill has nothing to resume (a flake seen in CI).
            extra_body={"cache_prompt": False, "ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            self.ids.add(chunk.id)
            if chunk.choices and chunk.choices[0].delta.content:
                self.pieces.append(chunk.choices[0].delta.content)
        self.finished = True

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close()


async def _inflight(admin_url: str) -> float:
    return metric(await scrape(admin_url), "sluice_replica_inflight")


async def _back_to(admin_url: str, count: float) -> bool:
    return await _inflight(admin_url) == count


async def test_resume_through_a_two_worker_proxy(
    llama_factory: LlamaFactory, proxy_factory: ProxyFactory
) -> None:
    servers = await llama_factory.astart(3, slots=2, ctx=2 * (TOKENS + 300))
    proxy = await proxy_factory.astart("--resume-streams", replicas=[s.url for s in servers],
                                       workers=2)  # fmt: skip
    admins = proxy.admin_urls
    kept: dict[int, OneStream] = {}  # worker -> its stream
    try:
        for i in range(TRIES):
            for w in [w for w, k in kept.items() if k.finished]:
                del kept[w]  # ran out while the other worker was being found: find it again
            before = [await _inflight(a) for a in admins]
            s = OneStream(proxy.url, f"stream {i}: tell me a story")
            await until(lambda: bool(s.pieces), timeout=30,  # noqa: B023
                        what=f"stream {i} to start")  # fmt: skip
            now = [await _inflight(a) for a in admins]
            (worker,) = [w for w in range(2) if now[w] > before[w]]
            if worker in kept:
                await s.close()  # the engine frees the slot; the worker's count falls back
                await until(lambda: _back_to(admins[worker], before[worker]),  # noqa: B023
                            timeout=10, what="the closed stream to leave its worker")  # fmt: skip
                continue
            kept[worker] = s
            if len(kept) == 2:
                break
        assert sorted(kept) == [0, 1], f"no stream on each worker in {TRIES} tries"

        await until(lambda: all(len(s.pieces) >= KILL_AFTER for s in kept.values()),
                    timeout=60, what=f"{KILL_AFTER} pieces on each stream")  # fmt: skip
        busy = [s for s in servers if await asyncio.to_thread(s.busy_slots)]
        assert 1 <= len(busy) <= 2 and not any(s.finished for s in kept.values()), busy
        for server in busy:  # every engine serving a kept stream; one (or two) survive
            server.send(signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*(s.task for s in kept.values())), 240)
    finally:
        for s in kept.values():
            await s.close()

    # The reference: an uninterrupted greedy run on an engine that lives (all have the
    # same model and flags).
    survivor = next(s for s in servers if s not in busy)
    async with httpx2.AsyncClient(timeout=120) as http:
        answers = await asyncio.gather(*(http.post(
            f"{survivor.url}/v1/chat/completions", json={
                "model": MODEL_ALIAS, "messages": s.messages, "max_tokens": TOKENS,
                "temperature": 0, "cache_prompt": False, "ignore_eos": True})
            for s in kept.values()))  # fmt: skip
    for (worker, s), direct in zip(kept.items(), answers, strict=True):
        reference = direct.json()["choices"][0]["message"]["content"]
        text = "".join(s.pieces)
        seam = next((i for i, (a, b) in enumerate(zip(text, reference, strict=False))
                     if a != b), None)  # fmt: skip
        assert text == reference, (worker, seam, text[seam or 0:][:40], reference[seam or 0:][:40])
        assert len(s.ids) == 1, (worker, s.ids)  # one stream, one id across the seam
        samples = await scrape(admins[worker])
        assert metric(samples, "sluice_stream_resumes_total", outcome="succeeded") == 1, worker
        assert metric(samples, "sluice_responses_cut_total") == 0, worker
