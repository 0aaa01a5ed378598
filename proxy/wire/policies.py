"""The load-balancing policy names a ReadySnapshot's `policy` field may carry.

The service spec validates `load_balancing_policy` against them and the proxy maps
each one to its implementation (proxy/policies.py `POLICIES`, checked to match at import).
"""

from __future__ import annotations

#: Every policy the proxy implements, in the order the docs list them.
POLICY_NAMES: tuple[str, ...] = (
    "least_load",
    "round_robin",
    "instance_aware_least_load",
    "p2c",
    "prefix",
)

#: The policy of a service or proxy that names none.
DEFAULT_POLICY = "least_load"
