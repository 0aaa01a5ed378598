"""Autoscaling rules, driven with an injected clock and synthetic per-second counts."""

from __future__ import annotations

import pytest

from controlplane.autoscaler import (
    Autoscaler,
    fallback_plan,
    instance_aware_target,
    qps,
)
from controlplane.servicespec import ReplicaPolicy, SpecError, parse_spec


def policy(**kw: object) -> ReplicaPolicy:
    base: dict[str, object] = {"min_replicas": 1, "max_replicas": 5,
                               "target_qps_per_replica": 2.0,
                               "upscale_delay_seconds": 60, "downscale_delay_seconds": 120}
    base.update(kw)
    return ReplicaPolicy(**base)  # type: ignore[arg-type]


def steady(rate: float, start: int, end: int) -> dict[int, int]:
    return {s: int(rate) for s in range(start, end)}


def run(scaler: Autoscaler, rps_of, t0: float, t1: float, step: float = 20.0) -> list[int]:
    targets = []
    t = t0
    while t <= t1:
        targets.append(scaler.decide(t, rps=rps_of(t)).target)
        t += step
    return targets


def test_qps_is_the_mean_over_the_last_60_whole_seconds() -> None:
    counts = steady(6, 0, 200)
    assert qps(counts, 100.5) == 6.0
    assert qps({99: 60}, 100.0) == 1.0
    assert qps({100: 60}, 100.0) == 0.0  # the current second is not complete


def test_upscale_only_after_the_delay_then_to_the_level_held() -> None:
    s = Autoscaler(policy(), now=0.0)
    rates = steady(7, -100, 1000)  # 7 QPS / 2 per replica -> 4 replicas
    # Before 60 s of observation nothing moves; at 60 s the whole window agrees.
    assert run(s, lambda t: rates, 0, 40) == [1, 1, 1]
    decision = s.decide(60.0, rps=rates)
    assert decision.target == 4 and decision.reason == "upscale"


def test_one_noisy_tick_neither_triggers_nor_resets_an_upscale() -> None:
    rates_hi = steady(7, -100, 1000)
    s = Autoscaler(policy(), now=0.0)
    assert s.decide(0.0, rps=rates_hi).target == 1
    assert s.decide(20.0, rps=rates_hi).target == 1
    # One quiet tick in the middle of the window is discarded as an outlier ...
    assert s.decide(40.0, rps={}).target == 1
    # ... so the upscale happens on time, as if it had not been there.
    assert s.decide(60.0, rps=rates_hi).target == 4
    # A single spike never upscales on its own.
    s2 = Autoscaler(policy(), now=0.0)
    for t in range(0, 200, 20):
        rps = rates_hi if t == 100 else {}
        assert s2.decide(float(t), rps=rps).target == 1
    # Two quiet ticks are no longer noise: the upscale waits.
    s3 = Autoscaler(policy(), now=0.0)
    for t in (0.0, 20.0):
        s3.decide(t, rps=rates_hi)
    s3.decide(40.0, rps={})
    s3.decide(50.0, rps={})
    assert s3.decide(60.0, rps=rates_hi).target == 1


def test_downscale_waits_for_the_longer_delay_and_takes_the_window_max() -> None:
    s = Autoscaler(policy(), now=0.0, current=4)
    low = steady(3, 0, 2000)  # 3 QPS -> 2 replicas
    targets = run(s, lambda t: low, 0, 100)
    assert set(targets) == {4}
    assert s.decide(120.0, rps=low).target == 2
    # A lone spike inside the downscale window is discarded; two are not.
    s2 = Autoscaler(policy(), now=0.0, current=4)
    for t in range(0, 140, 20):
        s2.decide(float(t), rps=steady(8, 0, 2000) if t == 100 else low)
    assert s2.current == 2
    s3 = Autoscaler(policy(), now=0.0, current=4)
    for t in range(0, 140, 20):
        s3.decide(float(t), rps=steady(8, 0, 2000) if t in (80, 100) else low)
    assert s3.current == 4


def test_from_zero_adopts_at_once_and_decides_faster() -> None:
    s = Autoscaler(policy(min_replicas=0), now=0.0, current=0)
    assert s.interval == 5.0
    decision = s.decide(1.0, rps={0: 6})
    assert decision.target == 1 and decision.reason == "from_zero"  # 0.1 QPS -> 1, no delay
    assert s.interval == 20.0


def test_scale_to_zero_after_downscale_delay_and_demand_wakes_it() -> None:
    s = Autoscaler(policy(min_replicas=0), now=0.0, current=1)
    targets = run(s, lambda t: {}, 0, 120)
    assert targets[-1] == 0 and targets[-2] == 1
    d = s.demand(130.0)
    assert d.target == 1 and d.reason == "demand"


def test_clipping_and_overprovision() -> None:
    s = Autoscaler(policy(num_overprovision=1), now=0.0)
    huge = steady(1000, -100, 1000)
    for t in range(0, 80, 20):
        d = s.decide(float(t), rps=huge)
    assert d.raw == 5 and d.target == 6


def test_update_resets_to_the_computed_target() -> None:
    s = Autoscaler(policy(), now=0.0, current=4)
    d = s.reset(policy(max_replicas=3), 10.0, rps=steady(2, 0, 100))
    assert d.target == 1 and d.reason == "reset"


def test_fixed_replicas_do_not_autoscale() -> None:
    s = Autoscaler(ReplicaPolicy(min_replicas=3), now=0.0)
    assert not s.autoscaling
    assert s.decide(0.0, rps=steady(1000, 0, 100)).target == 3
    assert s.describe() == "Fixed 3 replicas"


def test_concurrency_target() -> None:
    p = ReplicaPolicy(min_replicas=1, max_replicas=8, target_ongoing_requests=4,
                      upscale_delay_seconds=0, downscale_delay_seconds=0)
    s = Autoscaler(p, now=0.0)
    assert s.decide(0.0, inflight=17).target == 5
    assert s.decide(20.0, inflight=3).target == 1
    assert "target ongoing requests per replica: 4" in s.describe()


def test_both_qps_and_concurrency_is_an_error() -> None:
    with pytest.raises(SpecError, match="target_ongoing_requests"):
        parse_spec({"service": {"readiness_probe": "/", "replica_policy": {
            "min_replicas": 1, "max_replicas": 2, "target_qps_per_replica": 1,
            "target_ongoing_requests": 2}}, "run": "true"})


def test_instance_aware_capacity() -> None:
    # Capacity 3 + 1 = 4 QPS; 9 QPS needs 5 more, added at the fastest (3 QPS) rate: 2.
    assert instance_aware_target(9.0, [3.0, 1.0], fastest_qps=3.0) == 4
    # 2.5 QPS: the 1-QPS replica goes first; the 3-QPS one alone covers it.
    assert instance_aware_target(2.5, [3.0, 1.0], fastest_qps=3.0) == 1
    assert instance_aware_target(0.0, [3.0, 1.0], fastest_qps=3.0) == 0
    p = policy(target_qps_per_replica={"A100": 3.0, "T4": 1.0}, upscale_delay_seconds=0)
    s = Autoscaler(p, now=0.0)
    d = s.decide(0.0, rps=steady(9, -60, 0), replica_qps=[3.0, 1.0])
    assert d.target == 4
    assert "A100: 3" in s.describe()


def test_fallback_arithmetic() -> None:
    p = policy(base_ondemand_fallback_replicas=1, dynamic_ondemand_fallback=True)
    # 4 wanted: 1 on-demand base, 3 spot; 1 spot READY -> 2 extra on-demand.
    assert fallback_plan(p, 4, ready_spot=1, use_spot=True) == (3, 3)
    # All spot back: only the base stays on-demand.
    assert fallback_plan(p, 4, ready_spot=3, use_spot=True) == (3, 1)
    static = policy(base_ondemand_fallback_replicas=2)
    assert fallback_plan(static, 4, ready_spot=0, use_spot=True) == (2, 2)
    assert fallback_plan(static, 1, ready_spot=0, use_spot=True) == (0, 1)
    assert fallback_plan(p, 4, ready_spot=0, use_spot=False) == (0, 4)


def test_describe_in_words() -> None:
    assert Autoscaler(policy(min_replicas=1, max_replicas=4), now=0.0).describe() == (
        "Autoscaling from 1 to 4 replicas (target QPS per replica: 2.0)")


def test_engine_queue_target_with_the_same_windows() -> None:
    p = ReplicaPolicy(min_replicas=1, max_replicas=6, target_queue_length_per_replica=4,
                      upscale_delay_seconds=40, downscale_delay_seconds=60)
    s = Autoscaler(p, now=0.0)
    assert s.autoscaling and "target engine queue per replica: 4" in s.describe()
    # A queue of 9 requests wants ceil(9 / 4) = 3, after the upscale window only.
    assert [s.decide(t, queue=9).target for t in (0.0, 20.0)] == [1, 1]
    assert s.decide(40.0, queue=9).target == 3
    # One empty tick neither scales down nor restarts the window.
    assert s.decide(60.0, queue=0).target == 3
    assert [s.decide(t, queue=9).target for t in (80.0, 100.0)] == [3, 3]
    # The queue gone from the downscale window (the one busy tick left in it at 160 is
    # discarded as an outlier, as for every signal): back to the minimum.
    assert [s.decide(t, queue=0).target for t in (120.0, 140.0, 160.0, 180.0)] == [3, 3, 1, 1]
    # The signal is the queue, not in-flight requests or request rate.
    assert s.decide(200.0, queue=None, inflight=100, rps={199: 1000}).raw == 1


def test_kv_cache_usage_target() -> None:
    p = ReplicaPolicy(min_replicas=1, max_replicas=6, target_kv_cache_usage_per_replica=0.6,
                      upscale_delay_seconds=0, downscale_delay_seconds=0)
    s = Autoscaler(p, now=0.0, current=2)
    assert "target KV-cache usage per replica: 0.6" in s.describe()
    # Two replicas at 0.9: 1.8 / 0.6 = 3 replicas (exactly 3, not 4 by float error).
    assert s.decide(0.0, kv_usage=1.8).target == 3
    assert s.decide(20.0, kv_usage=0.5).target == 1
    with pytest.raises(SpecError, match="target_kv_cache_usage_per_replica"):
        parse_spec({"service": {"readiness_probe": "/", "replica_policy": {
            "min_replicas": 1, "max_replicas": 2, "target_kv_cache_usage_per_replica": 1.5}},
            "run": "true"})
