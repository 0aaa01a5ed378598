"""The `prefix` policy (proxy/prefix.py): key extraction, rendezvous agreement, bounded
load, minimal movement on set changes, the longest-prefix memory, and the whole path
through a real proxy process (the body is read before routing, metrics say why)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import subprocess
import sys
from typing import Any

import aiohttp
import msgspec
import pytest

from proxy.prefix import AFFINITY, FALLBACK, SPILL, json_string_after, prefix_chain, request_key
from proxy.readyset import ReadySet
from proxy.wire.snapshot import PrefixOptions, ReadySnapshot
from tests.support import builders
from tests.support.harness import BASE_ARGS, metric, replica_stats, scrape
from tests.support.processes import ProxyFactory, ReplicaFactory
from tests.support.rawhttp import connect


def cold_options(**fields: Any) -> PrefixOptions:
    """Options without warm-ups (`warm_copies`, on by default): these tests are about
    where requests go, a new copy of a family taking its first request cold (as with a
    body still arriving); tests/proxy/test_warmup.py has the warm-ups."""
    return PrefixOptions(warm_copies=False, **fields)


OPTS = cold_options()
BLOCK = OPTS.block_bytes


class Req:
    """What the policy reads of a request (the server's Exchange has the same fields)."""

    def __init__(self, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.body = [body]
        self.req_headers = headers or []
        self.route_key: tuple[int, ...] | None = None
        self.outcome: list[int] | None = None
        self.cold = False
        self.warms: object = None
        self.body_done = True
        self.prewarm: Any = None


def chat(system: str, *turns: str, model: str = "m", first: bool = True) -> bytes:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    fields = {"model": model, "messages": messages, "stream": True}
    if not first:  # the same body with "messages" last
        fields = {"stream": True, "model": model, "messages": messages}
    return json.dumps(fields).encode()


def key(body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
        options: PrefixOptions = OPTS) -> tuple[int, ...]:
    return request_key(headers or [], body, options,
                       options.session_header.lower().encode())


LONG = "You are a careful assistant for the ACME corporation. " * 20  # ~1,100 bytes


# -- key extraction ------------------------------------------------------------------


def test_chat_key_is_the_block_chain_from_messages_on() -> None:
    body = chat(LONG, "What is the refund policy? " * 20)
    chain = key(body)
    start = body.index(b'"messages"')
    assert len(chain) == (len(body) - start) // BLOCK  # complete blocks only
    # Same system prompt, another question: the blocks covering the shared part agree.
    other = key(chat(LONG, "How do I reset my password? " * 20))
    shared = (len(b'"messages": [{"role": "system", "content": "') + len(LONG)) // BLOCK
    assert chain[:shared] == other[:shared]
    assert chain[-1] != other[-1]
    # Another system prompt: no block in common.
    assert not set(chain) & set(key(chat(LONG.replace("ACME", "Zenith"), "What?")))


def test_completion_key_starts_at_prompt() -> None:
    text = "Translate to French: " + "the quick brown fox jumps over the lazy dog " * 30
    body = json.dumps({"model": "m", "prompt": text, "max_tokens": 8}).encode()
    chain = key(body)
    start = body.index(b'"prompt"')
    assert len(chain) == (len(body) - start) // BLOCK
    other = key(json.dumps({"prompt": text, "max_tokens": 99}).encode())
    assert other[:-1] == chain[:-1]  # the last block holds the fields after the prompt


def test_key_does_not_depend_on_the_order_of_other_fields() -> None:
    a = key(chat(LONG, "Question one?", first=True))
    b = key(chat(LONG, "Question one?", first=False))
    # Fields before "messages" are not part of the key; fields after it touch the last block.
    assert a[:-1] == b[:-1] and len(a) >= 4


def test_escaped_key_names_inside_strings_are_not_the_key() -> None:
    decoy = json.dumps({"note": 'the word "messages" and "prompt" inside a string',
                        "messages": [{"role": "system", "content": LONG}]}).encode()
    assert b'\\"messages\\"' in decoy
    plain = json.dumps({"messages": [{"role": "system", "content": LONG}]}).encode()
    assert key(decoy) == key(plain)


def test_bodies_shorter_than_one_block_have_no_key() -> None:
    short = chat("Be brief.", "Hi")
    assert len(short) < BLOCK
    assert key(short) == ()
    # Exactly one block from "messages" on: one hash.
    body = b'{"messages":' + b"x" * (BLOCK - len(b'"messages":')) + b"}"
    assert len(key(body)) == 1


@pytest.mark.parametrize("body", [b"", b"hello world" * 100, bytes(range(256)) * 8,
                                  b"<xml><messages>" + b"y" * 2000 + b"</messages></xml>",
                                  b'{"input": "' + b"z" * 2000 + b'"}'])
def test_bodies_without_a_prompt_have_no_key(body: bytes) -> None:
    assert key(body) == ()


def test_only_the_first_prefix_bytes_are_read() -> None:
    options = cold_options(prefix_bytes=1024)
    late = json.dumps({"tools": "t" * 2000, "messages": [{"content": LONG}]}).encode()
    assert key(late, options=options) == ()
    early = chat(LONG * 4, "q")
    assert len(key(early, options=options)) == (1024 - early.index(b'"messages"')) // BLOCK


def test_session_header_and_user_field_keys() -> None:
    body = chat(LONG, "q")
    by_header = key(body, [(b"X-Session-ID", b"abc")])
    assert by_header == key(chat("other", "other"), [(b"x-session-id", b"abc")])
    assert len(by_header) == 1 and by_header != key(body, [(b"X-Session-Id", b"abd")])
    assert key(body, [(b"X-Session-Id", b"")]) == key(body)  # empty: no session
    with_user = cold_options(user_field=True)
    body_u = json.dumps({"user": "u-1", "messages": [{"role": "user", "content": LONG}]})
    assert key(body_u.encode(), options=with_user) == key(b'{"user":"u-1"}', options=with_user)
    # "role": "user" is a value, not the field: the prompt chain is the key then.
    no_user = json.dumps({"messages": [{"role": "user", "content": LONG}]}).encode()
    assert key(no_user, options=with_user) == key(no_user)


def test_json_string_after_handles_escapes() -> None:
    assert json_string_after(b'{"user" : "a\\"b", "x": 1}', b'"user"', 100) == b'a\\"b'
    assert json_string_after(b'{"user":"a\\\\","x":"y"}', b'"user"', 100) == b"a\\\\"
    assert json_string_after(b'{"role":"user","user":"me"}', b'"user"', 100) == b"me"
    assert json_string_after(b'{"user": 42}', b'"user"', 100) is None
    assert json_string_after(b'{"user": "unterminated', b'"user"', 100) is None
    assert json_string_after(b'{"role": "user"}', b'"user"', 100) is None


def test_prefix_chain_is_a_chain() -> None:
    body = b'"prompt"' + bytes(range(256)) * 4
    chain = prefix_chain(body, 64, len(body))
    # Changing one byte in block 3 changes hashes 3.. and leaves 0..2 alone.
    changed = bytearray(body)
    changed[3 * 64 + 10] ^= 1
    other = prefix_chain(bytes(changed), 64, len(body))
    assert chain[:3] == other[:3]
    assert all(x != y for x, y in zip(chain[3:], other[3:], strict=True))


# -- choosing -------------------------------------------------------------------------


def snapshot(gen: int, *urls: str, options: PrefixOptions | None = None) -> ReadySnapshot:
    """A snapshot of the prefix policy (its options: `options`)."""
    return builders.snapshot(gen, *urls, policy="prefix", prefix_options=options)


URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
RDV = cold_options(placement="rendezvous")  # the hash alone: what these tests are about


def bodies(n: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    return [chat(f"System prompt {rng.getrandbits(64):x}. " + LONG, "q") for _ in range(n)]


def choices(ready: ReadySet, payloads: list[bytes]) -> list[str]:
    out = []
    for body in payloads:
        chosen = ready.choose(None, Req(body))
        assert chosen is not None
        out.append(chosen.url)
    return out


def test_two_ready_sets_agree_whatever_the_replica_order() -> None:
    one, two = ReadySet(), ReadySet()
    one.apply(snapshot(1, *URLS[:4]))
    two.apply(snapshot(9, *reversed(URLS[:4])))  # another generation, another order
    payloads = bodies(2000)
    a, b = choices(one, payloads), choices(two, payloads)
    assert a == b
    spread = collections.Counter(a)
    assert set(spread) == set(URLS[:4])
    assert max(spread.values()) / min(spread.values()) < 1.25  # evenly spread


_CHILD = """
import json, sys
from proxy.readyset import ReadySet
from tests.proxy.test_prefix import Req, URLS, bodies, choices, snapshot
ready = ReadySet()
ready.apply(snapshot(1, *URLS[:4]))
json.dump(choices(ready, bodies(500)), sys.stdout)
"""


def test_two_processes_agree() -> None:
    """Another interpreter with another hash seed picks the same replicas."""
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4]))
    mine = choices(ready, bodies(500))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, check=True,
                         env=env, timeout=60, cwd=os.getcwd())
    assert json.loads(out.stdout) == mine


def test_set_changes_move_only_the_affected_keys() -> None:
    """The rendezvous choice (the LRU off: it would keep every key it saw in place)."""
    ready = ReadySet()
    payloads = bodies(4000, seed=3)
    no_lru = cold_options(lru_size=0, placement="rendezvous")
    ready.apply(snapshot(1, *URLS[:4], options=no_lru))
    before = choices(ready, payloads)
    ready.apply(snapshot(2, *URLS[:5], options=no_lru))  # one replica joins
    after = choices(ready, payloads)
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert all(b == URLS[4] for _, b in moved)  # only to the newcomer
    fraction = len(moved) / len(payloads)
    assert 0.15 < fraction < 0.25, fraction  # ~1/5, the newcomer's share
    ready.apply(snapshot(3, *(URLS[:1] + URLS[2:5]), options=no_lru))  # URLS[1] leaves
    left = choices(ready, payloads)
    for old, new in zip(after, left, strict=True):
        if old != URLS[1]:
            assert new == old  # nobody else's keys moved
    assert sum(o != n for o, n in zip(after, left, strict=True)) == after.count(URLS[1])


def test_with_the_lru_a_joining_replica_takes_only_new_prefixes() -> None:
    ready = ReadySet()
    seen, fresh = bodies(1000, seed=3), bodies(1000, seed=4)
    ready.apply(snapshot(1, *URLS[:4], options=RDV))
    before = choices(ready, seen)
    ready.apply(snapshot(2, *URLS[:5], options=RDV))
    assert choices(ready, seen) == before  # cached where they are: nothing moves
    share = choices(ready, fresh).count(URLS[4]) / len(fresh)
    assert 0.15 < share < 0.25, share


def test_bounded_load_spills_to_the_next_in_rendezvous_order() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(epsilon=0.5, placement="rendezvous")))
    body = bodies(1)[0]
    first = ready.choose(None, Req(body))
    assert first is not None
    # Rank of the replicas for this key: exclude them one by one.
    order = [first]
    while len(order) < 4:
        nxt = ready.choose(set(order), Req(body))
        assert nxt is not None
        order.append(nxt)
    # Mean in flight 2 over 4 replicas, epsilon 0.5: capacity ceil(1.5 * 9 / 4) = 4.
    first.inflight = 4
    order[1].inflight = 4
    second = ready.choose(None, Req(body))
    assert second is order[2]
    first.inflight = 2  # total 6: capacity ceil(1.5 * 7 / 4) = 3, back to the first choice
    assert ready.choose(None, Req(body)) is first
    counts = ready.policy.routed  # type: ignore[attr-defined]
    assert counts[first.url][AFFINITY] >= 2 and counts[order[2].url][SPILL] == 1


def rank(ready: ReadySet, body: bytes) -> list[object]:
    """The rendezvous order for `body` (no LRU, idle replicas)."""
    fresh = ReadySet()
    assert ready.snapshot is not None
    options = cold_options(lru_size=0, placement="rendezvous")
    fresh.apply(msgspec.structs.replace(ready.snapshot, prefix_options=options))
    order: list[object] = []
    while len(order) < len(ready.replicas):
        nxt = fresh.choose({r for r in fresh.replicas if r.url in order}, Req(body))
        assert nxt is not None
        order.append(nxt.url)
    return order


def test_a_prefix_never_seen_goes_no_higher_than_the_mean_and_is_then_known() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=RDV))
    body = bodies(1, seed=11)[0]
    order = rank(ready, body)
    by_url = {r.url: r for r in ready.replicas}
    top = by_url[order[0]]  # type: ignore[index]
    for r in ready.replicas:
        r.inflight = 1
    top.inflight = 2  # total 5, mean 1.25: top is above it
    chosen = ready.choose(None, Req(body))
    assert chosen is not None and chosen.url == order[1]  # the first at or below the mean
    assert ready.policy.routed[chosen.url][SPILL] == 1  # type: ignore[attr-defined]
    # Now known, at its first choice (where every other proxy has it): the family's
    # next request (another question) may load the top up to (1 + epsilon) x the mean,
    # ceil(2 x 6 / 4) = 3, instead of being walked to the mean again.
    sibling = body.replace(b'"q"', b'"another question"')
    assert ready.choose(None, Req(sibling)) is top
    assert ready.choose(None, Req(body)) is top
    # An unseen prefix with the same first choice does not get it (above the mean).
    unseen = next(b for b in bodies(40, seed=12) if rank(ready, b)[0] == top.url)
    assert ready.choose(None, Req(unseen)) is not top


def test_no_key_uses_the_fallback_least_load() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:3]))
    busy = ready.replicas
    busy[0].inflight, busy[1].inflight, busy[2].inflight = 5, 0, 5
    chosen = ready.choose(None, Req(b"not json"))
    assert chosen is busy[1]
    assert ready.choose(None, None) is busy[1]  # no request at all (a retry path)
    assert ready.policy.routed[busy[1].url][FALLBACK] == 2  # type: ignore[attr-defined]


def test_next_turn_follows_the_longest_known_prefix() -> None:
    ready = ReadySet()
    # epsilon 1: a bound below the 4 replicas' total (at the default 3, (1 + 3) x the mean
    # of 4 is everything in flight, and a known family's replica is never skipped).
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(epsilon=1.0)))
    turn1 = chat(LONG, "First question, long enough to fill a block or two. " * 6)
    first = ready.choose(None, Req(turn1))
    assert first is not None
    # Load the first choice to its bound: turn 1 of another session spills...
    for r in ready.replicas:
        r.inflight = 0
    first.inflight = 100
    spilled = ready.choose(None, Req(turn1.replace(b"First", b"Other")))
    assert spilled is not None and spilled is not first
    first.inflight = 0
    # ...and that session's turn 2 goes where its turn 1 went, not to the first choice.
    turn2 = chat(LONG, "Other question, long enough to fill a block or two. " * 6,
                 "An answer. " * 20, "A follow-up?")
    assert ready.choose(None, Req(turn2)) is spilled
    # A replica that left: its LRU entries are ignored.
    ready.apply(snapshot(2, *[u for u in URLS[:4] if u != spilled.url]))
    again = ready.choose(None, Req(turn2))
    assert again is not None and again.url != spilled.url


def test_options_come_from_the_snapshot_unless_overridden() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:2], options=cold_options(epsilon=3.0)))
    assert ready.policy.options.epsilon == 3.0  # type: ignore[attr-defined]
    ready.apply(snapshot(2, *URLS[:2]))
    assert ready.policy.options == PrefixOptions()  # type: ignore[attr-defined]
    pinned = ReadySet(policy_override="prefix", prefix_options=cold_options(epsilon=0.1))
    pinned.apply(snapshot(1, *URLS[:2], options=cold_options(epsilon=2.0)))
    assert pinned.policy.options.epsilon == 0.1  # type: ignore[attr-defined]


def test_old_proxies_read_snapshots_with_prefix_options() -> None:
    """A proxy that predates the field ignores it (wire structs allow unknown fields)."""
    import msgspec

    from proxy.wire.snapshot import decode_snapshot, encode_snapshot

    class OldSnapshot(msgspec.Struct, kw_only=True):
        service: str
        generation: int
        published_at: float
        policy: str = "least_load"

    payload = encode_snapshot(snapshot(3, URLS[0], options=PrefixOptions(epsilon=1.0)))
    assert msgspec.json.decode(payload, type=OldSnapshot).generation == 3
    assert decode_snapshot(payload).prefix_options == PrefixOptions(epsilon=1.0)
    assert decode_snapshot(b'{"service":"s","generation":1,"published_at":0}').prefix_options \
        is None


# -- through a real proxy process ---------------------------------------------------------


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> str:
    async with session.post(f"{url}/echo", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["X-Replica-Id"]


async def test_end_to_end_prefix_affinity_and_metrics(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    reps = await replica_factory.astart(4, ids=["a", "b", "c", "d"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix", replicas=reps)
    # 24 prompts: their placement is a hash of the replicas' (random) ports, so with 12 a
    # draw that puts them all on 2 of the 4 replicas came up about once in 750 runs.
    prompts = [f"System prompt number {i}. " + LONG for i in range(24)]
    seen: dict[int, set[str]] = collections.defaultdict(set)
    async with aiohttp.ClientSession() as s:
        for rnd in range(4):
            for i, prompt in enumerate(prompts):
                seen[i].add(await _post(s, proxy.url, chat(prompt, f"question {rnd}")))
        # Short bodies have no key: the fallback spreads them.
        for _ in range(4):
            await _post(s, proxy.url, chat("Hi", "?"))
    assert all(len(where) == 1 for where in seen.values()), seen  # one replica per prompt
    assert len({next(iter(w)) for w in seen.values()}) >= 3  # prompts spread over replicas
    samples = await scrape(proxy.admin_url)
    affinity = sum(metric(samples, "sluice_routed_total", replica=r.url, reason="affinity")
                   for r in reps)
    fallback = sum(metric(samples, "sluice_routed_total", replica=r.url, reason="fallback")
                   for r in reps)
    assert (affinity, fallback) == (96, 4)


async def test_end_to_end_body_arriving_after_the_head_is_routed_on(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    """The head first, the body later (and chunked): routed on the body, sent whole."""
    reps = await replica_factory.astart(4, ids=["a", "b", "c", "d"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix", replicas=reps)
    bodies_ = [chat(f"Prompt {i}. " + LONG, "q") for i in range(8)]
    async with aiohttp.ClientSession() as s:
        expected = [await _post(s, proxy.url, b) for b in bodies_]
        again = [await _post(s, proxy.url, b) for b in reversed(bodies_)]
    assert expected == again[::-1]  # each prompt sticks to its replica
    port = int(proxy.url.rsplit(":", 1)[1])
    async with connect(port) as conn:
        for body, where in zip(bodies_, expected, strict=True):
            conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                      % len(body))
            await asyncio.sleep(0.05)  # the head alone reaches the proxy first
            conn.send(body[:100])
            await asyncio.sleep(0.05)
            conn.send(body[100:])
            resp = await conn.response()
            assert resp.status == 200
            assert resp.header("X-Replica-Id") == where
            assert json.loads(resp.body)["body_length"] == len(body)
        for body, where in zip(bodies_, expected, strict=True):
            chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 300]), body[i:i + 300])
                               for i in range(0, len(body), 300))
            conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + chunked + b"0\r\n\r\n")
            resp = await conn.response()
            assert resp.status == 200
            assert resp.header("X-Replica-Id") == where
            assert json.loads(resp.body)["body_length"] == len(body)
        # A GET on the same connection still works (no body to wait for).
        conn.send(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await conn.response()).status == 200


def test_a_known_prefix_spills_where_it_spilled_before() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(epsilon=0.5)))
    body = bodies(1, seed=21)[0]
    by_url = {r.url: r for r in ready.replicas}
    a, b, c, d = (by_url[u] for u in rank(ready, body))  # type: ignore[index]
    assert ready.choose(None, Req(body)) is a  # pinned to the first choice
    a.inflight, b.inflight = 9, 9  # total 18: capacity ceil(1.5 x 19 / 4) = 8
    assert ready.choose(None, Req(body)) is c  # walks the order past two full replicas
    b.inflight = 0  # the second choice has room again, but the prefix is cached on c
    assert ready.choose(None, Req(body)) is c
    c.inflight = 9  # c full too: walk again (b), and remember b
    assert ready.choose(None, Req(body)) is b
    assert d.inflight == 0


@pytest.mark.parametrize("placement", ["rendezvous", "capacity"])
def test_a_known_prefix_leaves_a_replica_spill_margin_above_the_mean(placement: str) -> None:
    # The default epsilon 3 puts no bound on 4 replicas ((1 + 3) x the mean is all that is
    # in flight): the margin does. Its family's replica alone loaded, holding L requests:
    # skipped once L >= ceil((L + 1) / 4) + 8, so at 11 (3 + 8), not at 10 (3 + 8 > 10).
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(placement=placement)))
    body = bodies(1, seed=31)[0]
    top = ready.choose(None, Req(body))
    assert top is not None
    top.inflight = 10
    assert ready.choose(None, Req(body)) is top
    top.inflight = 11
    spilled = ready.choose(None, Req(body))
    assert spilled is not None and spilled is not top
    assert ready.policy.routed[spilled.url][SPILL] == 1  # type: ignore[attr-defined]
    # With the others loaded the mean rises, and so does the bound: 11 + 3 x 10 in flight,
    # ceil(42 / 4) + 8 = 19 > 11, the family stays.
    for r in ready.replicas:
        if r is not top:
            r.inflight = 10
    assert ready.choose(None, Req(body)) is top
    # spill_margin 0: no such bound; epsilon 3 alone keeps the family at any load.
    off = ReadySet()
    off.apply(snapshot(1, *URLS[:4], options=cold_options(placement=placement,
                                                             spill_margin=0)))
    first = off.choose(None, Req(body))
    assert first is not None
    first.inflight = 500
    assert off.choose(None, Req(body)) is first


def test_the_spill_margin_grows_to_twice_as_placed_families_fill_the_caches() -> None:
    # 4 replicas holding 2 families each (capacity 8). A spill into a full cache evicts
    # another family: the margin goes from 8 (empty) to 16 (8 families placed).
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(placement="capacity",
                                                             replica_families=2)))
    policy = ready.policy
    table = policy.placement  # type: ignore[attr-defined]
    hot, *others = bodies(9, seed=37)
    top = ready.choose(None, Req(hot))
    assert top is not None
    table.refresh(table.now)
    assert table.fullness == 1 / 8
    top.inflight = 12  # skipped at ceil(13 / 4) + 9 = 13 (margin ceil(8 x 1.125)): stays
    assert ready.choose(None, Req(hot)) is top
    top.inflight = 13
    assert ready.choose(None, Req(hot)) is not top
    top.inflight = 0
    for body in others:  # 9 families: the caches are full (fullness capped at 1)
        assert ready.choose(None, Req(body)) is not None
    table.refresh(table.now)
    assert table.fullness == 1.0
    top.inflight = 19  # min(4 x 20 / 4, 20 / 4 + 16) = 20: stays where 13 spilled
    assert ready.choose(None, Req(hot)) is top
    assert policy.spill_margin == 16  # type: ignore[attr-defined]
    # Split among 4 proxies, each judging its own quarter: 8 / sqrt(4), however full.
    policy.set_proxies(4)  # type: ignore[attr-defined]
    assert policy.spill_margin == 4  # type: ignore[attr-defined]
    for fullness, proxies, margin in [(0.0, 4, 4), (0.5, 4, 4), (0.0, 1, 8), (0.5, 1, 12),
                                      (0.0, 3, 5), (1.0, 9, 3), (1.0, 1, 16)]:
        policy.set_proxies(proxies)  # type: ignore[attr-defined]
        policy._rescale(fullness)  # type: ignore[attr-defined]
        assert policy.spill_margin == margin, (fullness, proxies)  # type: ignore[attr-defined]


@pytest.mark.parametrize("proxies", [1, 4])
def test_a_hot_family_shares_its_load_with_its_warm_secondary(proxies: int) -> None:
    # Each of 4 proxies counts ~1/4 of a hot primary's load: a margin over the mean let
    # them pile ~16 requests over it, where one proxy stops at 8-10. Once the family's
    # secondary has answered and took its overflow lately (warm), a request goes to
    # whichever of the two holds fewer, as soon as the primary is above the mean: each
    # proxy balancing its own share balances the fleet's.
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(placement="capacity",
                                                             replica_families=13)))
    policy = ready.policy
    table = policy.placement  # type: ignore[attr-defined]
    policy.set_proxies(proxies)  # type: ignore[attr-defined]
    hot = bodies(1, seed=41)[0]
    top = ready.choose(None, Req(hot))
    assert top is not None
    others = [r for r in ready.replicas if r is not top]
    table.refresh(table.now)  # 1 family of 52: fullness 1/52, seen at the next bound
    top.inflight = 1
    assert ready.choose(None, Req(hot)) is top
    assert policy.spill_margin == (9 if proxies == 1 else 4)  # type: ignore[attr-defined]
    bound = 13 if proxies == 1 else 6  # min(4 x the mean, ceil(mean) + margin), it counted
    top.inflight = bound - 1  # within the bound, and no secondary yet: stays
    assert ready.choose(None, Req(hot)) is top
    top.inflight = bound  # over it: a new secondary, warming
    second = ready.choose(None, Req(hot))
    fam = table.families[key(hot)[0]]
    assert second is not None and second is not top
    assert fam.secondary is second and fam.warming is second
    top.inflight = 3  # above the mean, the secondary idle: but it has not answered,
    assert ready.choose(None, Req(hot)) is top  # so it would compute the prompt again
    fam.warming = None  # its first answer came
    assert ready.choose(None, Req(hot)) is second
    second.inflight = 3  # as many: the primary
    assert ready.choose(None, Req(hot)) is top
    # Both above the mean, far above with several proxies' noisy counts: the one that
    # holds fewer, not the primary up to its bound.
    for r in others:  # not idle: no third copy (test_a_hot_family_gets_a_third_copy...)
        r.inflight = 1
    top.inflight, second.inflight = 6, 5  # within the bound (4 proxies: 7)
    assert ready.choose(None, Req(hot)) is second
    assert fam.third is None
    top.inflight, second.inflight = 1, 0  # the primary at or below the mean: it keeps its
    for r in others:  # family (the secondary is for its overflow)
        if r is not second:
            r.inflight = 4  # the mean: 9 / 4
    assert ready.choose(None, Req(hot)) is top
    for r in others:
        r.inflight = 0
    top.inflight, second.inflight = 3, 0
    table.refresh(table.now + 3)  # the secondary took nothing for 3 s: its copy may be gone
    assert ready.choose(None, Req(hot)) is top
    table.refresh(table.now + 1)
    fam.secondary_used = table.now  # another proxy's overflow went there just now
    assert ready.choose(None, Req(hot)) is second
    assert ready.choose({second}, Req(hot)) is top  # excluded (failed): the primary
    second.left_at = 1.0  # gone: likewise
    assert ready.choose(None, Req(hot)) is top
    second.left_at = None
    # The primary over its bound and the secondary above the mean beyond the slack:
    # the overflow moves to a new replica (cold, warming), the secondary is the former.
    top.inflight, second.inflight = 30, 29
    third = ready.choose(None, Req(hot))
    assert third not in (top, second) and fam.secondary is third and fam.former is second
    # The slack (how far above this proxy's own mean a secondary still takes a full
    # primary's overflow) grows with the caches' fullness, and is 0 for a proxy alone.
    for fullness, n, slack in [(0.0, 4, 1), (0.5, 4, 3), (1.0, 4, 4), (0.0, 2, 2),
                               (0.5, 1, 0), (0.0, 1, 0)]:
        policy.set_proxies(n)  # type: ignore[attr-defined]
        policy._rescale(fullness)  # type: ignore[attr-defined]
        assert policy._slack == slack, (fullness, n)  # type: ignore[attr-defined]


def warm_secondary() -> tuple[ReadySet, bytes, Any, list[Any]]:
    """4 replicas (13 families each) and one hot family whose warm secondary answered:
    the ready set, the family's body, its placement entry and the replicas (primary,
    secondary, the other two)."""
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(placement="capacity",
                                                             replica_families=13)))
    table = ready.policy.placement  # type: ignore[attr-defined]
    hot = bodies(1, seed=41)[0]
    top = ready.choose(None, Req(hot))
    assert top is not None
    table.refresh(table.now)
    top.inflight = 13  # over the bound: a secondary
    second = ready.choose(None, Req(hot))
    fam = table.families[key(hot)[0]]
    assert second is not None and fam.secondary is second
    fam.warming = None  # it answered
    return ready, hot, fam, [top, second, *[r for r in ready.replicas
                                            if r not in (top, second)]]


def test_with_the_fleets_counts_a_primary_shares_its_load_only_above_their_mean() -> None:
    # --fleet-load (set_proxies(1)): a replica's load counts the other proxies' in flight.
    # The mean a primary is judged above must count them too: on this proxy's own (a
    # quarter of the fleet's with 4 proxies) every hot primary was above it.
    ready, hot, fam, (top, second, *rest) = warm_secondary()
    ready.policy.set_proxies(1)  # type: ignore[attr-defined]
    # Own counts 3, 0, 0, 0 (mean 3 // 4 + 1 = 1); the fleet's 5, 1, 9, 9 (24 // 4 + 1 =
    # 7): the primary is below the fleet's mean and keeps its family.
    top.inflight, top.peer_inflight, second.peer_inflight = 3, 2, 1
    for r in rest:
        r.peer_inflight = 9
    assert ready.choose(None, Req(hot)) is top
    top.peer_inflight = 6  # 9 of 28 (mean 8): above it, the warm secondary holds fewer
    assert ready.choose(None, Req(hot)) is second
    assert fam.third is None  # the other two hold more than both copies: no third copy


def test_a_hot_family_gets_a_third_copy_when_its_two_are_above_the_mean() -> None:
    # Overload (8 groups, Zipf 1.4, 48 req/s): the hottest family needs about two replicas
    # of four, and its secondary also held three small families, so the primary and the
    # secondary both sat above the mean while a third replica idled below it; smg spread
    # the family over three replicas. A proxy judging the fleet's load, while the caches
    # have room, gives such a family a third copy at the idlest other replica.
    ready, hot, fam, (top, second, busy, idle) = warm_secondary()
    policy = ready.policy
    table = policy.placement  # type: ignore[attr-defined]
    busy.inflight, idle.inflight = 1, 0
    # The mean is 13 // 4 + 1 = 4 (the bound's count of one more); both copies hold at
    # least 2 more, the idle replica at least 2 fewer.
    top.inflight, second.inflight = 6, 6
    first = Req(hot)
    assert ready.choose(None, first) is idle
    assert fam.third is idle and first.cold  # its first request computes the prompt
    again = Req(hot)
    assert ready.choose(None, again) is idle and not again.cold  # now a copy: a hit
    idle.inflight = 6  # as many as the others: the primary keeps it
    assert ready.choose(None, Req(hot)) is top
    second.inflight = 5  # the copy holding the fewest
    assert ready.choose(None, Req(hot)) is second
    second.inflight, idle.inflight = 6, 3
    assert ready.choose(None, Req(hot)) is idle
    assert ready.choose({idle}, Req(hot)) is top  # excluded: not a copy for this request
    # Not a copy any more once unused for WARM_RECENT: its cache may have evicted it.
    table.refresh(table.now + 3)
    fam.secondary_used = table.now
    idle.inflight = 0
    remade = Req(hot)
    assert ready.choose(None, remade) is idle and remade.cold  # re-made: cold again
    assert fam.third is idle and fam.third_used == table.now
    # The primary at or below the mean keeps its family, copies or not.
    top.inflight = 2
    assert ready.choose(None, Req(hot)) is top
    top.inflight = 6
    # The idlest replica not below the mean by the gap: no third copy.
    fam.third = None
    idle.inflight = 3  # the mean is now 16 // 4 + 1 = 5
    assert ready.choose(None, Req(hot)) is top and fam.third is None
    idle.inflight = 0
    # Caches more than half full: a third copy would evict another family's prompt.
    table.fullness = 0.6
    assert ready.choose(None, Req(hot)) is top and fam.third is None
    table.fullness = 1 / 52
    assert ready.choose(None, Req(hot)) is idle and fam.third is idle
    # One of several proxies counts ~1/N of the fleet's requests: the fleet's counts (its
    # own plus the others' as the in-flight hash showed them) decide, once a clock tick.
    fam.third = None
    policy.set_proxies(4)  # type: ignore[attr-defined]
    table.refresh(table.now + 1)
    fam.secondary_used = table.now
    top.inflight, second.inflight, busy.inflight, idle.inflight = 6, 6, 1, 0
    top.peer_seen, second.peer_seen, busy.peer_seen, idle.peer_seen = 4, 4, 10, 11
    # Alone it would make one (6, 6 against a mean of 4); the fleet is even (10, 10, 11,
    # 11): none. The primary shares with the secondary only: as many, so it keeps it.
    assert ready.choose(None, Req(hot)) is top and fam.third is None
    idle.peer_seen = 0  # the fleet's idlest now: 10, 10, 11, 0, the mean 31 // 4 + 1 = 8
    assert ready.choose(None, Req(hot)) is top and fam.third is None  # looked this tick
    table.refresh(table.now + 1)
    fam.secondary_used = table.now
    assert ready.choose(None, Req(hot)) is idle and fam.third is idle
    # A third copy that leaves the set is forgotten; one becoming the secondary stops
    # being the third.
    ready.apply(snapshot(2, *[r.url for r in ready.replicas if r is not idle],
                         options=cold_options(placement="capacity", replica_families=13)))
    assert fam.third is None
    fam.third = busy
    fam.replace_secondary(busy)
    assert fam.third is None and fam.secondary is busy


def test_a_warm_third_copy_takes_the_overflow_before_a_move() -> None:
    # The primary over its bound and the secondary above the mean used to move the
    # overflow to a new secondary (a cold prefill, and with several proxies a hold while
    # it computes the prompt); a warm third copy within the mean takes it instead.
    ready, hot, fam, (top, second, busy, idle) = warm_secondary()
    top.inflight, second.inflight, busy.inflight, idle.inflight = 6, 6, 1, 0
    assert ready.choose(None, Req(hot)) is idle and fam.third is idle
    # The mean is 54 // 4 + 1 = 14, the bound 14 + 9: the primary over it, the secondary
    # above the mean. The least loaded replica is `busy`, but the third copy is warm.
    top.inflight, second.inflight, busy.inflight, idle.inflight = 30, 20, 1, 3
    assert ready.choose(None, Req(hot)) is idle
    assert fam.secondary is second and fam.warming is None  # no move
    idle.inflight = 20  # above the mean (71 // 4 + 1) too: the overflow moves
    assert ready.choose(None, Req(hot)) is busy
    assert fam.secondary is busy and fam.former is second and fam.warming is busy


def test_prefix_flags_build_the_options_and_bad_ones_are_refused() -> None:
    from click.testing import CliRunner

    from proxy.cli import _prefix_options, proxy_command

    assert _prefix_options({"prefix_epsilon": None}) is None  # none given: the snapshot's
    assert _prefix_options({"prefix_epsilon": 0.5, "prefix_session_header": ""}) == \
        PrefixOptions(epsilon=0.5, session_header="")
    assert _prefix_options({"prefix_spill_margin": 0}) == PrefixOptions(spill_margin=0)
    # On by default: off is the option given.
    assert _prefix_options({"prefix_warm_copies": True}) == PrefixOptions()
    assert _prefix_options({"prefix_warm_copies": False}) == cold_options()
    result = CliRunner().invoke(proxy_command, [
        "--replicas", "http://127.0.0.1:1", "--policy", "prefix",
        "--prefix-block-bytes", "4096", "--prefix-bytes", "1024"])
    assert result.exit_code == 2
    assert "block_bytes" in result.output and "prefix_bytes" in result.output
    result = CliRunner().invoke(proxy_command, [
        "--replicas", "http://127.0.0.1:1", "--policy", "prefix", "--prefix-spill-margin", "-1"])
    assert result.exit_code == 2 and "--prefix-spill-margin" in result.output


async def test_a_body_slower_than_the_route_wait_is_routed_on_what_arrived(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    """The proxy does not hold a request forever for its routing bytes: after 1 s it
    routes on what arrived, and the rest of the body streams on."""
    from proxy.exchange import _ROUTE_WAIT

    reps = await replica_factory.astart(2, ids=["a", "b"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix", replicas=reps)
    body = chat(LONG * 4, "q")
    port = int(proxy.url.rsplit(":", 1)[1])
    async with connect(port) as conn:
        conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                  + body[:300])
        # Poll the replicas until the request reached one (routed before the body ended).
        from tests.support.harness import replica_stats
        from tests.support.poll import until

        async def arrived() -> bool:
            return any([(await replica_stats(r))["in_flight"] for r in reps])

        started = asyncio.get_running_loop().time()
        await until(arrived, timeout=10, what="the request routed on a partial body")
        assert asyncio.get_running_loop().time() - started >= _ROUTE_WAIT * 0.5
        conn.send(body[300:])
        resp = await conn.response()
        assert resp.status == 200
        assert json.loads(resp.body)["body_length"] == len(body)


async def test_a_body_over_max_body_while_held_for_routing_is_refused_once(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    """413 while the body is held for routing: answered once, nothing sent upstream."""
    reps = await replica_factory.astart(2, ids=["a", "b"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "prefix", "--max-body", "1500",
                                       replicas=reps)
    port = int(proxy.url.rsplit(":", 1)[1])
    async with connect(port) as conn:
        conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"7d0\r\n" + b"m" * 2000 + b"\r\n")
        resp = await conn.response()
        assert resp.status == 413
        assert await conn.closed_by_peer(5.0)
    stats = [await replica_stats(r) for r in reps]
    assert sum(s["total"] for s in stats) == 0
    async with aiohttp.ClientSession() as s:  # the proxy still serves
        assert await _post(s, proxy.url, chat(LONG, "q")) in {"a", "b"}




def test_the_bound_counts_the_engine_queue_other_proxies_filled() -> None:
    """With --engine-load a replica's load is its in-flight plus its engine's queue: a
    first choice this proxy sees idle, but whose engine queues what other proxies sent,
    is over the bound (and the mean counts the queues too)."""
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(epsilon=0.5)))
    body = bodies(1, seed=11)[0]
    first = ready.choose(None, Req(body))
    assert first is not None
    assert ready.choose(None, Req(body)) is first  # known now, and idle: affinity
    first.engine_queue = 6  # total 6: capacity ceil(1.5 * 7 / 4) = 3
    moved = ready.choose(None, Req(body))
    assert moved is not None and moved is not first
    first.engine_queue = 0
    assert ready.choose(None, Req(body)) is first
