"""The service spec: a Sky Serve service YAML, parsed and validated.

A sluice spec is a Sky Serve service YAML as is: the `service:` section field
for field (Sky Serve's names, defaults and validation rules) plus the task
fields a replica backend needs. It is parsed into frozen msgspec Structs whose
shape mirrors the YAML, so every error names the YAML path of the field, e.g.
`$.service.replica_policy.max_replicas: must be >= min_replicas (2), got 1`.

Entry points: `load_spec(path_or_text)` and `parse_spec(mapping)`. They raise
one error type, `SpecError`; msgspec and YAML errors are translated there and
nowhere else. A parsed spec is stored in Redis as JSON (`to_json` /
`ServiceSpec.from_json`); `parse_spec` returns the JSON round trip of what it
validated, so the spec a caller holds equals the spec every reader decodes.

Cross-field rules live in `__post_init__` and name the offending field by
raising `ValueError("field: what is wrong")`; msgspec appends where the struct
sits and `_translate` joins the two into one path.

Top-level task keys, decided one by one:
- used by the local backend: `name`, `run`, `setup`, `envs`, `secrets`
  (both str -> str; numbers are stringified), `workdir` (a local path);
- kept for the SkyPilot backend, validated loosely: `resources`, `num_nodes`
  (must be 1, as in Sky Serve), `file_mounts`, `config`, `volumes`;
- rejected with a reason: see `_UNSUPPORTED` (cluster pools, SkyPilot-internal
  keys, experimental ones Sky Serve ignores); anything else is an unknown field.

Deliberate differences from Sky Serve: `target_qps_per_replica` must be > 0
(0 makes the autoscaler divide by zero); per-accelerator keys may hold hyphens
("A100-80GB:1"); multi-port `resources.ports` without `service.ports` is an
error but no port at all is fine (the local backend picks one and sets PORT);
`p2c` and `prefix` are extra policies, `target_ongoing_requests` an extra
autoscaling signal (concurrency, fed by the proxies), and `service.sluice`
holds sluice-only options (`service.sluice.prefix`: the prefix policy's); a
Sky Serve YAML never has it, and it is optional.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from proxy.wire.policies import POLICY_NAMES
from proxy.wire.snapshot import PrefixOptions

# Sky Serve's defaults (sky/serve/constants.py and the replica manager).
DEFAULT_MIN_REPLICAS = 1
DEFAULT_INITIAL_DELAY_SECONDS = 1200.0
DEFAULT_READINESS_TIMEOUT_SECONDS = 15.0
DEFAULT_PROBE_INTERVAL_SECONDS = 10.0
DEFAULT_FAILURE_THRESHOLD_TIMEOUT = 180.0
DEFAULT_UPSCALE_DELAY_SECONDS = 300.0
DEFAULT_DOWNSCALE_DELAY_SECONDS = 1200.0
DEFAULT_STREAM_TIMEOUT_SECONDS = 120.0
DEFAULT_LOAD_BALANCING_POLICY = "least_load"

INSTANCE_AWARE = "instance_aware_least_load"

# Service fields whose change never needs a new replica process: they steer
# the controller, the prober or the proxy. Every other field (service.ports
# and the whole task, including fields added later) forces replacement.
RELABEL_SAFE_SERVICE_FIELDS = frozenset(
    {
        "replicas",
        "replica_policy",
        "readiness_probe",
        "load_balancing_policy",
        "load_balancer",
        "tls",
        "sluice",
    }
)

_UNSUPPORTED: dict[str, str] = {
    "$.pool": "SkyPilot cluster pools are not services; sluice does not run them",
    "$.service.pool": "SkyPilot cluster pools are not services; sluice does not run them",
    "$.service.workers": "pool workers are not supported; use service.replicas",
    "$.inputs": "experimental SkyPilot field, unused by Sky Serve; remove it",
    "$.outputs": "experimental SkyPilot field, unused by Sky Serve; remove it",
    "$.event_callback": "not supported for services; remove it",
    "$.managed_secrets": "managed secrets are not supported; use secrets: {NAME: value}",
    "$.volume_mounts": "internal SkyPilot field; declare volumes under `volumes`",
    "$.file_mounts_mapping": "internal SkyPilot field; remove it",
    "$._metadata": "internal SkyPilot field; remove it",
    "$.api_server_access": "SkyPilot API server access is not supported; remove it",
}

EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Port = Annotated[int, Meta(ge=1, le=65535)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
# "A100", "H100:1", "A100-80GB:8": a name with an optional count.
AcceleratorKey = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*(:[0-9]+)?$")]
QpsMap = Annotated[dict[AcceleratorKey, PosFloat], Meta(min_length=1)]


class SpecError(ValueError):
    """An invalid spec. `path` is the YAML path, e.g. `$.service.replicas`."""

    def __init__(self, path: str, reason: str, *, source: str | None = None) -> None:
        self.path = path
        self.reason = reason
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}{path}: {reason}")


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


class ReplicaPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    min_replicas: NonNegInt
    max_replicas: NonNegInt | None = None  # None: fixed at min_replicas
    num_overprovision: NonNegInt = 0
    # One number, or a per-accelerator map (instance_aware_least_load only).
    target_qps_per_replica: PosFloat | QpsMap | None = None
    # sluice extension: autoscale on in-flight requests per replica.
    target_ongoing_requests: PosFloat | None = None
    upscale_delay_seconds: NonNegFloat = DEFAULT_UPSCALE_DELAY_SECONDS
    downscale_delay_seconds: NonNegFloat = DEFAULT_DOWNSCALE_DELAY_SECONDS
    base_ondemand_fallback_replicas: NonNegInt = 0
    dynamic_ondemand_fallback: bool = False
    spot_placer: Literal["dynamic_fallback"] | None = None

    def __post_init__(self) -> None:
        has_qps = self.target_qps_per_replica is not None
        has_target = has_qps or self.target_ongoing_requests is not None
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas: must be >= min_replicas ({self.min_replicas}), "
                f"got {self.max_replicas}"
            )
        if has_qps and self.target_ongoing_requests is not None:
            raise ValueError(
                "target_ongoing_requests: cannot be combined with target_qps_per_replica; "
                "choose one autoscaling signal"
            )
        if has_target and self.max_replicas is None:
            knob = "target_qps_per_replica" if has_qps else "target_ongoing_requests"
            raise ValueError(f"max_replicas: must be set where {knob} is set")
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
    """`service.sluice.prefix`: the `prefix` policy's options (wire: PrefixOptions)."""

    block_bytes: Annotated[int, Meta(ge=16, le=65536)] = 256
    prefix_bytes: Annotated[int, Meta(ge=16, le=1 << 20)] = 16384
    session_header: Annotated[str, Meta(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]*$")] = "X-Session-Id"
    user_field: bool = False
    epsilon: PosFloat = 1.0
    lru_size: Annotated[int, Meta(ge=0, le=1 << 22)] = 16384

    def __post_init__(self) -> None:
        if self.block_bytes > self.prefix_bytes:
            raise ValueError(f"block_bytes: must be <= prefix_bytes ({self.prefix_bytes}), "
                             f"got {self.block_bytes}")


class SluiceSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`service.sluice`: options only sluice reads (a Sky Serve YAML has none)."""

    prefix: PrefixRouting | None = None


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


PortSpec = int | str | list[int | str]


class Resources(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A task's `resources:`; sluice reads accelerators, use_spot and ports.

    The other SkyPilot keys are declared (so typos are caught) and kept
    verbatim for the SkyPilot backend.
    """

    accelerators: str | dict[str, int | float] | list[str] | None = None
    use_spot: bool = False
    ports: PortSpec | None = None
    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    infra: str | None = None
    cpus: str | int | float | None = None
    memory: str | int | float | None = None
    instance_type: str | None = None
    disk_size: str | int | None = None
    disk_tier: str | None = None
    network_tier: str | None = None
    image_id: str | dict[str, str] | None = None
    labels: dict[str, str] | None = None
    accelerator_args: dict[str, Any] | None = None
    job_recovery: str | dict[str, Any] | None = None
    autostop: Any = None
    any_of: list[dict[str, Any]] | None = None
    ordered: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        port_ranges(self.ports)  # raises ValueError("ports: ...")

    @property
    def port_count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in port_ranges(self.ports))


class ServiceSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    service: ServiceSection
    name: str | None = None  # the task's name; the CLI's -n names the service
    run: str | None = None
    setup: str | None = None
    envs: dict[EnvName, str] = {}
    secrets: dict[EnvName, str] = {}
    workdir: str | None = None
    resources: Resources = msgspec.field(default_factory=Resources)
    num_nodes: int = 1
    file_mounts: dict[str, Any] = {}
    config: dict[str, Any] = {}
    volumes: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if self.num_nodes != 1:
            raise ValueError(
                f"num_nodes: a service replica runs on one node (got {self.num_nodes}); "
                "multi-node replicas are not supported, as in Sky Serve"
            )
        scaling = self.service.scaling
        if scaling.uses_ondemand_fallback and not self.resources.use_spot:
            knob = (
                "dynamic_ondemand_fallback"
                if scaling.dynamic_ondemand_fallback
                else "base_ondemand_fallback_replicas"
            )
            raise ValueError(
                f"service.replica_policy.{knob}: on-demand fallback is for spot replicas; "
                "set resources.use_spot: true"
            )
        if scaling.spot_placer is not None and not self.resources.use_spot:
            raise ValueError(
                "service.replica_policy.spot_placer: needs spot replicas; "
                "set resources.use_spot: true"
            )
        if self.service.ports is None and self.resources.port_count > 1:
            raise ValueError(
                "resources.ports: a replica serves on one port; with several ports "
                "set service.ports to the one it serves on"
            )

    # Shortcuts the controller and the prober read.
    @property
    def prefix_options(self) -> PrefixOptions | None:
        """The prefix policy's options for the snapshot; None with another policy."""
        if self.service.load_balancing_policy != "prefix":
            return None
        sluice = self.service.sluice
        given = sluice.prefix if sluice is not None else None
        return PrefixOptions(**msgspec.structs.asdict(given or PrefixRouting()))

    @property
    def min_replicas(self) -> int:
        return self.service.scaling.min_replicas

    @property
    def max_replicas(self) -> int:
        """The upper bound; equals min_replicas when not autoscaling."""
        scaling = self.service.scaling
        return scaling.min_replicas if scaling.max_replicas is None else scaling.max_replicas

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas != self.min_replicas

    @property
    def probe(self) -> ReadinessProbe:
        return self.service.probe

    @property
    def readiness_path(self) -> str:
        return self.service.probe.path

    @property
    def replica_port(self) -> int | None:
        """The port a replica serves on: service.ports, else the single
        resources port; None lets the backend choose (local: env PORT)."""
        if self.service.ports is not None:
            return self.service.ports
        ranges = port_ranges(self.resources.ports)
        return ranges[0][0] if ranges else None

    def to_json(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> ServiceSpec:
        """Decode a stored spec; it is validated again, errors are SpecError."""
        try:
            return _DECODER.decode(data)
        except msgspec.ValidationError as exc:
            raise _translate(str(exc), None, "stored spec") from exc
        except msgspec.DecodeError as exc:
            raise SpecError("$", f"not valid JSON ({exc})", source="stored spec") from exc


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(ServiceSpec)


def is_count_only_change(old: ServiceSpec, new: ServiceSpec) -> bool:
    """True when `new` can reuse `old`'s replicas by relabelling them.

    The rule: every field of the two specs is equal except the `name` and the
    service fields in RELABEL_SAFE_SERVICE_FIELDS, which are replicas /
    replica_policy (counts, targets, delays, spot fallback), readiness_probe
    (the prober applies the new probe to the reused replicas, exactly as it
    would to fresh ones running the same task), load_balancing_policy and
    load_balancer (the proxy's), and tls (the proxy's endpoint; Sky Serve
    talks plain HTTP to replicas). Any other difference forces replacement:
    run, setup, envs, secrets, workdir, resources, num_nodes, file_mounts,
    config, volumes and service.ports (the port the replica process serves
    on), and any field added later unless it is listed as relabel-safe.
    Identical specs are a count-only change: nothing to replace.

    The comparison is by value: new code under an unchanged `workdir` path,
    or new contents behind unchanged `file_mounts`, is not seen here (Sky
    Serve replaces replicas whenever file_mounts are non-empty, which is why
    its count-only updates replace everything); change an env or the run
    command to roll such code out.
    """
    if old == new:
        return True
    for field in msgspec.structs.fields(ServiceSpec):
        if field.name in ("name", "service"):
            continue
        if getattr(old, field.name) != getattr(new, field.name):
            return False
    for field in msgspec.structs.fields(ServiceSection):
        if field.name in RELABEL_SAFE_SERVICE_FIELDS:
            continue
        if getattr(old.service, field.name) != getattr(new.service, field.name):
            return False
    return True


def port_ranges(ports: PortSpec | None) -> tuple[tuple[int, int], ...]:
    """`resources.ports` as inclusive ranges: 8080, "8080", "8000-8010" or a list."""
    match ports:
        case None:
            return ()
        case bool():
            raise ValueError(f"ports: expected a port or a range like '8000-8010', got {ports!r}")
        case int() as port:
            return (_port_range(port, port, ports),)
        case str() as text:
            lo, sep, hi = text.strip().partition("-")
            try:
                first = int(lo)
                last = int(hi) if sep else first
            except ValueError:
                raise ValueError(
                    f"ports: expected a port or a range like '8000-8010', got {ports!r}"
                ) from None
            return (_port_range(first, last, ports),)
        case list() as items:
            return tuple(r for item in items for r in port_ranges(item))
    raise ValueError(f"ports: expected a port or a range like '8000-8010', got {ports!r}")


def _port_range(first: int, last: int, given: object) -> tuple[int, int]:
    if not (1 <= first <= last <= 65535):
        raise ValueError(f"ports: ports must be within 1-65535 and ranges ascending, got {given!r}")
    return first, last


def _check_probe_path(path: str, field: str) -> None:
    if not path.startswith("/"):
        raise ValueError(f"{field}: the readiness path must start with '/', got {path!r}")


# ---------------------------------------------------------------------------
# The boundary: YAML text or a mapping in, a ServiceSpec or one SpecError out.


def load_spec(
    path_or_text: str | os.PathLike[str],
    *,
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> ServiceSpec:
    """Load a service YAML from a file or from YAML text.

    A PathLike is always a file. A str is YAML text when it holds a newline
    or starts with "{" (flow style), otherwise a file path. `envs` and
    `secrets` override the YAML's (the CLI's --env / --secret), see `parse_spec`.
    """
    if isinstance(path_or_text, str) and (
        "\n" in path_or_text or path_or_text.lstrip().startswith("{")
    ):
        text, source = path_or_text, None
    else:
        source = os.fspath(path_or_text)
        try:
            with open(os.path.expanduser(source), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError("$", f"cannot read the file ({exc})", source=source) from exc
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as exc:
        raise SpecError("$", _yaml_reason(exc), source=source) from exc
    except RecursionError as exc:
        raise SpecError("$", "invalid YAML: nested too deeply", source=source) from exc
    return parse_spec(data, source=source, envs=envs, secrets=secrets)


def parse_spec(
    mapping: Mapping[str, Any],
    *,
    source: str | None = None,
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> ServiceSpec:
    """Validate a parsed service YAML (a mapping) into a ServiceSpec.

    As SkyPilot's `Task.from_yaml_config`: `envs` / `secrets` (the CLI's --env,
    --secret) override the YAML's entries of the same name (so a YAML may leave
    a value empty for the command line to fill), then `$VAR` / `${VAR}` in
    `service`, `file_mounts`, `workdir` and `volumes` are replaced by the
    value of that env or secret (`fill_in_env_vars`).
    """
    if not isinstance(mapping, Mapping):
        kind = "nothing" if mapping is None else type(mapping).__name__
        raise SpecError(
            "$",
            f"expected a mapping (a service YAML with a `service:` section), got {kind}",
            source=source,
        )
    data = dict(mapping)
    _reject_unsupported(data, source)
    for key, overrides in (("envs", envs), ("secrets", secrets)):
        if overrides and (data.get(key) is None or isinstance(data.get(key), Mapping)):
            data[key] = {**(data.get(key) or {}), **overrides}
        if isinstance(data.get(key), Mapping):
            data[key] = _env_values(data[key], key, source)
    values = {
        name: value
        for key in ("envs", "secrets")  # a secret wins over an env of the same name
        if isinstance(data.get(key), Mapping)
        for name, value in data[key].items()
        if isinstance(name, str) and isinstance(value, str)
    }
    for key in _SUBSTITUTED:
        if data.get(key) is not None and values:
            data[key] = fill_in_env_vars(data[key], values)
    try:
        spec = msgspec.convert(data, ServiceSpec)
        # Normalise through JSON (what Redis holds), e.g. YAML dates in
        # free-form sections become strings, so stored == returned.
        return _DECODER.decode(_ENCODER.encode(spec))
    except msgspec.ValidationError as exc:
        raise _translate(str(exc), data, source) from exc
    except (TypeError, msgspec.EncodeError) as exc:
        raise SpecError("$", f"cannot be stored as JSON ({exc})", source=source) from exc


#: Sections where `$VAR` is replaced, as in SkyPilot's Task.from_yaml_config.
_SUBSTITUTED = ("file_mounts", "service", "workdir", "volumes")
# SkyPilot's pattern (sky/task.py `_fill_in_env_vars`), ASCII as its JSON text is.
_ENV_VAR = re.compile(r"\$\{?\b([a-zA-Z_][a-zA-Z0-9_]*)\b\}?", re.ASCII)


def fill_in_env_vars(value: Any, values: Mapping[str, str]) -> Any:
    """`value` with `$NAME` and `${NAME}` replaced by `values[NAME]` in every string
    (mapping keys too); names not in `values` are left as they are.

    SkyPilot 0.14.1 (`sky/task.py`, `_fill_in_env_vars`) runs the same regex over
    the section dumped as JSON text and parses the result back, which breaks on a
    value holding a quote or a backslash; replacing inside each string gives the
    same result without that failure.
    """
    match value:
        case str():
            return _ENV_VAR.sub(lambda m: values.get(m[1], m[0]), value)
        case Mapping():
            return {
                fill_in_env_vars(k, values) if isinstance(k, str) else k: fill_in_env_vars(
                    v, values
                )
                for k, v in value.items()
            }
        case list():
            return [fill_in_env_vars(item, values) for item in value]
    return value


def _reject_unsupported(data: dict[str, Any], source: str | None) -> None:
    service = data.get("service")
    keys = [f"$.{k}" for k in data]
    if isinstance(service, Mapping):
        keys += [f"$.service.{k}" for k in service]
    for path in keys:
        if path in _UNSUPPORTED:
            raise SpecError(path, _UNSUPPORTED[path], source=source)


def _env_values(envs: Mapping[Any, Any], key: str, source: str | None) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, value in envs.items():
        path = f"$.{key}.{name}"
        match value:
            case None:
                raise SpecError(path, "has no value; give it one in the YAML", source=source)
            case bool():
                raise SpecError(
                    path, f"is a boolean; quote it ('{str(value).lower()}')", source=source
                )
            case int() | float():
                out[name] = str(value)
            case _:
                out[name] = value
    return out


_AT = re.compile(r"^(?P<reason>.*?)(?: - at `(?:key` in `)?(?P<path>\$[^`]*)`)?$", re.DOTALL)
_FIELD_PREFIX = re.compile(
    r"^(?P<field>[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*): (?P<rest>.*)$", re.DOTALL
)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")


def _translate(message: str, data: Any, source: str | None) -> SpecError:
    """Turn msgspec's "what - at `$.path`" into SpecError(path, reason)."""
    m = _AT.match(message)
    assert m is not None  # the pattern matches any string
    reason, path = m["reason"], m["path"] or "$"
    is_key = " - at `key` in `" in message
    if field := _FIELD_PREFIX.match(reason):  # a __post_init__ naming its field
        return SpecError(f"{path}.{field['field']}", field["rest"], source=source)
    if unknown := _UNKNOWN.match(reason):
        name = unknown["name"]
        fields = _fields_at(path)
        hint = difflib.get_close_matches(name, fields, n=1)
        suggestion = (
            f"did you mean `{hint[0]}`?" if hint else f"expected one of: {', '.join(fields)}"
        )
        return SpecError(f"{path}.{name}", f"unknown field; {suggestion}", source=source)
    if missing := _MISSING.match(reason):
        return SpecError(f"{path}.{missing['name']}", "required field is missing", source=source)
    if is_key:
        return SpecError(_bad_key_path(data, path, reason), f"invalid key: {reason}", source=source)
    if path.endswith("[...]"):
        path = _bad_value_path(data, path, reason)
    if reason.startswith("Expected") and ", got " not in reason:
        value = _value_at(data, path)
        if value is not _MISSING_VALUE:
            reason = f"{reason}, got {value!r}"
    return SpecError(path, reason, source=source)


_MISSING_VALUE = object()


def _value_at(data: Any, path: str) -> Any:
    """The input value at a simple `$.a.b` path, for messages."""
    node = data
    for part in path.split(".")[1:]:
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING_VALUE
        node = node[part]
    return node


_JSON_KIND = {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}


def _bad_key_path(data: Any, path: str, reason: str) -> str:
    """Name the first key of the mapping at `path` that fails msgspec's regex."""
    mapping = _value_at(data, path)
    pattern = re.search(r"matching regex '(.*)'$", reason)
    if isinstance(mapping, Mapping) and pattern:
        for key in mapping:
            if not isinstance(key, str) or not re.search(pattern[1], key):
                return f"{path}.{key}"
    return path


def _bad_value_path(data: Any, path: str, reason: str) -> str:
    """Replace msgspec's `[...]` (some dict value) by the first key whose
    value has the wrong kind, e.g. `$.service.readiness_probe.headers.X`."""
    mapping = _value_at(data, path.removesuffix("[...]"))
    got = re.search(r", got `(\w+)`$", reason)
    if isinstance(mapping, Mapping) and got:
        for key, value in mapping.items():
            kind = "null" if value is None else _JSON_KIND.get(type(value))
            if kind == got[1]:
                return f"{path.removesuffix('[...]')}.{key}"
    return path


def _fields_at(path: str) -> list[str]:
    """Field names of the struct at a `$.a.b` path of ServiceSpec."""
    cls: type[msgspec.Struct] | None = ServiceSpec
    for part in path.split(".")[1:]:
        if cls is None:
            return []
        by_name = {f.name: f.type for f in msgspec.structs.fields(cls)}
        cls = _struct_in(by_name.get(part))
    return [] if cls is None else [f.name for f in msgspec.structs.fields(cls)]


def _struct_in(tp: Any) -> type[msgspec.Struct] | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    for arg in typing.get_args(tp):
        if (found := _struct_in(arg)) is not None:
            return found
    return None


_MAX_YAML_VALUES = 100_000


def _load_yaml(text: str) -> Any:
    """safe_load, refusing what PyYAML lets through: duplicate keys (it keeps
    the last), aliases that contain themselves, alias bombs."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        _check_node(root, set(), {})
    return yaml.safe_load(text)


def _check_node(node: yaml.Node, active: set[int], sizes: dict[int, int]) -> int:
    """Raise on a bad node below `node`; return its value count, aliases expanded."""
    if id(node) in sizes:  # an alias to a node already checked
        return sizes[id(node)]
    if id(node) in active:
        raise yaml.MarkedYAMLError(problem="an alias contains itself", problem_mark=node.start_mark)
    active.add(id(node))
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen: set[tuple[str, str]] = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if (key.tag, key.value) in seen:
                    raise yaml.MarkedYAMLError(
                        problem=f"duplicate key {key.value!r}", problem_mark=key.start_mark
                    )
                seen.add((key.tag, key.value))
            size += _check_node(key, active, sizes) + _check_node(value, active, sizes)
    elif isinstance(node, yaml.SequenceNode):
        size += sum(_check_node(item, active, sizes) for item in node.value)
    active.discard(id(node))
    if size > _MAX_YAML_VALUES:
        raise yaml.MarkedYAMLError(
            problem=f"more than {_MAX_YAML_VALUES} values once aliases are expanded",
            problem_mark=node.start_mark,
        )
    sizes[id(node)] = size
    return size


def _yaml_reason(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = ", ".join(str(part) for part in (exc.context, exc.problem) if part)
        return f"invalid YAML: {what} (line {mark.line + 1}, column {mark.column + 1})"
    return f"invalid YAML: {exc}"
