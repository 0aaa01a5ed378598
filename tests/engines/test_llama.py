"""sluice in front of real llama.cpp engines (tests/support/llama.py): real tokenisation,
slots and prompt caches, so each claim is proven by the engine's own counters
(``timings.cache_n`` per response, ``/slots``, Prometheus ``/metrics``), not by a
replica we wrote.

- chat completions, plain and streamed, through sluice-proxy arrive as the engine sent
  them (byte-identical text with temperature 0);
- the ``prefix`` policy sends each prompt family back to the server that cached it
  (that server's cache_n), where ``round_robin`` sends the repeat elsewhere (cache_n ~0);
- a client that goes away mid-stream frees the engine's slot (the engine stops
  generating: its own token counter stays far below the stream's max_tokens);
- the ``openai`` client streams through sluice;
- the update tests (a count-only ``sluice update`` and a rolling one under real
  streams, and a rolling update under long streams that drain until idle) are in
  test_updates.py; stream resume through a 2-worker proxy in test_resume_workers.py.

Every test skips with one line where the engine cannot run (tests/support/llama.py).
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp

from proxy.replica import Replica
from proxy.stats import Stats
from proxy.warmup import Warmer
from proxy.wire.snapshot import ReadyReplica
from tests.engines.sse import Stream, chat, chat_body, events, stream_chat
from tests.support.llama import MODEL_ALIAS, LlamaFactory, LlamaServer, timings
from tests.support.poll import until
from tests.support.processes import ProxyFactory


def family(seed: int, chars: int = 600) -> str:
    """A long system prompt, different from every other seed's in its first bytes."""
    rng = random.Random(seed)
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)))
    return f"family {seed}: " + " ".join(words)


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))


async def test_chat_and_streamed_chat_through_the_proxy_match_the_engine(
    llama_factory: LlamaFactory, proxy_factory: ProxyFactory
) -> None:
    [server] = await llama_factory.astart(1, slots=2)
    proxy = await proxy_factory.astart(replicas=[server.url])
    body = chat_body("tell me about sluices", max_tokens=24)
    async with session() as http:
        direct = await chat(http, server.url, body)
        proxied = await chat(http, proxy.url, body)
        streamed = await stream_chat(http, proxy.url, body)

    text = direct["choices"][0]["message"]["content"]
    assert len(text) >= 24 and direct["usage"]["completion_tokens"] == 24
    assert proxied["choices"][0]["message"]["content"] == text
    assert proxied["model"] == MODEL_ALIAS
    assert proxied["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert streamed.complete(24), streamed
    assert streamed.text == text
    # The repeats reused the first request's prompt from the engine's slot.
    assert timings(proxied).cache_n > 0 and streamed.timings.cache_n > 0


def _served_by(servers: list[LlamaServer], before: list[dict[str, float]]) -> int:
    """Which one server computed or reused prompt tokens since `before`."""
    def seen(m: dict[str, float]) -> float:
        return m["llamacpp:prompt_tokens_total"] + m["llamacpp:prompt_tokens_cached_total"]

    grew = [i for i, s in enumerate(servers) if seen(s.metrics()) > seen(before[i])]
    assert len(grew) == 1, grew
    return grew[0]


async def _rounds(
    http: aiohttp.ClientSession, url: str, servers: list[LlamaServer], seeds: range
) -> list[list[tuple[int, int]]]:
    """Two rounds over the families (a new question each time): per round, per family,
    (the server that served it, the response's cache_n)."""
    out = []
    for question in ("what is this?", "and why is that?"):
        row = []
        for seed in seeds:
            before = [s.metrics() for s in servers]
            messages = [{"role": "system", "content": family(seed)},
                        {"role": "user", "content": question}]  # fmt: skip
            reply = await chat(http, url, chat_body(messages, max_tokens=4))
            row.append((_served_by(servers, before), timings(reply).cache_n))
        out.append(row)
    return out


async def test_prefix_policy_sends_a_repeated_long_prompt_to_the_server_that_has_it(
    llama_factory: LlamaFactory, proxy_factory: ProxyFactory
) -> None:
    # 4 slots per server: 3 families fit on any one server, so nothing is evicted.
    servers = await llama_factory.astart(3, slots=4, ctx=4096)
    urls = [s.url for s in servers]
    prefix = await proxy_factory.astart("--policy", "prefix", replicas=urls)
    rr = await proxy_factory.astart("--policy", "round_robin", replicas=urls)
    async with session() as http:
        first, second = await _rounds(http, prefix.url, servers, range(3))
        # 2 families over 3 servers: round_robin's period differs from the rounds'.
        rr_first, rr_second = await _rounds(http, rr.url, servers, range(10, 12))

    prompt = len(family(0))  # about one token per character
    for (where, cold), (again, cache_n) in zip(first, second, strict=True):
        assert cold < 50  # only the chat template's first tokens were known
        assert again == where, (first, second)  # the same server ...
        assert cache_n >= prompt, (first, second)  # ... reused the whole system prompt
    # The control: round_robin sends every repeat to a server without that prompt.
    for (where, _), (again, cache_n) in zip(rr_first, rr_second, strict=True):
        assert again != where and cache_n < 50, (rr_first, rr_second)


async def test_a_warm_up_leaves_the_prompt_in_the_engines_slot(
    llama_factory: LlamaFactory,
) -> None:
    # --prefix-warm-copies (proxy/warmup.py): the one-token warm-up a new copy of a family
    # gets must leave the prompt where the family's next request reuses it.
    [server] = await llama_factory.astart(1, slots=2)
    replica = Replica(ReadyReplica(id=1, url=server.url))
    warmer = Warmer(Stats(), timeout=60.0)  # the engine's behaviour, not the hold's bound
    messages = [{"role": "system", "content": family(3)}, {"role": "user", "content": "hi"}]
    body = json.dumps(chat_body(messages, max_tokens=24, stream=True)).encode()
    before = server.metrics()
    outcomes: list[bool] = []
    try:
        warmer.start(replica, b"POST /v1/chat/completions HTTP/1.1\r\n", b"\r\n", body,
                     outcomes.append)
        await until(lambda: outcomes, timeout=60, what="the warm-up's answer")
    finally:
        await warmer.aclose()
    after = server.metrics()
    assert outcomes == [True] and replica.inflight == 0
    # One token generated, the whole prompt computed.
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 1
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] >= \
        len(family(3))
    messages[1]["content"] = "and now a real question?"
    async with session() as http:
        reply = await chat(http, server.url, chat_body(messages, max_tokens=4))
    assert timings(reply).cache_n >= len(family(3))


async def test_a_client_leaving_mid_stream_frees_the_engines_slot(
    llama_factory: LlamaFactory, proxy_factory: ProxyFactory
) -> None:
    # One slot: if the abandoned generation went on, the next request would queue.
    [server] = await llama_factory.astart(1, slots=1, ctx=4096)
    proxy = await proxy_factory.astart(replicas=[server.url])
    long_stream = chat_body("go on forever", max_tokens=4000, stream=True)
    async with session() as http:
        partial = Stream()
        async with http.post(f"{proxy.url}/v1/chat/completions", json=long_stream) as resp:
            assert resp.status == 200
            reading = asyncio.create_task(events(resp, partial))
            await until(lambda: len(partial.content) >= 5, timeout=30, what="5 tokens")
            assert server.busy_slots() == 1
            reading.cancel()
            resp.close()  # the client goes away
        await until(lambda: server.busy_slots() == 0, timeout=15, what="the slot to free")

        # Exactly one 499, polled for. The next request's reader stops at [DONE] and
        # closes, maybe before the engine's last chunk: that counts as its 200, not as a
        # second client leaving (proxy/exchange.py on_client_lost). The lines say what
        # the scrape did show.
        def disconnects() -> list[str]:
            status, body = proxy.admin_get("/metrics")
            assert status == 200
            return [line for line in body.decode().splitlines()
                    if line.startswith(("sluice_client_disconnects_total",
                                        "sluice_responses_total"))]

        try:
            await until(lambda: "sluice_client_disconnects_total 1.0" in disconnects(),
                        timeout=10, what="the proxy to count the client's disconnect")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {disconnects()}") from None
        after = await stream_chat(http, proxy.url, chat_body("next one", max_tokens=8))

    assert after.complete(8), after
    assert not partial.done
    predicted = server.metrics()["llamacpp:n_decode_total"]
    assert predicted < 1000, predicted  # the 4,000-token generation was stopped early


def test_the_openai_client_streams_through_sluice(
    llama_factory: LlamaFactory, proxy_factory: ProxyFactory
) -> None:
    import openai

    [server] = llama_factory(1, slots=2)
    proxy = proxy_factory(replicas=[server.url])
    messages = [{"role": "user", "content": "stream me a few tokens"}]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused") as direct:
        expected = direct.chat.completions.create(
            model=MODEL_ALIAS, messages=messages, max_tokens=16, temperature=0  # type: ignore[arg-type]
        )
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL_ALIAS, messages=messages, max_tokens=16, temperature=0,  # type: ignore[arg-type]
            stream=True,
        )  # fmt: skip
        chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks
              if c.choices and c.choices[0].delta.content]  # fmt: skip
    assert len(deltas) == 16
    assert "".join(deltas) == expected.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
