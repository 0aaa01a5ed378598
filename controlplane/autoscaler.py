"""Autoscaling decisions: pure functions of a service's replica policy, the proxies'
per-second request counts (or their in-flight totals), and an injected clock.

The meaning is Sky Serve's: target = ceil(QPS over the last 60 s /
target_qps_per_replica), clipped to [min_replicas, max_replicas], plus
num_overprovision; upscale only after the target has stayed higher for
upscale_delay_seconds, downscale only after it stayed lower for
downscale_delay_seconds; from a target of 0 adopt at once; an update resets the
target to the computed one. Decisions every 20 s (5 s while the target is 0).

The rule that differs (windowed hysteresis). Sky Serve counts consecutive
ticks above or below the current target, and one noisy tick resets the count.
Here every tick records its raw target, and a decision reads the window:

* upscale when the service has been observed for the whole upscale delay and
  the window's *low level* is above the current target: the new target is that
  level (what demand held for the whole window);
* downscale likewise when the downscale window's *high level* is below the
  current target: the new target is that level.

The low level is the minimum after discarding the lowest samples as outliers
(one sample, or a tenth of the window when that is more; none when the window
has fewer than 3 samples); the high level is the maximum after discarding the
highest ones alike. So a single noisy tick neither triggers a decision (a lone
spike is discarded) nor resets one that is building (a lone dip is discarded);
with Sky Serve's counters the dip restarts the whole delay.

Concurrency (a sluice extension, `target_ongoing_requests`): the raw target is
ceil(total in-flight requests across proxies / target_ongoing_requests), with
the same windows.

Engine queue (a sluice extension, `target_queue_length_per_replica`): the raw
target is ceil(requests waiting in the engines' own queues, summed over the READY
replicas' fresh telemetry / target_queue_length_per_replica), with the same windows
(KEDA's average-value rule; docs/engines.md).

KV-cache usage (a sluice extension, `target_kv_cache_usage_per_replica`, 0-1): the
raw target is ceil(the READY replicas' KV usage summed / the target), so replicas at
0.9 with a target of 0.6 ask for half as many again; the same windows.

Instance-aware (`target_qps_per_replica` as an accelerator map): capacity is
the sum of the replicas' accelerator QPS; the raw target adds replicas of the
fastest accelerator until capacity covers the QPS, or drops the
lowest-capacity replicas while the rest still cover it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controlplane.servicespec import ReplicaPolicy

QPS_WINDOW_SECONDS = 60
DECISION_INTERVAL_SECONDS = 20.0
NO_REPLICA_DECISION_INTERVAL_SECONDS = 5.0
#: A per-second request count above this is taken as this (see `qps`).
MAX_SECOND_COUNT = 10**9


@dataclass(frozen=True, kw_only=True)
class Decision:
    target: int  # replicas wanted, num_overprovision included
    raw: int  # this tick's raw target (clipped, without overprovision)
    signal: float  # QPS or total in-flight that produced `raw`
    window_min: int  # low level of the raw targets over the upscale window
    window_max: int  # high level of the raw targets over the downscale window
    reason: str  # fixed | hold | upscale | downscale | from_zero | demand | reset


def qps(rps: Mapping[int, int], now: float, window: int = QPS_WINDOW_SECONDS) -> float:
    """Requests per second over the last `window` whole seconds before `now`."""
    end = int(now)
    start = end - window
    # Counts come from Redis: a negative or absurd one (the store's decoder already
    # skips them) must not make QPS negative or overflow a float.
    total = sum(min(max(n, 0), MAX_SECOND_COUNT) for sec, n in rps.items() if start <= sec < end)
    return total / window


def instance_aware_target(
    demand_qps: float, replica_qps: Sequence[float], fastest_qps: float
) -> int:
    """Replica count whose capacity covers `demand_qps` (before clipping)."""
    capacity = sum(replica_qps)
    if demand_qps > capacity:
        return len(replica_qps) + math.ceil((demand_qps - capacity) / fastest_qps)
    kept = sorted(replica_qps)  # drop the lowest-capacity replicas first
    while kept and capacity - kept[0] >= demand_qps:
        capacity -= kept.pop(0)
    return len(kept)


def fallback_plan(
    policy: ReplicaPolicy, target: int, ready_spot: int, *, use_spot: bool
) -> tuple[int, int]:
    """(spot, on-demand) replicas for `target`: base on-demand always, plus (dynamic
    fallback) one on-demand for every wanted spot replica that is not READY."""
    if not use_spot:
        return 0, target
    base = min(policy.base_ondemand_fallback_replicas, target)
    spot = target - base
    extra = max(0, spot - ready_spot) if policy.dynamic_ondemand_fallback else 0
    return spot, base + extra


def _level(samples: list[int], *, low: bool) -> int:
    """The window's low (or high) level: min (max) once outliers are discarded."""
    ordered = sorted(samples)
    k = max(len(ordered) // 10, 1 if len(ordered) >= 3 else 0)
    return ordered[k] if low else ordered[-1 - k]


class Autoscaler:
    """Windowed-hysteresis autoscaler for one service; drive `decide()` with a clock."""

    def __init__(
        self,
        policy: ReplicaPolicy,
        *,
        now: float,
        current: int | None = None,
        interval: float = DECISION_INTERVAL_SECONDS,
        zero_interval: float = NO_REPLICA_DECISION_INTERVAL_SECONDS,
        qps_window: int = QPS_WINDOW_SECONDS,
    ) -> None:
        """`interval` / `zero_interval`: seconds between decisions (while the target is
        0); `qps_window`: the seconds QPS is averaged over (Sky Serve's 60 s)."""
        self._policy = policy
        self._interval = interval
        self._zero_interval = zero_interval
        self._qps_window = qps_window
        self._since = now  # observing continuously since
        self._history: deque[tuple[float, int]] = deque()
        self.current = policy.min_replicas if current is None else current

    @property
    def policy(self) -> ReplicaPolicy:
        return self._policy

    @property
    def autoscaling(self) -> bool:
        p = self._policy
        return (
            p.target_qps_per_replica is not None
            or p.target_ongoing_requests is not None
            or p.target_queue_length_per_replica is not None
            or p.target_kv_cache_usage_per_replica is not None
        )

    @property
    def interval(self) -> float:
        return self._zero_interval if self.current == 0 else self._interval

    def _clip(self, n: int) -> int:
        p = self._policy
        hi = p.max_replicas if p.max_replicas is not None else p.min_replicas
        return max(p.min_replicas, min(hi, n))

    def _clip_ceil(self, x: float) -> int:
        """`_clip(ceil(x))` for any float: NaN or below 0 is 0, huge or inf is the max
        (the signal comes from what proxies wrote)."""
        if not x > 0:
            return self._clip(0)
        p = self._policy
        hi = p.max_replicas if p.max_replicas is not None else p.min_replicas
        return self._clip(hi if x >= hi else math.ceil(x))

    def raw_target(
        self,
        *,
        rps: Mapping[int, int] | None,
        inflight: float | None,
        now: float,
        replica_qps: Sequence[float] = (),
        fastest_qps: float | None = None,
        queue: float | None = None,
        kv_usage: float | None = None,
    ) -> tuple[int, float]:
        p = self._policy
        if p.target_kv_cache_usage_per_replica is not None:
            used = float(kv_usage or 0.0)
            return self._clip(math.ceil(used / p.target_kv_cache_usage_per_replica - 1e-9)), used
        if p.target_queue_length_per_replica is not None:
            waiting = float(queue or 0.0)
            return self._clip(math.ceil(waiting / p.target_queue_length_per_replica)), waiting
        if p.target_ongoing_requests is not None:
            load = float(inflight or 0.0)
            return self._clip_ceil(load / p.target_ongoing_requests), load
        demand = qps(rps or {}, now, self._qps_window)
        match p.target_qps_per_replica:
            case dict():
                fastest = fastest_qps or max(p.target_qps_per_replica.values())
                if not demand < float(sum(replica_qps)) + fastest * (p.max_replicas or 0):
                    # Beyond what max_replicas can serve (or not a number): the max.
                    return self._clip_ceil(math.inf), demand
                return self._clip(instance_aware_target(demand, replica_qps, fastest)), demand
            case None:
                return self._clip(p.min_replicas), demand
            case per_replica:
                return self._clip_ceil(demand / float(per_replica)), demand

    def decide(
        self,
        now: float,
        *,
        rps: Mapping[int, int] | None = None,
        inflight: float | None = None,
        replica_qps: Sequence[float] = (),
        fastest_qps: float | None = None,
        queue: float | None = None,
        kv_usage: float | None = None,
    ) -> Decision:
        """One decision tick. `self.current` (without overprovision) is updated."""
        p = self._policy
        raw, signal = self.raw_target(
            rps=rps, inflight=inflight, now=now, replica_qps=replica_qps,
            fastest_qps=fastest_qps, queue=queue, kv_usage=kv_usage,
        )  # fmt: skip
        history = self._history
        history.append((now, raw))
        horizon = now - max(p.upscale_delay_seconds, p.downscale_delay_seconds)
        while history and history[0][0] < horizon:
            history.popleft()
        up = [r for t, r in history if t >= now - p.upscale_delay_seconds]
        down = [r for t, r in history if t >= now - p.downscale_delay_seconds]
        window_min, window_max = _level(up, low=True), _level(down, low=False)
        observed = now - self._since
        reason = "hold"
        if not self.autoscaling:
            self.current, reason = self._clip(p.min_replicas), "fixed"
        elif self.current == 0 and raw > 0:
            self.current, reason = raw, "from_zero"
        elif window_min > self.current and observed >= p.upscale_delay_seconds:
            self.current, reason = window_min, "upscale"
        elif window_max < self.current and observed >= p.downscale_delay_seconds:
            self.current, reason = window_max, "downscale"
        return Decision(
            target=self.target,
            raw=raw,
            signal=signal,
            window_min=window_min,
            window_max=window_max,
            reason=reason,
        )

    @property
    def target(self) -> int:
        """Replicas to run: the current target plus num_overprovision (0 stays 0)."""
        return self.current + self._policy.num_overprovision if self.current else 0

    def demand(self, now: float) -> Decision:
        """A proxy holds requests while there is no replica: scale from zero at once."""
        if self.current == 0:
            self.current = max(1, self._clip(1))
            self._history.clear()
            self._since = now
        return Decision(
            target=self.target,
            raw=self.current,
            signal=0.0,
            window_min=self.current,
            window_max=self.current,
            reason="demand",
        )

    def reset(
        self,
        policy: ReplicaPolicy,
        now: float,
        *,
        rps: Mapping[int, int] | None = None,
        inflight: float | None = None,
        queue: float | None = None,
        kv_usage: float | None = None,
    ) -> Decision:
        """An update: adopt the new policy and its computed target, forget the windows."""
        self._policy = policy
        self._history.clear()
        self._since = now
        raw, signal = self.raw_target(rps=rps, inflight=inflight, now=now, queue=queue,
                                      kv_usage=kv_usage)  # fmt: skip
        self.current = raw
        return Decision(
            target=self.target,
            raw=raw,
            signal=signal,
            window_min=raw,
            window_max=raw,
            reason="reset",
        )

    def describe(self) -> str:
        """The policy in words, for `sluice status`."""
        p = self._policy
        hi = p.max_replicas if p.max_replicas is not None else p.min_replicas
        if not self.autoscaling:
            return f"Fixed {p.min_replicas} replica{'s' if p.min_replicas != 1 else ''}"
        if p.target_kv_cache_usage_per_replica is not None:
            knob = f"target KV-cache usage per replica: {p.target_kv_cache_usage_per_replica:g}"
        elif p.target_queue_length_per_replica is not None:
            knob = f"target engine queue per replica: {p.target_queue_length_per_replica:g}"
        elif p.target_ongoing_requests is not None:
            knob = f"target ongoing requests per replica: {p.target_ongoing_requests:g}"
        elif isinstance(p.target_qps_per_replica, dict):
            table = ", ".join(f"{k}: {v:g}" for k, v in p.target_qps_per_replica.items())
            knob = f"target QPS per replica: {{{table}}}"
        else:
            knob = f"target QPS per replica: {float(p.target_qps_per_replica or 0):.1f}"
        return f"Autoscaling from {p.min_replicas} to {hi} replicas ({knob})"
