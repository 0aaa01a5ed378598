"""The `service:` section of a spec: readiness probe, replica policy, load balancer,
TLS and sluice's own options, with Sky Serve's defaults and cross-field rules.

Cross-field rules live in `__post_init__` and name the offending field by raising
`ValueError("field: what is wrong")`; msgspec appends where the struct sits and
`errors.translate` joins the two into one path.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from controlplane.servicespec.engines import EngineMetrics
from proxy.wire.policies import DEFAULT_POLICY, POLICY_NAMES

# Sky Serve's defaults (sky/serve/constants.py and the replica manager).
DEFAULT_MIN_REPLICAS = 1
DEFAULT_INITIAL_DELAY_SECONDS = 1200.0
DEFAULT_READINESS_TIMEOUT_SECONDS = 15.0
DEFAULT_PROBE_INTERVAL_SECONDS = 10.0
DEFAULT_FAILURE_THRESHOLD_TIMEOUT = 180.0
DEFAULT_UPSCALE_DELAY_SECONDS = 300.0
DEFAULT_DOWNSCALE_DELAY_SECONDS = 1200.0
DEFAULT_STREAM_TIMEOUT_SECONDS = 120.0
DEFAULT_LOAD_BALANCING_POLICY = DEFAULT_POLICY

INSTANCE_AWARE = "instance_aware_least_load"

EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Port = Annotated[int, Meta(ge=1, le=65535)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
# "A100", "H100:1", "A100-80GB:8": a name with an optional count.
AcceleratorKey = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*(:[0-9]+)?$")]
QpsMap = Annotated[dict[AcceleratorKey, PosFloat], Meta(min_length=1)]

class ReadinessProbe(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    path: str
    initial_delay_seconds: NonNegFloat = DEFAULT_INITIAL_DELAY_SECONDS
    timeout_seconds: PosFloat = DEFAULT_READINESS_TIMEOUT_SECONDS
    endpoint_probe_interval_seconds: PosFloat = DEFAULT_PROBE_INTERVAL_SECONDS
    consecutive_failure_threshold_timeout: NonNegFloat = DEFAULT_FAILURE_THRESHOLD_TIMEOUT
    # POST this JSON instead of a GET: an object, or a string holding JSON.
    post_data: dict[str, Any] | str | None = None
    headers: dict[str, str] = {}

    def __post_init__(self) -> None:
        _check_probe_path(self.path, "path")
        if isinstance(self.post_data, str):
            try:
                json.loads(self.post_data)
            except ValueError as exc:
                raise ValueError(f"post_data: not valid JSON ({exc})") from None

    @property
    def post_body(self) -> bytes | None:
        """The exact JSON body of a POST probe, or None for a GET probe."""
        match self.post_data:
            case None:
                return None
            case str() as text:
                return text.encode()
            case dict() as obj:
                return msgspec.json.encode(obj)


# The autoscaling targets, one at most (Sky Serve's first, then sluice's extensions).
_TARGETS = ("target_qps_per_replica", "target_ongoing_requests",
            "target_queue_length_per_replica", "target_kv_cache_usage_per_replica")  # fmt: skip


class ReplicaPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    min_replicas: NonNegInt
    max_replicas: NonNegInt | None = None  # None: fixed at min_replicas
    num_overprovision: NonNegInt = 0
    # One number, or a per-accelerator map (instance_aware_least_load only).
    target_qps_per_replica: PosFloat | QpsMap | None = None
    # sluice extension: autoscale on in-flight requests per replica.
    target_ongoing_requests: PosFloat | None = None
    # sluice extension: autoscale on the engines' own queues (requests waiting in the
    # model servers, scraped from their metrics; docs/engines.md).
    target_queue_length_per_replica: PosFloat | None = None
    # sluice extension: autoscale on the engines' KV-cache usage (0-1, mean per replica).
    target_kv_cache_usage_per_replica: Annotated[float, Meta(gt=0, le=1)] | None = None
    upscale_delay_seconds: NonNegFloat = DEFAULT_UPSCALE_DELAY_SECONDS
    downscale_delay_seconds: NonNegFloat = DEFAULT_DOWNSCALE_DELAY_SECONDS
    base_ondemand_fallback_replicas: NonNegInt = 0
    dynamic_ondemand_fallback: bool = False
    spot_placer: Literal["dynamic_fallback"] | None = None

    def __post_init__(self) -> None:
        targets = [name for name in _TARGETS if getattr(self, name) is not None]
        has_target = bool(targets)
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas: must be >= min_replicas ({self.min_replicas}), "
                f"got {self.max_replicas}"
            )
        if len(targets) > 1:
            raise ValueError(
                f"{targets[1]}: cannot be combined with {targets[0]}; "
                "choose one autoscaling signal"
            )
        if has_target and self.max_replicas is None:
            raise ValueError(f"max_replicas: must be set where {targets[0]} is set")
        if not has_target and self.max_replicas not in (None, self.min_replicas):
            raise ValueError(
                f"target_qps_per_replica: min_replicas ({self.min_replicas}) and "
                f"max_replicas ({self.max_replicas}) differ but no autoscaling target is set; "
                "set target_qps_per_replica (or target_ongoing_requests)"
            )

    @property
    def uses_ondemand_fallback(self) -> bool:
        return self.dynamic_ondemand_fallback or self.base_ondemand_fallback_replicas > 0

    def target_qps_for(self, accelerator: str | None) -> float | None:
        """Target QPS of one replica: the number, or its accelerator's entry.

        A map is looked up by the exact accelerator ("A100:1"), then by its
        base name ("A100"), as the proxy's instance-aware policy does.
        """
        match self.target_qps_per_replica:
            case None:
                return None
            case int() | float() as qps:
                return float(qps)
            case dict() as table:
                if accelerator is None:
                    return None
                found = table.get(accelerator)
                if found is None:
                    found = table.get(accelerator.split(":", 1)[0])
                return found
        return None


class LoadBalancer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    stream_timeout_seconds: PosFloat = DEFAULT_STREAM_TIMEOUT_SECONDS


class PrefixRouting(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`service.sluice.prefix`: options of the `prefix` policy (wire: PrefixOptions)."""

    block_bytes: Annotated[int, Meta(ge=16, le=65536)] = 256
    prefix_bytes: Annotated[int, Meta(ge=16, le=1 << 20)] = 16384
    session_header: Annotated[str, Meta(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]*$")] = "X-Session-Id"
    user_field: bool = False
    epsilon: PosFloat = 3.0
    spill_margin: Annotated[int, Meta(ge=0, le=1 << 20)] = 8
    lru_size: Annotated[int, Meta(ge=0, le=1 << 22)] = 16384
    placement: Literal["auto", "capacity", "rendezvous"] = "auto"
    replica_families: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    placement_ttl: Annotated[float, Meta(ge=1, le=86400)] = 300.0
    warm_copies: bool = True

    def __post_init__(self) -> None:
        if self.block_bytes > self.prefix_bytes:
            raise ValueError(f"block_bytes: must be <= prefix_bytes ({self.prefix_bytes}), "
                             f"got {self.block_bytes}")


class SluiceSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`service.sluice`: options only sluice reads (a Sky Serve YAML has none)."""

    prefix: PrefixRouting | None = None
    # Resume a stream cut by its replica on another one (proxy/resume.py, docs/resume.md).
    resume_streams: bool = False
    # The longest a leaving replica is kept while proxies still have requests on it
    # (None: the controller's --drain-seconds, 120 s by default).
    max_drain_seconds: Annotated[float, Meta(ge=0, le=86400)] | None = None
    engine_metrics: EngineMetrics = msgspec.field(default_factory=EngineMetrics)


class Tls(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    keyfile: str
    certfile: str


class ServiceSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # A bare path or a probe object; absent, "/" as in Sky Serve's code.
    readiness_probe: str | ReadinessProbe = "/"
    replicas: NonNegInt | None = None
    replica_policy: ReplicaPolicy | None = None
    load_balancing_policy: str = DEFAULT_LOAD_BALANCING_POLICY
    load_balancer: LoadBalancer = msgspec.field(default_factory=LoadBalancer)
    ports: Port | None = None
    tls: Tls | None = None
    sluice: SluiceSection | None = None

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replica_policy is not None:
            raise ValueError("replicas: cannot be combined with replica_policy; use one of them")
        if isinstance(self.readiness_probe, str):
            _check_probe_path(self.readiness_probe, "readiness_probe")
        policy = self.load_balancing_policy
        if policy not in POLICY_NAMES:
            raise ValueError(
                f"load_balancing_policy: unknown policy {policy!r}; "
                f"expected one of {', '.join(POLICY_NAMES)}"
            )
        if self.sluice is not None and self.sluice.prefix is not None and policy != "prefix":
            raise ValueError(
                "sluice.prefix: options of the prefix policy; set load_balancing_policy: "
                f"prefix (got {policy})"
            )
        # Sky Serve's rule, both ways: a map needs the instance-aware policy,
        # and that policy needs a map (a number or no target is an error).
        target = self.scaling.target_qps_per_replica
        if isinstance(target, dict) and policy != INSTANCE_AWARE:
            raise ValueError(
                "replica_policy.target_qps_per_replica: a per-accelerator map needs "
                f"load_balancing_policy: {INSTANCE_AWARE} (got {policy})"
            )
        if policy == INSTANCE_AWARE and not isinstance(target, dict):
            raise ValueError(
                f"load_balancing_policy: {INSTANCE_AWARE} needs "
                "replica_policy.target_qps_per_replica as a per-accelerator map, "
                f"e.g. {{A100: 5, H100: 10}}; got {target!r}"
            )

    @property
    def probe(self) -> ReadinessProbe:
        """The readiness probe in object form (a bare string is its path)."""
        match self.readiness_probe:
            case str() as path:
                return ReadinessProbe(path=path)
            case ReadinessProbe() as probe:
                return probe
        raise AssertionError("unreachable")

    @property
    def scaling(self) -> ReplicaPolicy:
        """The replica policy in object form: `replicas: N` is a fixed N."""
        if self.replica_policy is not None:
            return self.replica_policy
        count = DEFAULT_MIN_REPLICAS if self.replicas is None else self.replicas
        return ReplicaPolicy(min_replicas=count)



def _check_probe_path(path: str, field: str) -> None:
    if not path.startswith("/"):
        raise ValueError(f"{field}: the readiness path must start with '/', got {path!r}")

