"""Routing you can check (proxy/outcomes.py): the scanner that finds an engine's report of
cached prompt tokens in response bytes, on hostile input; and, through a real sluice-proxy
to real scripted-engine processes (tests/support/cache_engine.py: llama.cpp's and vLLM's
wire format), the predicted-against-engine confusion and the families on /metrics."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.outcomes import (
    MAX_DIGITS,
    MAX_MARKERS,
    NO_REPORT,
    SCAN_TAIL,
    cached_tokens,
    new_outcomes,
    record,
)
from proxy.readyset import ReadySet
from proxy.wire.snapshot import ReadyReplica, ReadySnapshot
from tests.proxy.test_prefix import cold_options
from tests.support.harness import BASE_ARGS, metric, scrape
from tests.support.ports import free_port
from tests.support.processes import HOST, Process, ProxyFactory, _Factory

LLAMA = (b'{"choices":[{"message":{"content":"hi"}}],"timings":{"cache_n":236,'
         b'"prompt_n":12,"prompt_ms":3.1}}')
VLLM = (b'{"usage":{"prompt_tokens":300,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":288}}}')
PRETTY = (b'{\n  "usage": {\n    "prompt_tokens_details": {\n      "cached_tokens" :  64\n'
          b'    }\n  }\n}')


def scan(*chunks: bytes) -> int:
    found = NO_REPORT
    for chunk in chunks:
        found = cached_tokens(chunk, found)
    return found


# -- the scanner --------------------------------------------------------------------------


def test_reports_in_each_engines_format_are_found() -> None:
    assert scan(LLAMA) == 236
    assert scan(VLLM) == 288
    assert scan(PRETTY) == 64  # OpenAI's pretty-printed JSON
    assert scan(b'{"timings":{"cache_n":0}}') == 0  # a report of no hit is a report
    sse = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
           b'data: {"choices":[],"timings":{"cache_n":17,"prompt_n":3}}\n\ndata: [DONE]\n\n')
    assert scan(sse) == 17


@pytest.mark.parametrize("body", [
    b'{"content":"\\"cache_n\\":5, {\\"cached_tokens\\":6}"}',  # inside a string: escaped
    b'{"generation_settings":{"cache_prompt":true,"cache_tokens":5}}',  # other keys
    b'{"timings":{"cache_n":null}}',
    b'{"timings":{"cache_n":-4}}',
    b'{"timings":{"cache_n":4.5}}',
    b'{"timings":{"cache_n":"12"}}',
    b'["cache_n",12]',  # a value, not a key
    b'{"a":"cache_n":1}',
    b'"cache_n":12}',  # the marker opens the chunk: what precedes it is unknown
    b'{"timings":{"cache_n":' + b"9" * (MAX_DIGITS + 1) + b"}}",  # too long a number
    b'{"timings":{"cache_n":12',  # the number may go on in the next chunk
    b'{"timings":{"cache_n"',
    b'{"timings":{"cache_n":' + b" " * 100 + b"5}}",  # more whitespace than looked at
    b"",
])
def test_what_is_not_a_report(body: bytes) -> None:
    assert scan(body) == NO_REPORT


def test_twelve_digits_are_a_report_and_the_last_report_wins() -> None:
    assert scan(b'{"cache_n":' + b"9" * MAX_DIGITS + b"}") == 10**MAX_DIGITS - 1
    assert scan(b'{"cached_tokens":3},{"cached_tokens":5}') == 5
    assert scan(b'{"cached_tokens":3}', b"no report here", b'{"cache_n":7}') == 7


def test_at_most_max_markers_are_looked_at_per_chunk() -> None:
    decoys = b'{"cache_prompt":1,' * MAX_MARKERS
    assert scan(decoys + b'"cache_n":5}') == NO_REPORT  # the 9th marker of the chunk
    assert scan(decoys, b'{"cache_n":5}') == 5  # the next chunk starts afresh


def test_only_a_chunks_tail_is_looked_at() -> None:
    report = b',"timings":{"cache_n":42}}'
    pad = b'{"content":"' + b"a" * 100_000 + b'"'
    assert scan(pad + report) == 42  # at the end of a large chunk
    head = b'{"t":{"cache_n":42}'  # the marker starts at byte 6
    after = b',"more":"' + b"b" * (SCAN_TAIL + 6 - len(head) - 11) + b'"}'
    assert len(head + after) == SCAN_TAIL + 6
    assert scan(head + after) == 42  # the tail starts at the marker
    assert scan(head + after + b" ") == NO_REPORT  # one byte more: the marker is before it


def test_a_report_split_across_chunks_is_missed_never_misread() -> None:
    for cut in range(1, len(LLAMA)):
        assert scan(LLAMA[:cut], LLAMA[cut:]) in (236, NO_REPORT), cut


def test_record_counts_an_engine_hit_from_one_blocks_worth_of_tokens() -> None:
    hit, _ = new_outcomes(64)
    for cached in (0, 63, 64, 1000):
        record(hit, cached)
    assert hit == [2, 2, 1127, 64]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b'"cache', b'"cache_n"', b'"cached_tokens"', b":", b",", b"{", b"\\",
                     b'"', b" ", b"\n", b"0", b"12", b"9" * 40, b'_n":', b'd_tokens": '])),
    max_size=60), st.integers(0, 8))
def test_garbage_never_crashes_and_yields_a_bounded_number(parts: list[bytes],
                                                           cuts: int) -> None:
    data = b"".join(parts)
    rng = random.Random(len(data) * 31 + cuts)
    points = sorted(rng.randrange(len(data) + 1) for _ in range(cuts))
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    found = scan(*chunks)
    assert found == NO_REPORT or 0 <= found < 10**MAX_DIGITS


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-10**15, 10**15),
    st.text(alphabet=st.sampled_from('"\\:,{}[] cache_ndtoks0123456789'), max_size=40),
    st.sampled_from(['"cache_n":5', '{"cached_tokens":9}', 'cache_n', '\\"cache_n\\":3']))
_keys = st.sampled_from(["a", "cache", "cache_prompt", "cache_tokens", "content",
                         'x"cache_n"', "usage"])
_json = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json, st.integers(0, 10**9), st.booleans(), st.integers(0, 10**6),
       st.booleans())  # fmt: skip
def test_in_valid_json_only_the_real_report_is_read_wherever_the_chunks_break(
    noise: Any, cached: int, llama: bool, seed: int, pretty: bool,
) -> None:
    report = {"timings": {"cache_n": cached}} if llama else {
        "usage": {"prompt_tokens_details": {"cached_tokens": cached}}}
    doc = {"choices": [{"message": {"content": noise}}], "noise": noise, **report}
    body = json.dumps(doc, indent=2 if pretty else None).encode()
    if body.count(b'"cache') <= MAX_MARKERS:
        assert scan(body) == cached  # markers inside strings are never read
    else:  # past MAX_MARKERS the real one may be missed, still never misread
        assert scan(body) in (cached, NO_REPORT)
    rng = random.Random(seed)
    points = sorted(rng.randrange(1, len(body)) for _ in range(rng.randrange(1, 5)))
    chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    assert scan(*chunks) in (cached, NO_REPORT)  # split: maybe missed, never misread


def test_a_huge_hostile_body_is_scanned_to_the_end() -> None:
    # Millions of markers and a million-digit number: bounded work, no report.
    body = b'{"cache_n":' * 200_000 + b"{" + b'"cache_n":' + b"7" * 1_000_000 + b"}"
    assert scan(body) == NO_REPORT
    assert len(body) > MAX_MARKERS


# -- the policy's predictions -------------------------------------------------------------


class Req:
    """What the policy reads and writes of a request (the Exchange has the same fields)."""

    def __init__(self, body: bytes) -> None:
        self.body = [body]
        self.req_headers: list[tuple[bytes, bytes]] = []
        self.route_key: tuple[int, ...] | None = None
        self.outcome: list[int] | None = None
        self.cold = False
        self.warms: object = None


def ready_set(policy: str, placement: str = "rendezvous", n: int = 3,
              clock: Any = None) -> ReadySet:
    rs = ReadySet(clock=clock) if clock is not None else ReadySet()
    publish(rs, policy, placement, n)
    return rs


def publish(rs: ReadySet, policy: str, placement: str, n: int, generation: int = 1) -> None:
    replicas = [ReadyReplica(id=i, url=f"http://10.0.0.{i}:8000", version=1)
                for i in range(1, n + 1)]  # fmt: skip
    rs.apply(ReadySnapshot(service="s", generation=generation, published_at=0.0,
                           status="READY", policy=policy, active_versions=[1],
                           replicas=replicas,
                           prefix_options=cold_options(placement=placement)))  # fmt: skip


def predicted(rs: ReadySet, body: bytes) -> str:
    req = Req(body)
    chosen = rs.choose(None, req)
    assert chosen is not None and req.outcome is not None
    hit, miss = rs.policy.outcomes[chosen.url]  # type: ignore[attr-defined]
    assert req.outcome is hit or req.outcome is miss
    return "hit" if req.outcome is hit else "miss"


def raw(seed: int, question: str) -> bytes:
    return json.dumps(chat(seed, question)).encode()


@pytest.mark.parametrize("placement", ["rendezvous", "capacity"])
def test_a_request_is_a_predicted_hit_only_once_its_prefix_is_known(placement: str) -> None:
    rs = ready_set("prefix", placement)
    assert predicted(rs, raw(1, "first")) == "miss"
    assert predicted(rs, raw(1, "second")) == "hit"  # the LRU (and the family) know it
    assert predicted(rs, raw(2, "first")) == "miss"
    assert predicted(rs, b'{"messages":[]}') == "miss"  # no key: the fallback


def test_a_placed_family_is_a_predicted_hit_even_without_the_lru() -> None:
    rs = ready_set("prefix", "capacity")
    session = [(b"x-session-id", b"abc")]
    first, again = Req(b"{}"), Req(b"{}")
    first.req_headers = again.req_headers = session  # a session: a one-hash key, no LRU
    a = rs.choose(None, first)
    b = rs.choose(None, again)
    assert a is b and a is not None
    hit, miss = rs.policy.outcomes[a.url]  # type: ignore[attr-defined]
    assert first.outcome is miss and again.outcome is hit


def test_other_policies_leave_the_response_unscanned() -> None:
    rs = ready_set("least_load")
    req = Req(raw(1, "first"))
    assert rs.choose(None, req) is not None
    assert req.outcome is None


def test_outcome_series_go_with_their_replica() -> None:
    now = [0.0]
    rs = ready_set("prefix", n=3, clock=lambda: now[0])
    outcomes = rs.policy.outcomes  # type: ignore[attr-defined]
    assert len(outcomes) == 3
    publish(rs, "prefix", "rendezvous", 2, generation=2)
    now[0] = 1000.0
    rs.sweep()
    assert sorted(outcomes) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


# -- through a real proxy to scripted-engine processes ------------------------------------


class CacheEngine(Process):
    """One tests/support/cache_engine.py process (a scripted engine's wire format)."""

    def __init__(self, fmt: str, replica_id: str, port: int, log_dir: Path) -> None:
        self.port, self.id = port, replica_id
        self.url = f"http://{HOST}:{port}"
        argv = [sys.executable, "-m", "tests.support.cache_engine", "--port", str(port),
                "--format", fmt, "--id", replica_id]  # fmt: skip
        super().__init__(argv, log_dir / f"cache-engine-{port}.log", None)


class CacheEngines(_Factory):
    async def astart(self, fmt: str, ids: list[str]) -> list[CacheEngine]:
        engines = [CacheEngine(fmt, i, free_port(), self.log_dir) for i in ids]
        self.started += engines
        await self._wait_async([(e, e.port, "/health", True) for e in engines], 15.0,
                               "cache engine")  # fmt: skip
        return engines


@pytest.fixture
def cache_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheEngines]:
    factory = CacheEngines(tmp_path_factory.mktemp("cache-engines"))
    try:
        yield factory
    finally:
        factory.close(timeout=5.0)


def family(seed: int) -> str:
    """A ~600-byte system prompt (more than two 256-byte blocks), unlike the others'."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(600))


def chat(seed: int, question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": family(seed)},
                                       {"role": "user", "content": question}], **extra}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, int]:
    """(the replica that answered, the cached tokens its engine reported; -1: none)."""
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
        replica = resp.headers["X-Replica-Id"]
    if not body.get("stream"):
        return replica, _reported(json.loads(raw))
    last = [json.loads(line[6:]) for line in raw.split(b"\n\n")
            if line.startswith(b"data: {")][-1]
    return replica, _reported(last)


def _reported(doc: dict[str, Any]) -> int:
    if "timings" in doc:
        return int(doc["timings"]["cache_n"])
    details = (doc.get("usage") or {}).get("prompt_tokens_details")
    return int(details["cached_tokens"]) if details else -1


def cells(samples: list[tuple[str, dict[str, str], float]],
          urls: list[str]) -> dict[tuple[str, str], float]:
    return {(p, e): sum(metric(samples, "sluice_prefix_outcomes_total", replica=u,
                               predicted=p, engine=e) for u in urls)
            for p in ("hit", "miss") for e in ("hit", "miss")}  # fmt: skip


def total(samples: list[tuple[str, dict[str, str], float]], name: str,
          urls: list[str]) -> float:
    return sum(metric(samples, name, replica=u) for u in urls)


async def test_all_four_cells_on_a_llama_format_engine(
    cache_engines: CacheEngines, proxy_factory: ProxyFactory,
) -> None:
    [engine] = await cache_engines.astart("llama", ["a"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix", replicas=[engine.url])
    reported = []
    async with aiohttp.ClientSession() as http:
        await post(http, engine.url, chat(1, "warm-up, sent around the proxy"))
        # The proxy never routed family 1, but the engine has it: predicted miss, engine hit.
        reported.append(await post(http, proxy.url, chat(1, "first")))
        reported.append(await post(http, proxy.url, chat(1, "second")))  # hit, hit
        reported.append(await post(http, proxy.url, chat(2, "first")))  # miss, miss
        reported.append(await post(http, proxy.url, chat(1, "third", stream=True)))  # hit, hit
        async with http.post(f"{engine.url}/flush") as resp:  # the engine lost its cache
            assert resp.status == 200
        reported.append(await post(http, proxy.url, chat(2, "second")))  # hit, miss
        # No report (no key, no timings): counted nowhere.
        async with http.get(f"{proxy.url}/health") as resp:
            assert resp.status == 200
        samples = await scrape(proxy.admin_url)

    tokens = [n for _, n in reported]
    assert tokens[0] >= 64 and tokens[1] >= 64 and tokens[2] < 64, tokens
    assert tokens[3] >= 64, tokens  # the report came in the stream's last event
    assert tokens[4] < 64, tokens
    assert cells(samples, [engine.url]) == {
        ("miss", "hit"): 1, ("hit", "hit"): 2, ("miss", "miss"): 1, ("hit", "miss"): 1}
    assert total(samples, "sluice_prefix_engine_cached_tokens_total", [engine.url]) == sum(tokens)
    assert total(samples, "sluice_prefix_engine_reports_total", [engine.url]) == 5
    # Without placement (no Redis: rendezvous) there is no family table to show.
    assert not [s for s in samples if s[0] == "sluice_prefix_families"]
    assert metric(samples, "sluice_prefix_spill_margin") == 8  # alone: the whole margin


async def test_vllm_format_with_placement_counts_families_and_usage_reports(
    cache_engines: CacheEngines, proxy_factory: ProxyFactory,
) -> None:
    engines = await cache_engines.astart("vllm", ["a", "b"])
    urls = [e.url for e in engines]
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix",
                                       "--prefix-placement", "capacity",
                                       "--prefix-spill-margin", "0", replicas=urls)
    seeds = range(4)
    where: dict[int, set[str]] = {s: set() for s in seeds}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as http:
        for seed in seeds:
            replica, cached = await post(http, proxy.url, chat(seed, "first"))
            where[seed].add(replica)
            assert cached < 64
        for seed in seeds:
            replica, cached = await post(http, proxy.url, chat(seed, "second", **usage))
            where[seed].add(replica)
            assert cached >= 64
        for seed in seeds:  # streamed without include_usage: vLLM reports nothing
            replica, cached = await post(http, proxy.url, chat(seed, "third", stream=True))
            where[seed].add(replica)
            assert cached == -1
        samples = await scrape(proxy.admin_url)

    assert all(len(w) == 1 for w in where.values()), where
    assert cells(samples, urls) == {
        ("miss", "miss"): 4, ("hit", "hit"): 4, ("miss", "hit"): 0, ("hit", "miss"): 0}
    assert total(samples, "sluice_prefix_engine_reports_total", urls) == 8
    assert total(samples, "sluice_prefix_families", urls) == 4
    by_replica = {e.id: metric(samples, "sluice_prefix_families", replica=e.url)
                  for e in engines}
    placed = {next(iter(w)) for w in where.values()}
    assert {r for r, n in by_replica.items() if n} == placed
    assert total(samples, "sluice_prefix_family_capacity", urls) == 8  # default 4 each
    # No engine view (no Redis): per-slot rules, so this proxy counts its traffic: 12
    # requests, halved every 30 s; no other proxy.
    routed = [s for s in samples if s[0] == "sluice_prefix_recent_traffic"]
    mine = sum(v for _, labels, v in routed if labels["proxies"] == "this")
    assert 10.0 < mine <= 12.0, routed
    assert sum(v for _, labels, v in routed if labels["proxies"] == "others") == 0
    busy = {labels["replica"] for _, labels, v in routed if v}
    assert {e.id for e in engines if e.url in busy} == placed
    assert metric(samples, "sluice_prefix_spill_margin") == 0  # --prefix-spill-margin 0


async def test_a_hostile_report_is_relayed_intact_and_never_misread(
    cache_engines: CacheEngines, proxy_factory: ProxyFactory,
) -> None:
    [engine] = await cache_engines.astart("llama", ["a"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix", replicas=[engine.url])
    body = chat(3, "hostile", hostile=True)
    async with aiohttp.ClientSession() as http:
        raw = []
        for url in (engine.url, proxy.url):
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                raw.append(await resp.read())
        real = json.loads(raw[1].rsplit(b"\n", 1)[1])["timings"]["cache_n"]
        assert real >= 64  # the direct request cached the prompt
        _, after = await post(http, proxy.url, chat(3, "calm"))  # still serving
        samples = await scrape(proxy.admin_url)
    assert raw[0].split(b"answer from")[0] == raw[1].split(b"answer from")[0]
    assert len(raw[1]) > 1_000_000
    reports = total(samples, "sluice_prefix_engine_reports_total", [engine.url])
    tokens = total(samples, "sluice_prefix_engine_cached_tokens_total", [engine.url])
    # The hostile response counted with its real report or not at all; never a decoy.
    assert (reports, tokens) in ((1, after), (2, real + after)), (reports, tokens, real)


async def test_streams_watched_for_resumption_are_scanned_too(
    cache_engines: CacheEngines, proxy_factory: ProxyFactory,
) -> None:
    [engine] = await cache_engines.astart("llama", ["a"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix", "--resume-streams",
                                       replicas=[engine.url])
    async with aiohttp.ClientSession() as http:
        first = await post(http, proxy.url, chat(4, "first", stream=True))
        again = await post(http, proxy.url, chat(4, "second", stream=True))
        samples = await scrape(proxy.admin_url)
    assert first[1] < 64 <= again[1]
    assert cells(samples, [engine.url]) == {
        ("miss", "miss"): 1, ("hit", "hit"): 1, ("miss", "hit"): 0, ("hit", "miss"): 0}
