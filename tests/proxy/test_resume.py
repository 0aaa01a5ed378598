"""Stream resume (proxy/resume.py) against real processes: a sluice-proxy in front of
replicas that speak vLLM's continuation fields (tests/support/vllm_fake.py, a fake of
vLLM's OpenAI API), one of them SIGKILLed half-way through the stream it serves.

The fake's answer is a fixed function of the prompt, so the text an uninterrupted
stream carries is known: a resumed stream must carry exactly that text (the first
part followed by the continuation, nothing lost or repeated at the seam).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from tests.support.harness import metric, scrape
from tests.support.poll import until
from tests.support.ports import HOST, free_port
from tests.support.processes import Process, ProxyFactory, http_get
from tests.support.rawhttp import connect, get, read_chunks, read_head
from tests.support.vllm_fake import full_answer

MODEL = "fake-vllm"
TOKENS = 24
CUT_AFTER = 8  # content chunks the client reads before the serving replica is killed


class FakeVllm(Process):
    def __init__(self, log_dir: Path, token_delay: float) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        super().__init__([sys.executable, "-m", "tests.support.vllm_fake", "--port",
                          str(self.port), "--token-delay", str(token_delay)],
                         log_dir / f"vllm-fake-{self.port}.log", None)

    def stats(self) -> dict[str, Any]:
        status, body = http_get(HOST, self.port, "/stats")
        assert status == 200
        result: dict[str, Any] = json.loads(body)
        return result

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        self.wait(5)


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[list[FakeVllm]]:
    started = [FakeVllm(tmp_path, token_delay=0.05) for _ in range(2)]
    try:
        for fake in started:
            ProxyFactory._wait_sync([(fake, fake.port, "/health", True)], 15, "fake vLLM")
        yield started
    finally:
        for fake in started:
            fake.stop(timeout=2)


async def _serving(fakes: list[FakeVllm]) -> FakeVllm:
    async def one() -> FakeVllm | None:
        for fake in fakes:
            if fake.alive and (await asyncio.to_thread(fake.stats))["in_flight"]:
                return fake
        return None

    return await until(one, timeout=10, what="the replica serving the stream")


async def _chat_stream(proxy_url: str, fakes: list[FakeVllm], *, prompt: str,
                       kill: bool = True) -> tuple[str, list[Any], FakeVllm | None]:
    """Stream a chat completion with the openai client; SIGKILL its replica half-way."""
    client = openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="none", max_retries=0)
    pieces: list[str] = []
    chunks: list[Any] = []
    killed = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True,
            max_tokens=TOKENS, stream_options={"include_usage": True})
        async for chunk in stream:
            chunks.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if kill and killed is None and len(pieces) == CUT_AFTER:
                    killed = await _serving(fakes)
                    killed.kill()
    finally:
        await client.close()
    return "".join(pieces), chunks, killed


async def test_a_chat_stream_survives_its_replica(fakes: list[FakeVllm],
                                                  proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory.astart("--resume-streams", replicas=[f.url for f in fakes])
    text, chunks, killed = await _chat_stream(proxy.url, fakes, prompt="tell me a story")
    assert killed is not None
    # One uninterrupted stream: every word once, in order, as an uncut replica answers.
    assert text == full_answer("tell me a story", TOKENS)
    assert {c.id for c in chunks} == {chunks[0].id}  # the first part's id throughout
    assert {c.created for c in chunks} == {chunks[0].created}
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]  # the continuation's role chunk was dropped
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == TOKENS  # both parts counted
    # The survivor was asked to continue the partial message, not to start a new turn.
    (survivor,) = [f for f in fakes if f is not killed]
    seen = await asyncio.to_thread(survivor.stats)
    assert seen["continuations"] == 1
    assert text.startswith(seen["last_prefix"]) and len(seen["last_prefix"].split()) >= CUT_AFTER
    samples = await scrape(proxy.admin_url)
    assert metric(samples, "sluice_stream_resumes_total", replica=killed.url,
                  cause="reset", outcome="succeeded") == 1
    assert metric(samples, "sluice_stream_resumes_total", outcome="failed") == 0
    assert "continuing on another replica" in proxy.output()


async def test_a_completions_stream_survives_its_replica(fakes: list[FakeVllm],
                                                         proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory.astart("--resume-streams", replicas=[f.url for f in fakes])
    prompt = "Once upon a time"
    body = json.dumps({"model": MODEL, "prompt": prompt, "stream": True,
                       "max_tokens": TOKENS}).encode()
    events: list[bytes] = []
    async with connect(proxy.port) as conn:
        conn.send(get("/v1/completions", "Content-Type: application/json", method="POST",
                      body=body))
        status, _ = await read_head(conn.reader)
        assert status == 200
        async for chunk in read_chunks(conn.reader):  # ends at the last chunk: no cut
            events += [e for e in chunk.split(b"\n\n") if e]
            if len(events) == CUT_AFTER:
                (await _serving(fakes)).kill()
    assert events[-1] == b"data: [DONE]"
    parsed = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in parsed) == full_answer(prompt, TOKENS)
    assert len({p["id"] for p in parsed}) == 1


async def test_a_resumable_stream_has_its_bytes_in_the_access_log(
        fakes: list[FakeVllm], proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    """A stream the proxy watches for resume (its own relay path) counts the replica's
    body bytes like any response: the access log's $bytes is not 0."""
    log = tmp_path / "access.log"
    proxy = await proxy_factory.astart("--resume-streams", "--access-log", str(log),
                                       replicas=[f.url for f in fakes])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}],
            "max_tokens": TOKENS, "stream": True}
    async with httpx2.AsyncClient(timeout=30) as http:
        resp = await http.post(f"{proxy.url}/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    line = await until(lambda: log.exists() and log.read_text(), timeout=5,
                       what="the access log line")
    status, sent = line.split('" ', 1)[1].split()[:2]
    assert (status, int(sent)) == ("200", len(resp.content)), line


async def test_without_resume_the_stream_is_cut_as_before(fakes: list[FakeVllm],
                                                          proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory.astart(replicas=[f.url for f in fakes])
    with pytest.raises((httpx2.HTTPError, openai.APIError)):
        await _chat_stream(proxy.url, fakes, prompt="tell me a story")
    (survivor,) = [f for f in fakes if f.alive]
    assert (await asyncio.to_thread(survivor.stats))["requests"] == 0  # nothing continued


async def test_with_no_other_replica_the_stream_is_cut_and_counted(
        fakes: list[FakeVllm], proxy_factory: ProxyFactory) -> None:
    alone = fakes[0]
    proxy = await proxy_factory.astart("--resume-streams", "--retry-deadline", "3",
                                       "--resume-attempts", "2", replicas=[alone.url])
    with pytest.raises((httpx2.HTTPError, openai.APIError)):
        await _chat_stream(proxy.url, [alone], prompt="tell me a story")
    samples = await scrape(proxy.admin_url)
    assert metric(samples, "sluice_stream_resumes_total", replica=alone.url,
                  outcome="attempted") == 1
    assert metric(samples, "sluice_stream_resumes_total", replica=alone.url,
                  outcome="failed") == 1
    assert metric(samples, "sluice_stream_resumes_total", outcome="succeeded") == 0
    assert "not resumed" in proxy.output()


# -- real llama.cpp servers ----------------------------------------------------------


async def test_a_chat_stream_survives_its_llama_server(llama_factory: Any,
                                                       proxy_factory: ProxyFactory) -> None:
    """Two real llama-servers (tests/support/llama.py) behind a resuming proxy; the one
    serving a greedy stream is SIGKILLed half-way (after a third of its tokens). The
    client's text is what an uninterrupted greedy run gives: the llama-server build
    honours continue_final_message (docs/resume.md), so nothing is repeated at the seam."""
    from tests.support.llama import MODEL_ALIAS

    servers = await llama_factory.astart(2, slots=1, ctx=2048)
    proxy = await proxy_factory.astart("--resume-streams", replicas=[s.url for s in servers])
    request: dict[str, Any] = {
        "model": MODEL_ALIAS, "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 1500, "temperature": 0, "cache_prompt": False}
    async with httpx2.AsyncClient(timeout=60) as http:
        direct = await http.post(f"{servers[1].url}/v1/chat/completions", json=request)
    reference = direct.json()["choices"][0]["message"]["content"]
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
    pieces: list[str] = []
    ids = set()
    killed = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL_ALIAS, messages=request["messages"], stream=True,
            max_tokens=request["max_tokens"], temperature=0,
            extra_body={"cache_prompt": False})
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if killed is None and len(pieces) == request["max_tokens"] // 3:
                    busy = [s for s in servers if await asyncio.to_thread(s.busy_slots)]
                    assert len(busy) == 1, "the stream ended before the kill"
                    killed = busy[0]
                    killed.send(signal.SIGKILL)
    finally:
        await client.close()
    assert killed is not None
    text = "".join(pieces)
    seam = next((i for i, (a, b) in enumerate(zip(text, reference, strict=False))
                 if a != b), None)
    assert text == reference, f"diverges at {seam}: {text[:seam]!r} | {text[seam:][:40]!r}"
    assert len(ids) == 1
    samples = await scrape(proxy.admin_url)
    assert metric(samples, "sluice_stream_resumes_total", replica=killed.url,
                  outcome="succeeded") == 1
