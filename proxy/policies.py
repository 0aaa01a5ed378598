"""Load-balancing policies, registered by name in one literal dict.

A policy is pure and synchronous: it chooses from the current replicas and
their in-flight counts, with no I/O and no logging. Tables it needs (shuffled
order, per-accelerator weights) are built in `update()`, which the ready set
calls once per applied snapshot, never per request.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.errors import ConfigError
from proxy.interfaces import Policy, ReplicaView, Routable
from proxy.prefix import PrefixPolicy
from proxy.wire.policies import POLICY_NAMES
from proxy.wire.snapshot import PrefixOptions


class LeastLoad:
    """Fewest in-flight requests (plus the engine's queue with --engine-load); ties broken
    by a rotating start index."""

    name = "least_load"
    body_prefix = 0

    def __init__(self) -> None:
        self._replicas: Sequence[ReplicaView] = ()
        self._next = 0

    def update(self, replicas: Sequence[ReplicaView]) -> None:
        self._replicas = tuple(replicas)
        self._next = 0  # the rotation index must stay inside the new list

    def choose(self, exclude: set[ReplicaView] | None,
               request: Routable | None = None) -> ReplicaView | None:
        replicas = self._replicas
        n = len(replicas)
        if n == 0:
            return None
        start = self._next
        self._next = start + 1 if start + 1 < n else 0
        best: ReplicaView | None = None
        best_load = 1 << 62
        for i in range(n):
            j = start + i
            r = replicas[j if j < n else j - n]
            if exclude is not None and r in exclude:
                continue
            load = r.inflight + r.engine_queue
            if load < best_load:
                best = r
                best_load = load
                if load == 0:
                    break
        return best


class RoundRobin:
    """Cycle through the replicas; the order is reshuffled on every set change."""

    name = "round_robin"
    body_prefix = 0

    def __init__(self) -> None:
        self._order: list[ReplicaView] = []
        self._next = 0

    def update(self, replicas: Sequence[ReplicaView]) -> None:
        order = list(replicas)
        random.shuffle(order)
        self._order = order
        self._next = 0

    def choose(self, exclude: set[ReplicaView] | None,
               request: Routable | None = None) -> ReplicaView | None:
        order = self._order
        n = len(order)
        for _ in range(n):
            i = self._next
            self._next = i + 1 if i + 1 < n else 0
            r = order[i]
            if exclude is None or r not in exclude:
                return r
        return None


class InstanceAwareLeastLoad:
    """In-flight divided by the replica accelerator's target QPS (1.0 when unknown).

    The weight is resolved when the snapshot is applied: the replica's own
    `target_qps` if the controller set it, else the `--target-qps` map looked
    up as Sky Serve does (exact accelerator name, then a key whose count is
    stripped: "A100:1" in the map matches a replica on "A100"), then by the
    replica's base name ("A100:1" -> "A100"), which Sky does not try.
    """

    name = "instance_aware_least_load"
    body_prefix = 0

    def __init__(self, target_qps: dict[str, float] | None = None) -> None:
        self._target_qps = dict(target_qps or {})
        self._replicas: tuple[ReplicaView, ...] = ()
        self._weights: tuple[float, ...] = ()
        self._next = 0

    def weight_of(self, replica: ReplicaView) -> float:
        if replica.target_qps is not None and replica.target_qps > 0:
            return replica.target_qps
        acc = replica.accelerator
        if acc:
            table = self._target_qps
            qps = table.get(acc)
            if qps is None:
                qps = next((v for k, v in table.items() if k.split(":", 1)[0] == acc), None)
            if qps is None:
                qps = table.get(acc.split(":", 1)[0])
            if qps is not None and qps > 0:
                return qps
        return 1.0

    def update(self, replicas: Sequence[ReplicaView]) -> None:
        self._replicas = tuple(replicas)
        self._weights = tuple(self.weight_of(r) for r in self._replicas)
        self._next = 0  # the rotation index must stay inside the new list

    def choose(self, exclude: set[ReplicaView] | None,
               request: Routable | None = None) -> ReplicaView | None:
        replicas = self._replicas
        weights = self._weights
        n = len(replicas)
        if n == 0:
            return None
        start = self._next
        self._next = start + 1 if start + 1 < n else 0
        best: ReplicaView | None = None
        best_load = float("inf")
        for i in range(n):
            j = start + i
            if j >= n:
                j -= n
            r = replicas[j]
            if exclude is not None and r in exclude:
                continue
            load = r.inflight / weights[j]
            if load < best_load:
                best = r
                best_load = load
        return best


class PowerOfTwoChoices:
    """Pick two distinct replicas at random; take the one with fewer in flight."""

    name = "p2c"
    body_prefix = 0

    def __init__(self) -> None:
        self._replicas: tuple[ReplicaView, ...] = ()
        self._rand = random.Random()

    def update(self, replicas: Sequence[ReplicaView]) -> None:
        self._replicas = tuple(replicas)

    def choose(self, exclude: set[ReplicaView] | None,
               request: Routable | None = None) -> ReplicaView | None:
        replicas = self._replicas
        if exclude:
            replicas = tuple(r for r in replicas if r not in exclude)
        n = len(replicas)
        if n == 0:
            return None
        if n == 1:
            return replicas[0]
        i, j = self._rand.sample(range(n), 2)
        a, b = replicas[i], replicas[j]
        return a if a.inflight + a.engine_queue <= b.inflight + b.engine_queue else b


POLICIES: dict[str, type[LeastLoad | RoundRobin | InstanceAwareLeastLoad | PowerOfTwoChoices
                         | PrefixPolicy]] = {
    "least_load": LeastLoad,
    "round_robin": RoundRobin,
    "instance_aware_least_load": InstanceAwareLeastLoad,
    "p2c": PowerOfTwoChoices,
    "prefix": PrefixPolicy,
}
if tuple(POLICIES) != POLICY_NAMES:  # pragma: no cover - a contract edit missed one side
    raise ImportError(f"proxy/policies.py implements {tuple(POLICIES)}, "
                      f"proxy/wire/policies.py names {POLICY_NAMES}")


def make_policy(name: str, target_qps: dict[str, float] | None = None,
                prefix: PrefixOptions | None = None) -> Policy:
    """Build a policy by name; an unknown name is a ConfigError listing the valid ones."""
    match name:
        case "instance_aware_least_load":
            return InstanceAwareLeastLoad(target_qps)
        case "prefix":
            return PrefixPolicy(prefix, fallback=LeastLoad())
        case "least_load" | "round_robin" | "p2c":
            return POLICIES[name]()  # type: ignore[call-arg]
        case _:
            valid = ", ".join(sorted(POLICIES))
            raise ConfigError(f"unknown load balancing policy {name!r}; valid: {valid}")
