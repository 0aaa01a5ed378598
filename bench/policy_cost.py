"""What one policy decision costs: `ReadySet.choose` for least_load, p2c and prefix on 4
replicas and 64 chat bodies sharing 24 system prompts (the prefix key is computed fresh
for every call), best of 5 rounds of 20,000 calls. Nothing is asserted. `prefix` is
`placement: auto`, which without Redis is rendezvous; `prefix/capacity` routes with the
placement table, as a proxy on Redis does.

    python bench/policy_cost.py
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.readyset import ReadySet
from proxy.wire.snapshot import PrefixOptions, ReadyReplica, ReadySnapshot


class Req:
    def __init__(self, body: bytes) -> None:
        self.req_headers: list[tuple[bytes, bytes]] = []
        self.body = [body]
        self.route_key: tuple[int, ...] | None = None
        self.outcome: list[int] | None = None
        self.cold = False
        self.warms: object = None
        self.body_done = True  # the whole body is here (warm copies may use it)
        self.prewarm: object = None


def run(policy: str, bodies: list[bytes], n: int = 20000) -> float:
    """`policy` may name a prefix placement: `prefix/rendezvous`."""
    policy, _, placement = policy.partition("/")
    options = PrefixOptions(placement=placement) if placement else None
    ready = ReadySet()
    replicas = [ReadyReplica(id=i, url=f"http://10.0.0.{i}:8000", version=1) for i in range(1, 5)]
    ready.apply(ReadySnapshot(service="s", generation=1, published_at=0.0, status="READY",
                              policy=policy, active_versions=[1], replicas=replicas,
                              prefix_options=options))
    requests = [Req(b) for b in bodies]
    for r in ready.replicas:
        r.inflight = random.randint(0, 3)
    started = time.perf_counter()
    for i in range(n):
        request = requests[i % len(requests)]
        request.route_key = None
        ready.choose(None, request)
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    rng = random.Random(1)
    bodies = []
    for i in range(64):
        system = f"You are agent {rng.randrange(24)}. " + "policy refund order account " * 60
        bodies.append(json.dumps({"model": "m", "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}
        ).encode())  # fmt: skip
    for policy in ("least_load", "p2c", "prefix", "prefix/rendezvous", "prefix/capacity"):
        best = min(run(policy, bodies) for _ in range(5))
        print(f"{policy:>17}: {best:.2f} us per decision (best of 5 x 20,000)")


if __name__ == "__main__":
    main()
