"""Sky Serve compatibility rules: which keys a Sky Serve YAML may hold that sluice
refuses (and why), and which service fields an update may change without replacing
a replica (`is_count_only_change`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from controlplane.servicespec.errors import SpecError
from controlplane.servicespec.schema import ServiceSpec
from controlplane.servicespec.service import ServiceSection

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

UNSUPPORTED: dict[str, str] = {
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


def reject_unsupported(data: dict[str, Any], source: str | None) -> None:
    service = data.get("service")
    keys = [f"$.{k}" for k in data]
    if isinstance(service, Mapping):
        keys += [f"$.service.{k}" for k in service]
    for path in keys:
        if path in UNSUPPORTED:
            raise SpecError(path, UNSUPPORTED[path], source=source)


