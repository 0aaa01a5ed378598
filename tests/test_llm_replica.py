"""The simulated replica of bench/routing.py (bench/llm_replica.py) caches as vLLM v1 does:
a request is matched against the prefix cache when its prefill is first scheduled, and the
blocks a step prefills are cached as that step is scheduled. So a second request for a
prompt the engine is still prefilling hits, instead of computing it again (what the
simulator did before, overstating every router's cost of a hot prompt).

The engine runs in-process with tiny modelled step times; no sockets.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llm_replica", ROOT / "bench" / "llm_replica.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["llm_replica"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


sim = load_sim()
PROMPT = "<|system|>\n" + "a shared system prompt of the family " * 130  # ~1,200 tokens
FAST = sim.EngineConfig(step_base=0.001, prefill_cost=0.00001, decode_cost=0.00001)


def seq(text: str, max_tokens: int = 4) -> Any:
    return sim.Seq(text=text, prompt=sim.tokenize(text), max_tokens=max_tokens,
                   out_words=["w"] * max_tokens)


async def first_token(s: Any) -> None:
    await asyncio.wait_for(s.queue.get(), 10)


async def with_engine(cfg: Any, body: Any) -> None:
    engine = sim.Engine("r0", cfg)
    task = asyncio.create_task(engine.run())
    try:
        await body(engine)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def all_but_last_block(text: str) -> int:
    return (len(sim.tokenize(text)) - 1) // sim.BLOCK_TOKENS * sim.BLOCK_TOKENS


def test_second_request_in_the_same_step_hits() -> None:
    """Both arrive before the engine's next step: the first one's prefill, scheduled
    first, caches the prompt's blocks, and the second is matched after it."""
    async def body(engine: Any) -> None:
        a, b = seq(PROMPT + "question one"), seq(PROMPT + "question two")
        engine.submit(a)
        engine.submit(b)
        await first_token(a)
        await first_token(b)
        assert a.cached == 0
        shared = all_but_last_block(PROMPT) - sim.BLOCK_TOKENS  # the blocks before the question
        assert b.cached >= shared > 1000
        assert engine.hits == b.cached
    asyncio.run(with_engine(FAST, body))


def test_request_arriving_during_the_first_prefill_hits() -> None:
    """The second arrives while the first one's prefill step is under way (a step of
    ~1 s here): it is matched when scheduled, in the next step, and hits."""
    slow = sim.EngineConfig(step_base=0.001, prefill_cost=0.001, decode_cost=0.00001)

    async def body(engine: Any) -> None:
        a = seq(PROMPT + "question one")
        engine.submit(a)
        for _ in range(100):  # until the step that prefills `a` has been scheduled
            if a.prefilled >= len(a.prompt):
                break
            await asyncio.sleep(0.005)
        assert a.prefilled >= len(a.prompt)
        assert a.queue.empty()  # its step has not ended
        b = seq(PROMPT + "question two")
        engine.submit(b)
        await first_token(a)
        await first_token(b)
        assert b.cached > 1000
    asyncio.run(with_engine(slow, body))


def test_unrelated_prompt_misses() -> None:
    """Control: a prompt sharing nothing with the one prefilled before it is not matched."""
    async def body(engine: Any) -> None:
        a, b = seq(PROMPT + "question one"), seq("<|user|>\nsomething else entirely " * 40)
        engine.submit(a)
        engine.submit(b)
        await first_token(a)
        await first_token(b)
        assert a.cached == 0 and b.cached == 0
    asyncio.run(with_engine(FAST, body))


def test_streamed_usage_reports_the_cached_tokens_of_the_second_request() -> None:
    """Over HTTP, as the routers see it: two streamed requests for one prompt sent at
    once, both in before the first one's prefill (~1.2 s) ends; one computes the prompt,
    the other's final usage chunk reports it cached (before, both computed it)."""
    from aiohttp.test_utils import TestClient, TestServer

    async def main() -> list[int]:
        replica = sim.Replica("r0", sim.EngineConfig(
            step_base=0.001, prefill_cost=0.001, decode_cost=0.00001))
        client = TestClient(TestServer(replica.app()))
        await client.start_server()
        task = asyncio.create_task(replica.engine.run())
        try:
            async def one(question: str) -> int:
                body = {"messages": [{"role": "system", "content": PROMPT},
                                     {"role": "user", "content": question}],
                        "max_tokens": 4, "stream": True}
                resp = await client.post("/v1/chat/completions", json=body)
                text = await resp.text()
                chunks = [line for line in text.splitlines() if '"usage"' in line]
                assert len(chunks) == 1, text
                return int(json.loads(chunks[0][len("data: "):])["usage"][
                    "prompt_tokens_details"]["cached_tokens"])
            return list(await asyncio.gather(one("question one"), one("question two")))
        finally:
            task.cancel()
            await client.close()

    cached = sorted(asyncio.run(main()))
    assert cached[0] == 0
    assert cached[1] > 1000
