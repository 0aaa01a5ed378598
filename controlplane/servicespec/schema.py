"""The whole spec: `ServiceSpec` (the `service:` section plus the task fields a replica
backend needs), the task's `resources:`, port ranges, and the JSON codec of a stored spec.

Top-level task keys, decided one by one:
- used by the local backend: `name`, `run`, `setup`, `envs`, `secrets`
  (both str -> str; numbers are stringified), `workdir` (a local path);
- kept for the SkyPilot backend, validated loosely: `resources`, `num_nodes`
  (>= 1; more than one is for the SkyPilot backend only, see `backends.fit`),
  `file_mounts`, `config`, `volumes`;
- rejected with a reason: see `skyserve_rules.UNSUPPORTED` (cluster pools, SkyPilot-internal
  keys, experimental ones Sky Serve ignores); anything else is an unknown field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from controlplane.servicespec.errors import SpecError, translate
from controlplane.servicespec.service import (
    EnvName,
    NonNegFloat,
    PrefixRouting,
    ReadinessProbe,
    ServiceSection,
)
from proxy.wire.snapshot import PrefixOptions

PortSpec = int | str | list[int | str]


class Resources(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A task's `resources:`; sluice reads accelerators, use_spot and ports.

    The other SkyPilot keys are declared (so typos are caught) and kept
    verbatim for the SkyPilot backend.
    """

    # "L4:1", {L4: 1}, {L4:1, A10G:1} (YAML reads these as keys with null counts, as
    # SkyPilot's schema allows), or a list of names: SkyPilot's choices.
    accelerators: str | dict[str, NonNegFloat | None] | list[str] | None = None
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

    def check_for_service(self) -> None:
        """Sky Serve's rules on a service's resources (serve_utils.validate_service_task):
        every choice spot or none, and no job_recovery (preempted replicas are replaced)."""
        choices = [*(self.any_of or ()), *(self.ordered or ())] or [{}]
        if self.job_recovery is not None or any("job_recovery" in c for c in choices):
            raise ValueError(
                "resources.job_recovery: not for services; the controller replaces a "
                "preempted or failed replica itself"
            )
        spot = {bool(c.get("use_spot", self.use_spot)) for c in choices}
        if len(spot) > 1:
            raise ValueError(
                "resources.any_of: every choice must use spot or none; to mix spot and "
                "on-demand replicas use replica_policy.dynamic_ondemand_fallback or "
                "base_ondemand_fallback_replicas"
            )

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
    # Nodes per replica (SkyPilot runs a replica as a cluster and its head node
    # serves); the local backend runs one process per replica (`backends.fit`).
    num_nodes: Annotated[int, Meta(ge=1)] = 1
    file_mounts: dict[str, Any] = {}
    config: dict[str, Any] = {}
    volumes: dict[str, Any] = {}

    def __post_init__(self) -> None:
        self.resources.check_for_service()
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
        port = self.service.ports
        opened = port_ranges(self.resources.ports)
        if port is not None and opened and not any(lo <= port <= hi for lo, hi in opened):
            raise ValueError(
                f"service.ports: the replica's port {port} is not among resources.ports; "
                "add it there (or leave resources.ports out)"
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
    def resume_streams(self) -> bool:
        """`service.sluice.resume_streams`: proxies resume streams cut by a replica."""
        sluice = self.service.sluice
        return sluice is not None and sluice.resume_streams

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
            raise translate(str(exc), None, "stored spec", ServiceSpec) from exc
        except msgspec.DecodeError as exc:
            raise SpecError("$", f"not valid JSON ({exc})", source="stored spec") from exc


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(ServiceSpec)

def round_trip(spec: ServiceSpec) -> ServiceSpec:
    """`spec` through JSON (what Redis holds), e.g. YAML dates in free-form sections
    become strings, so stored == returned. Raises msgspec's and TypeError."""
    return _DECODER.decode(_ENCODER.encode(spec))


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
