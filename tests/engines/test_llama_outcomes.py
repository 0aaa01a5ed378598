"""Routing you can check, on real llama.cpp engines (tests/support/llama.py): the prefix
policy's predicted hits against the engine's own `timings.cache_n`, on the proxy's
/metrics (proxy/outcomes.py).

Repeated prompt families, each asked a new question per round: the first round is
predicted a miss on every family and the engine computes the prompt (its `cache_n`
stays below a hit: at most the chat template's opening, shared with the previous
prompt in the slot); every repeat is predicted a hit and the engine reuses the whole
system prompt, plain and streamed (llama-server sends `timings` in the last event).
"""

from __future__ import annotations

import aiohttp

from tests.engines.sse import chat, chat_body, stream_chat
from tests.engines.test_llama import family
from tests.support.harness import metric, scrape
from tests.support.llama import LlamaFactory, timings
from tests.support.poll import until
from tests.support.processes import ProxyFactory


def _cells(samples: list[tuple[str, dict[str, str], float]],
           urls: list[str]) -> dict[tuple[str, str], float]:
    return {(p, e): sum(metric(samples, "sluice_prefix_outcomes_total", replica=u,
                               predicted=p, engine=e) for u in urls)
            for p in ("hit", "miss") for e in ("hit", "miss")}  # fmt: skip


async def test_repeated_prompts_are_engine_hits_where_the_proxy_predicted_them(
    llama_factory: LlamaFactory, proxy_factory: ProxyFactory
) -> None:
    servers = await llama_factory.astart(2, slots=4, ctx=4096)
    urls = [s.url for s in servers]
    proxy = await proxy_factory.astart("--policy", "prefix", replicas=urls)
    seeds = range(3)
    cache_n: list[list[int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for rnd, question in enumerate(("what is this?", "and why?", "tell me more")):
            row = []
            for seed in seeds:
                messages = [{"role": "system", "content": family(seed)},
                            {"role": "user", "content": question}]  # fmt: skip
                body = chat_body(messages, max_tokens=4)
                if rnd < 2:
                    row.append(timings(await chat(http, proxy.url, body)).cache_n)
                else:
                    stream = await stream_chat(http, proxy.url, body)
                    assert stream.complete(4), stream
                    row.append(stream.timings.cache_n)
            cache_n.append(row)

    def reports(samples: list[tuple[str, dict[str, str], float]]) -> float:
        return sum(metric(samples, "sluice_prefix_engine_reports_total", replica=u)
                   for u in urls)

    async def counted() -> list[tuple[str, dict[str, str], float]] | None:
        samples = await scrape(proxy.admin_url)
        return samples if reports(samples) >= 9 else None

    # The proxy counts an engine's report as the response ends, which may be just after
    # the client read its last byte: wait until all 9 are in (or time out, and fail).
    samples = await until(counted, timeout=10, what="the proxy to count 9 engine reports")

    prompt = len(family(0))  # about one token per character
    cold, *warm = cache_n
    assert all(n < 64 for n in cold), cache_n  # below the hit threshold (one block)
    assert all(n >= prompt for row in warm for n in row), cache_n
    cells = _cells(samples, urls)
    assert cells == {("miss", "miss"): 3, ("miss", "hit"): 0,
                     ("hit", "hit"): 6, ("hit", "miss"): 0}, cells
    reported = sum(metric(samples, "sluice_prefix_engine_cached_tokens_total", replica=u)
                   for u in urls)
    assert reported == sum(map(sum, cache_n))
    assert reports(samples) == 9
