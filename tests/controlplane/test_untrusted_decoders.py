"""The decoders of what a proxy's Redis user writes (controlplane/store/untrusted.py):
arbitrary bytes as fields and values never raise out of them, and what they return
is bounded (hypothesis); the bounded read against a real redis-server deletes a hash
over its bounds unread; the autoscaler clips any signal into [min, max]."""

from __future__ import annotations

import math
import time

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.autoscaler import Autoscaler, qps
from controlplane.display import table
from controlplane.servicespec import parse_spec
from controlplane.store import Store
from controlplane.store.untrusted import (
    MAX_FIELDS,
    Rejects,
    decode_heartbeats,
    decode_inflight,
    decode_rps,
    parse_nudge,
    printable,
)
from proxy.wire.telemetry import MAX_COUNT

FIELDS = st.dictionaries(st.binary(max_size=40), st.binary(max_size=200), max_size=20)
# JSON-shaped values: what a hostile writer would try beside random bytes.
JSONISH = st.sampled_from([
    b'{"at": 1e999, "total": 1}', b'{"at": 1, "total": ' + b"9" * 401 + b"}",
    b'{"at": 1, "total": -5}', b'{"at": "x"}', b"[]", b"null", b'{"replicas": {"u": -1}}',
    b'{"generation": ' + b"9" * 30 + b"}", b'{"recent": [[1, 1e999]]}', b"\xff\xfe{",
    b'{"at": NaN}', b'{"seen_at": Infinity}',
])  # fmt: skip
MIXED = st.dictionaries(st.binary(max_size=40), st.one_of(st.binary(max_size=200), JSONISH),
                        max_size=20)  # fmt: skip


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(MIXED)
def test_no_bytes_make_a_telemetry_decoder_raise(raw: dict[bytes, bytes]) -> None:
    rejects = Rejects()
    counts = decode_rps("svc", raw, rejects)
    assert all(0 <= n <= MAX_COUNT and 0 <= s < 10**11 for s, n in counts.items())
    entries, skipped = decode_inflight("svc", raw, rejects)
    assert len(entries) + len(skipped) == len(raw)
    for proxy_id, entry in entries.items():
        assert proxy_id.isprintable()
        assert 0 <= entry.total <= MAX_COUNT and math.isfinite(entry.at) and entry.at >= 0
        assert all(0 <= n <= MAX_COUNT for n in entry.replicas.values())
    beats, skipped = decode_heartbeats("svc", raw, rejects)
    assert len(beats) + len(skipped) == len(raw)
    for beat in beats.values():
        assert beat.generation >= -1 and math.isfinite(beat.seen_at)


@settings(max_examples=400)
@given(st.one_of(st.binary(max_size=300), JSONISH, st.text(max_size=100), st.none(),
                 st.integers()))  # fmt: skip
def test_no_message_makes_the_nudge_decoder_raise(payload: object) -> None:
    nudge = parse_nudge(payload, Rejects())
    assert nudge is None or (len(nudge.service) <= 63 and nudge.service.isprintable())


@given(st.text(max_size=300))
def test_printable_never_lets_a_control_character_through(text: str) -> None:
    out = printable(text)
    assert out.isprintable() and len(out) <= 3 + 100 * 10


def test_the_issues_values_are_skipped_and_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = int(time.time())
    clock = [0.0]
    rejects = Rejects(clock=lambda: clock[0])
    raw: dict[bytes, bytes] = {
        str(now - 1).encode(): b"9" * 401,  # the float overflow of issue 24
        str(now - 2).encode(): b"-1066",  # a negative count
        str(now - 3).encode(): b"600",
        b"\xff": b"1",
    }
    with caplog.at_level("WARNING"):
        for _ in range(10):  # ten steps, one log line
            assert decode_rps("svc", raw, rejects) == {now - 3: 600}
        clock[0] = 61.0
        decode_rps("svc", raw, rejects)
    assert rejects.counts[("svc", "rps")] == 33
    lines = [r for r in caplog.records if "invalid rps" in r.getMessage()]
    assert [r.getMessage().split(" invalid")[0] for r in lines] == [
        "service svc: skipped 3", "service svc: skipped 30"]
    entries, skipped = decode_inflight("svc", {b"\xff": b'{"at": 1, "total": 1}',
                                               b"\x1b]0;pwned\x07": b'{"at": 1}',
                                               b"ok:1": b'{"at": 1, "total": 2}'},
                                       rejects)  # fmt: skip
    assert list(entries) == ["ok:1"] and len(skipped) == 2


def test_the_autoscaler_clips_any_signal_into_its_bounds() -> None:
    spec = parse_spec({"service": {"readiness_probe": "/h", "replica_policy": {
        "min_replicas": 1, "max_replicas": 3, "target_qps_per_replica": 1}}})  # fmt: skip
    scaler = Autoscaler(spec.service.scaling, now=0.0)
    now = 1000.0
    huge = {int(now) - 1: 10**400, int(now) - 2: -(10**400)}
    assert 0 <= qps(huge, now) < 1e12
    for rps in (huge, {int(now) - 1: -5000}):
        raw, _ = scaler.raw_target(rps=rps, inflight=None, now=now)
        assert 1 <= raw <= 3
    conc = parse_spec({"service": {"readiness_probe": "/h", "replica_policy": {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}}})  # fmt: skip
    scaler = Autoscaler(conc.service.scaling, now=0.0)
    for load in (math.inf, math.nan, -1.0, 1e308):
        raw, _ = scaler.raw_target(rps=None, inflight=load, now=now)
        assert 1 <= raw <= 3


async def test_a_hash_over_its_bounds_is_deleted_unread(
    store: Store, redis_client: aioredis.Redis
) -> None:
    key = store.keys.inflight("svc")
    await redis_client.hset(key, mapping={f"p{i}": "{}" for i in range(MAX_FIELDS + 1)})
    assert await store.telemetry.read_inflight("svc") == {}
    assert await redis_client.exists(key) == 0
    assert store.rejects.counts[("svc", "inflight")] == 1
    # 33 MiB in one field: over the byte bound, deleted without being transferred.
    big = store.keys.proxies("svc")
    await redis_client.hset(big, "p", b"x" * (33 * 1024 * 1024))
    assert await store.telemetry.read_proxies("svc") == {}
    assert await redis_client.exists(big) == 0
    # Within the bounds: a bad field is skipped and deleted, a good one kept.
    await redis_client.hset(key, mapping={b"\xff": b"{}", "ok": '{"at": 1, "total": 3}'})
    entries = await store.telemetry.read_inflight("svc")
    assert list(entries) == ["ok"] and entries["ok"].total == 3
    assert await redis_client.hkeys(key) == [b"ok"]


def test_display_prints_terminal_escapes_as_text() -> None:
    out = table(["PROXY", "STATE"], [["\x1b]0;pwned\x07\x1b[2J\x1b[Hllm", "\x9b31m"]])
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert "\\x1b]0;pwned\\x07" in out
