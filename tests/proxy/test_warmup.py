"""Warm copies (proxy/warmup.py, `--prefix-warm-copies`): a hot family's new replica gets
a one-token warm-up of the prompt, and no client request computes it cold there.

The warm-up's body and headers (hostile bodies included), the policy's decisions with the
option on (the request that made the copy waits where the prompt is; the copy takes the
overflow once warmed, as a predicted hit), the Warmer against a real scripted engine
(answered, failed, refused, bounded), and the whole path through a real proxy process
to real engine processes, with the option on and off."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store
from proxy.readyset import ReadySet
from proxy.replica import Replica
from proxy.stats import Stats
from proxy.warmup import Warmer, warm_body, warm_headers, warm_path, warm_url
from proxy.wire.snapshot import PrefixOptions, ReadyReplica
from tests.proxy.test_outcomes import CacheEngine, CacheEngines, cache_engines, chat  # noqa: F401
from tests.proxy.test_prefix import URLS, Req, bodies, key, snapshot
from tests.support.harness import BASE_ARGS, metric, scrape
from tests.support.poll import until
from tests.support.ports import free_port
from tests.support.processes import HOST, ProxyFactory

# -- the warm-up request ----------------------------------------------------------------


def test_only_completion_posts_are_warmed() -> None:
    assert warm_path(b"POST /v1/chat/completions HTTP/1.1") == "/v1/chat/completions"
    assert warm_path(b"POST /v1/completions?x=1 HTTP/1.1") == "/v1/completions?x=1"
    for line in (b"GET /v1/chat/completions HTTP/1.1", b"POST /v1/embeddings HTTP/1.1",
                 b"POST /v1/chat/completions/x HTTP/1.1", b"POST http://h/v1/completions HTTP/1.1",
                 b"POST /v1/completions", b"POST  /v1/completions HTTP/1.1", b"",
                 b"POST /v1/completions\xff HTTP/1.1"):
        assert warm_path(line) is None, line


def test_the_warm_up_asks_one_token_of_the_same_prompt() -> None:
    original = {"model": "m", "messages": [{"role": "system", "content": "x" * 300}],
                "stream": True, "stream_options": {"include_usage": True}, "n": 3,
                "max_tokens": 500, "max_completion_tokens": 400, "temperature": 0.2,
                "min_tokens": 10,
                "tools": [{"type": "function", "function": {"name": "f"}}]}
    warm = json.loads(warm_body(json.dumps(original).encode()) or b"")
    assert warm == {**{k: v for k, v in original.items()
                       if k not in ("stream_options", "min_tokens")},
                    "stream": False, "n": 1, "max_tokens": 1, "max_completion_tokens": 1}
    assert json.loads(warm_body(b'{"prompt": "abc"}') or b"") == {
        "prompt": "abc", "max_tokens": 1, "stream": False}
    for hostile in (b"", b"[1, 2]", b'"s"', b"{", b'{"a": 1}x', b"\xff\xfe", b"null",
                    b"[" * 100_000, b'{"a": ' + b"[" * 100_000,
                    b'{"prompt": "' + b"x" * (1 << 20) + b'"}'):
        assert warm_body(hostile) is None, hostile[:20]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=8))
def test_any_json_object_keeps_every_field_but_the_output_ones(doc: dict[str, Any]) -> None:
    warm = json.loads(warm_body(json.dumps(doc).encode()) or b"")
    assert warm["max_tokens"] == 1 and warm["stream"] is False and "stream_options" not in warm
    changed = {"max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
               "min_tokens"}
    assert {k: v for k, v in warm.items() if k not in changed} == \
        {k: v for k, v in doc.items() if k not in changed}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_give_a_body_or_none_never_an_error(raw: bytes) -> None:
    warm = warm_body(raw)
    assert warm is None or isinstance(json.loads(warm), dict)


def test_the_warm_up_carries_the_forwarded_headers_without_framing() -> None:
    # The exchange's head_tail: the client's lines as the server cleaned them, then the
    # proxy's own X-Forwarded-For and friends, then the blank line.
    tail = (b"Authorization: Bearer t\r\nContent-Length: 99\r\nX-Api-Key: k\r\n"
            b"Content-Type: text/plain\r\nAccept-Encoding: gzip\r\nX-Session-Id: s\xe9\r\n"
            b"X-Sluice-Warmup: 0\r\nX-Forwarded-For: 10.0.0.9, 127.0.0.1\r\n"
            b"X-Forwarded-Host: proxy\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert warm_headers(tail) == [
        ("Content-Type", "application/json"), ("X-Sluice-Warmup", "1"),
        ("Authorization", "Bearer t"), ("X-Api-Key", "k"), ("X-Session-Id", "s\xe9"),
        ("X-Forwarded-For", "10.0.0.9, 127.0.0.1"), ("X-Forwarded-Host", "proxy")]


def test_the_warm_up_goes_to_the_replicas_own_scheme_host_and_path() -> None:
    plain = Replica(ReadyReplica(id=1, url="http://10.0.0.7:8000"))
    assert warm_url(plain, "/v1/completions") == "http://10.0.0.7:8000/v1/completions"
    ingress = Replica(ReadyReplica(id=2, url="https://h.example/skypilot/ns/c/8000/"))
    assert warm_url(ingress, "/v1/chat/completions?a=1") == \
        "https://h.example/skypilot/ns/c/8000/v1/chat/completions?a=1"


# -- the policy -----------------------------------------------------------------------------

WARM = PrefixOptions(epsilon=0.5, placement="capacity")  # warm_copies: on by default


def saturated(options: PrefixOptions) -> tuple[ReadySet, bytes, Any, Any]:
    """4 replicas, a family placed and its home over the bound (in flight 6 of 6 over 4):
    (ready set, body, home, the family's entry)."""
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=options))
    body = bodies(1, seed=41)[0]
    home = ready.choose(None, Req(body))
    assert home is not None
    home.inflight = 6
    fam = ready.policy.placement.families[key(body)[0]]  # type: ignore[attr-defined]
    return ready, body, home, fam


def test_a_new_secondary_is_warmed_up_and_takes_no_cold_request() -> None:
    ready, body, home, fam = saturated(WARM)
    first = Req(body)
    assert ready.choose(None, first) is home  # where the prompt is
    assert not first.cold and first.warms is None
    spill, done = first.prewarm
    assert spill is not home and fam.secondary is spill and fam.warming is spill
    again = Req(body)
    assert ready.choose(None, again) is home and again.prewarm is None  # held meanwhile
    done(True)
    assert fam.warming is None
    warm = Req(body)
    assert ready.choose(None, warm) is spill and not warm.cold and warm.prewarm is None
    # Without the option the request that makes the copy computes the prompt there.
    ready, body, home, fam = saturated(PrefixOptions(epsilon=0.5, placement="capacity",
                                                     warm_copies=False))
    cold = Req(body)
    spill = ready.choose(None, cold)
    assert spill is not home and cold.cold and cold.warms is fam and cold.prewarm is None


def test_a_failed_warm_up_leaves_the_secondary_as_without_the_option() -> None:
    ready, body, _, fam = saturated(WARM)
    first = Req(body)
    ready.choose(None, first)
    spill, done = first.prewarm
    done(False)
    assert fam.warming is None and fam.secondary is spill
    assert ready.choose(None, Req(body)) is spill  # the next overflow: there, cold


def test_a_body_not_held_in_full_is_not_warmed() -> None:
    ready, body, home, _ = saturated(WARM)
    partial = Req(body)
    partial.body_done = False  # routed on its first bytes: nothing whole to warm with
    spill = ready.choose(None, partial)
    assert spill is not home and partial.cold and partial.prewarm is None


def test_a_third_copy_is_warmed_up_before_it_shares_the_load() -> None:
    options = PrefixOptions(placement="capacity", replica_families=13, warm_copies=True)
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=options))
    table = ready.policy.placement  # type: ignore[attr-defined]
    hot = bodies(1, seed=41)[0]
    top = ready.choose(None, Req(hot))
    table.refresh(table.now)
    top.inflight = 13
    made = Req(hot)
    assert ready.choose(None, made) is top  # the secondary is warmed first
    second, done = made.prewarm
    done(True)
    fam = table.families[key(hot)[0]]
    busy, idle = [r for r in ready.replicas if r not in (top, second)]
    top.inflight, second.inflight, busy.inflight, idle.inflight = 6, 6, 1, 0
    first = Req(hot)
    assert ready.choose(None, first) in (top, second) and not first.cold
    target, done = first.prewarm
    assert target is idle and fam.third is idle and fam.warming is idle
    # Not there while it warms; the primary and the secondary share the load meanwhile.
    second.inflight = 5
    assert ready.choose(None, Req(hot)) is second
    second.inflight, top.inflight = 7, 6
    assert ready.choose(None, Req(hot)) is top
    second.inflight = 6
    done(True)
    shared = Req(hot)
    assert ready.choose(None, shared) is idle and not shared.cold
    # A failed (or skipped) warm-up leaves the copy as without the option: cold, its next
    # request computes the prompt; it is not remade (and warmed) at every request.
    fam.third = None
    first = Req(hot)
    ready.choose(None, first)
    target, done = first.prewarm
    done(False)
    assert fam.third is target and fam.warming is None and fam.third_cold
    cold = Req(hot)
    assert ready.choose(None, cold) is target and cold.cold and cold.prewarm is None


# -- the Warmer, against a real scripted engine ------------------------------------------


async def engine_log(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/requests") as resp:
        log: list[dict[str, Any]] = await resp.json()
        return log


def replica(url: str) -> Replica:
    return Replica(ReadyReplica(id=1, url=url))


async def test_the_warmer_sends_counts_and_reports(cache_engines: CacheEngines) -> None:  # noqa: F811
    [engine] = await cache_engines.astart("vllm", ["a"])
    stats = Stats()
    # A short timeout for the engine that does not answer; a long one for those that do
    # (a busy machine must not turn an answer into a timeout).
    hung = Warmer(stats, max_running=1, timeout=1.0)
    warmer = Warmer(stats, max_running=1, timeout=30.0)
    target = replica(engine.url)
    outcomes: list[bool] = []
    chat_line, auth = b"POST /v1/chat/completions HTTP/1.1\r\n", b"Authorization: Bearer t\r\n\r\n"
    slow = json.dumps(chat(1, "q", stream=True, max_tokens=50, delay=30)).encode()
    body = json.dumps(chat(1, "q", stream=True, max_tokens=50)).encode()
    try:
        # An engine that does not answer within the timeout: counted on the replica as a
        # cold request in flight meanwhile, then failed; past max_running, skipped.
        assert hung.start(target, chat_line, auth, slow, outcomes.append)
        await until(lambda: target.inflight == 1 and target.prefilling == 1,
                    what="the warm-up in flight")
        assert target.prefill_bytes > 0  # its body's bytes
        assert not hung.start(target, chat_line, auth, body, outcomes.append)
        assert outcomes == [False]
        await until(lambda: len(outcomes) == 2, what="the warm-up's timeout")
        assert outcomes == [False, False] and target.inflight == 0 and target.prefilling == 0
        assert target.prefill_bytes == 0
        # Answered: reported True, one token asked, not streamed, the headers carried.
        assert warmer.start(target, chat_line, auth, body, outcomes.append)
        await until(lambda: len(outcomes) == 3, what="the warm-up's answer")
        assert outcomes[2] is True and target.inflight == 0
        seen = (await engine_log(engine.url))[-1]
        assert seen["max_tokens"] == 1 and seen["stream"] is False
        assert seen["warmup"] == "1" and seen["authorization"] == "Bearer t"
        # The engine answered from its cache afterwards: the prompt is there.
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{engine.url}/v1/chat/completions",
                              json=chat(1, "next")) as resp:
                usage = (await resp.json())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 64
        # Not a completion request, not JSON: skipped, nothing sent.
        assert not warmer.start(target, b"POST /v1/embeddings HTTP/1.1\r\n", auth, body,
                                outcomes.append)
        assert not warmer.start(target, chat_line, auth, b"{", outcomes.append)
        # A replica that refuses the connection: failed, reported once.
        dead = replica(f"http://{HOST}:{free_port()}")
        assert warmer.start(dead, chat_line, auth, body, outcomes.append)
        await until(lambda: len(outcomes) == 6, what="the failed warm-up")
        assert outcomes[3:] == [False, False, False] and dead.inflight == 0
        assert len(await engine_log(engine.url)) == 3  # the skipped ones never went out
        assert stats.warmups == {"sent": 3, "warmed": 1, "failed": 2, "skipped": 3}
    finally:
        await hung.aclose()
        await warmer.aclose()


async def test_a_hostile_replica_gets_no_more_than_one_request() -> None:
    # Replicas that answer 500, redirect elsewhere (with the client's Authorization in
    # the warm-up: a redirect must not carry it to another host) or send an endless body:
    # each warm-up fails or ends at its status, is counted, and the accounting returns.
    from aiohttp import web

    hits: dict[str, int] = {}
    elsewhere = free_port()

    async def error(request: web.Request) -> web.StreamResponse:
        hits["error"] = hits.get("error", 0) + 1
        return web.Response(status=500, text="boom")

    async def redirect(request: web.Request) -> web.StreamResponse:
        hits["redirect"] = hits.get("redirect", 0) + 1
        raise web.HTTPTemporaryRedirect(f"http://{HOST}:{elsewhere}/v1/chat/completions")

    async def endless(request: web.Request) -> web.StreamResponse:
        hits["endless"] = hits.get("endless", 0) + 1
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        for _ in range(100_000):  # stops when the warmer lets go of the connection
            await resp.write(b"x" * 65536)
        return resp

    async def catch(request: web.Request) -> web.StreamResponse:
        hits["elsewhere"] = hits.get("elsewhere", 0) + 1
        return web.Response(text="ok")

    runners = []
    urls = {}
    for name, handler, port in (("error", error, free_port()), ("redirect", redirect, free_port()),
                                ("endless", endless, free_port()), ("elsewhere", catch, elsewhere)):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, HOST, port).start()
        runners.append(runner)
        urls[name] = f"http://{HOST}:{port}"
    stats = Stats()
    warmer = Warmer(stats, timeout=30.0)  # nothing here hangs: only the status is awaited
    outcomes: dict[str, bool] = {}
    body = json.dumps(chat(1, "q", stream=True)).encode()
    targets = {name: replica(urls[name]) for name in ("error", "redirect", "endless")}
    try:
        for name, target in targets.items():
            warmer.start(target, b"POST /v1/chat/completions HTTP/1.1\r\n",
                         b"Authorization: Bearer t\r\n\r\n", body,
                         lambda ok, name=name: outcomes.__setitem__(name, ok))  # type: ignore[misc]
        await until(lambda: len(outcomes) == 3, what="every warm-up's outcome")
    finally:
        await warmer.aclose()
        for runner in runners:
            await runner.cleanup()
    assert outcomes == {"error": False, "redirect": False, "endless": True}
    assert hits == {"error": 1, "redirect": 1, "endless": 1}  # nothing reached elsewhere
    assert all(t.inflight == t.prefilling == t.prefill_bytes == 0 for t in targets.values())
    assert stats.warmups == {"sent": 3, "failed": 2, "warmed": 1}


async def test_closing_the_warmer_cancels_what_runs(cache_engines: CacheEngines) -> None:  # noqa: F811
    [engine] = await cache_engines.astart("vllm", ["a"])
    warmer = Warmer(Stats())
    target = replica(engine.url)
    outcomes: list[bool] = []
    body = json.dumps(chat(1, "q", delay=30)).encode()
    warmer.start(target, b"POST /v1/chat/completions HTTP/1.1\r\n", b"\r\n", body,
                 outcomes.append)
    await until(lambda: target.inflight == 1, what="the warm-up in flight")
    await asyncio.wait_for(warmer.aclose(), 5)
    assert outcomes == [False] and target.inflight == 0 and not warmer.running


# -- through a real proxy --------------------------------------------------------------------


@pytest.mark.parametrize("warm", [True, False], ids=["warm-copies", "off"])
async def test_a_hot_familys_second_replica_serves_no_cold_request(
    warm: bool, cache_engines: CacheEngines, proxy_factory: ProxyFactory,  # noqa: F811
) -> None:
    engines = await cache_engines.astart("vllm", ["a", "b"])
    by_id = {e.id: e for e in engines}
    args = [*BASE_ARGS, "--policy", "prefix", "--prefix-placement", "capacity",
            "--prefix-epsilon", "0.5", "--prefix-spill-margin", "1"]
    if not warm:  # on by default
        args.append("--no-prefix-warm-copies")
    proxy = await proxy_factory.astart(*args, replicas=[e.url for e in engines])
    url = f"{proxy.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        async def ask(body: dict[str, Any], **headers: str) -> tuple[str, int]:
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200
                doc = await resp.json()
                return (resp.headers["X-Replica-Id"],
                        doc["usage"]["prompt_tokens_details"]["cached_tokens"])

        home_id, _ = await ask(chat(7, "first"))
        home, other = by_id[home_id], next(e for e in engines if e.id != home_id)
        # Three requests held in flight at home: 3 of 2 replicas' mean 2 is its bound
        # (ceil(1.5 x 2) = 2 + 1 = 3), so the family's next request is overflow.
        held = [asyncio.create_task(ask(chat(7, f"slow {i}", delay=30))) for i in range(3)]
        try:
            await until(lambda: _count(engine_log(home.url), 4), what="3 held at home")
            # A client's own X-Real-IP is not forwarded (the proxy sets it), nor warmed.
            made, cached = await ask(chat(7, "makes the copy", max_tokens=50),
                                     Authorization="Bearer t", **{"X-Real-IP": "6.6.6.6"})
            if warm:
                # It waited where the prompt was; the other replica got the warm-up.
                assert (made, cached >= 64) == (home.id, True)
                log = await until(lambda: _warmed(other.url), what="the warm-up")
                assert log["max_tokens"] == 1 and log["authorization"] == "Bearer t"
                assert log["x_real_ip"] == "127.0.0.1"
                await until(lambda: _metric(proxy.admin_url, "warmed"), what="warmed")
                # The copy is warm: the overflow goes there, and hits.
                there, cached = await ask(chat(7, "overflow"))
                assert there == other.id and cached >= 64
            else:
                assert (made, cached) == (other.id, 0)  # computed the prompt cold there
                assert [r["warmup"] for r in await engine_log(other.url)] == [None]
            samples = await scrape(proxy.admin_url)
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    sent = metric(samples, "sluice_prefix_warmups_total", outcome="sent")
    assert sent == (1 if warm else 0)


async def _count(log: Any, n: int) -> bool:
    return len(await log) >= n


async def _warmed(url: str) -> dict[str, Any] | None:
    return next((r for r in await engine_log(url) if r["warmup"] == "1"), None)


async def _metric(admin_url: str, outcome: str) -> bool:
    return metric(await scrape(admin_url), "sluice_prefix_warmups_total", outcome=outcome) > 0


# -- replicas come and go under long streams and warm-ups --------------------------------------


async def test_long_streams_and_a_warm_up_in_flight_survive_its_replica_leaving(
    cache_engines: CacheEngines, proxy_factory: ProxyFactory,  # noqa: F811
    redis_url: str, redis_prefix: str,
) -> None:  # fmt: skip
    """Warm copies on (the default), a proxy on Redis, three engine processes. A hot
    family's streams of ~20 s make a copy, whose replica is taken out of the set while
    its warm-up is in flight. Every stream ends whole, later requests never go to the
    replica that left, the warm-up is counted as answered or failed, and every in-flight
    count comes back to 0."""
    engines = await cache_engines.astart("vllm", ["a", "b", "c"])
    by_id = {e.id: e for e in engines}
    async with Store.from_url(redis_url, prefix=redis_prefix) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")  # fmt: skip
        await store.commit("svc", replica_updates=[
            ReplicaRecord(id=n, status=ReplicaStatus.READY, url=e.url)
            for n, e in enumerate(engines, 1)])  # fmt: skip
        proxy = await proxy_factory.astart(
            *BASE_ARGS, "--redis", redis_url, "--redis-prefix", redis_prefix,
            "--service", "svc", "--policy", "prefix", "--prefix-epsilon", "0.5",
            "--prefix-spill-margin", "1",
            # Placed by capacity from the first request: `auto` turns that on at the shared
            # placement's first tick, which on a loaded machine came after these requests.
            "--prefix-placement", "capacity", wait="ready")  # fmt: skip
        url = f"{proxy.url}/v1/chat/completions"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

            async def stream(question: str, **extra: Any) -> tuple[int, str, str]:
                body = chat(7, question, stream=True, **extra)
                async with http.post(url, json=body) as resp:
                    return resp.status, resp.headers.get("X-Replica-Id", ""), await resp.text()

            # 20 pieces 1 s apart: each stream lasts ~20 s. The warm-ups carry the body's
            # `delay`: 2 s in flight each.
            long = [asyncio.create_task(stream(f"long {i}", pieces=20, pace=1.0, delay=2))
                    for i in range(4)]  # fmt: skip
            try:
                async def warmed_one() -> CacheEngine | None:
                    for engine in engines:
                        if await _warmed(engine.url):
                            return engine
                    return None

                gone = await until(warmed_one, timeout=30, what="a warm-up sent")
                # Out of the set while its warm-up runs (and perhaps a stream on it).
                n = next(i for i, e in enumerate(engines, 1) if e is gone)
                await store.commit("svc", replica_updates=[
                    ReplicaRecord(id=n, status=ReplicaStatus.SHUTTING_DOWN, url=gone.url)])
                await until(lambda: _ready(proxy.admin_url, 2), what="the proxy to drop it")
                later = [await stream(f"later {i}") for i in range(6)]
                assert all(status == 200 for status, _, _ in later), later
                assert gone.id not in {rid for _, rid, _ in later}
                done = await asyncio.gather(*long)
            finally:
                for task in long:
                    task.cancel()
                await asyncio.gather(*long, return_exceptions=True)
    for status, rid, text in done:
        assert status == 200 and rid in by_id
        assert text.count('"content"') == 22 and text.rstrip().endswith("data: [DONE]")
    samples = await until(lambda: _settled(proxy.admin_url), timeout=30,
                          what="every warm-up ended and every count back to 0")
    assert metric(samples, "sluice_prefix_warmups_total", outcome="sent") >= 1


async def _ready(admin_url: str, n: int) -> bool:
    return metric(await scrape(admin_url), "sluice_ready_replicas") == n


async def _settled(admin_url: str) -> Any:
    samples = await scrape(admin_url)
    sent = metric(samples, "sluice_prefix_warmups_total", outcome="sent")
    ended = sum(metric(samples, "sluice_prefix_warmups_total", outcome=o)
                for o in ("warmed", "failed"))
    inflight = [s for s in samples if s[0] == "sluice_replica_inflight"]
    return samples if sent == ended and all(s[2] == 0 for s in inflight) else None
