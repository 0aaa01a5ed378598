"""The SkyPilot backend's pure parts: cluster names, the SkyPilot task of one replica,
and how a replica's handle reads in `sluice status` (Sky Serve's INFRA / RESOURCES).

The cluster is named `{namespace}.{service}-r{id}-v{version}` (`cluster_name`; the
namespace is the Redis prefix), within SkyPilot's cluster-name regex. The `.` makes
the name injective: neither part can hold one (both are slugs of `[a-z0-9-]`), so
namespace `sluice-prod` with service `llm` and namespace `sluice` with service
`prod-llm` never share a cluster (with `-` they did: issue 24). Clusters named the
old way (`{namespace}-{service}-...`, ambiguous by construction) are neither adopted
nor swept by name; the replicas recorded with them are still stopped through their
handles, which name the cluster. The task is
the user's service YAML minus `service:` (`task_config`); see skypilot.py.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import msgspec

from controlplane.records import Handle
from controlplane.servicespec import ServiceSpec

#: SkyPilot's cluster-name rule (sky.skylet.constants.CLUSTER_NAME_VALID_REGEX).
CLUSTER_NAME_RE = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")
_MAX_SLUG = 40  # keeps names short enough to read; SkyPilot shortens them per cloud itself
_TASK_KEYS = ("name", "run", "setup", "envs", "secrets", "workdir", "resources", "num_nodes",
              "file_mounts", "config", "volumes")  # fmt: skip



# -- names ---------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    """`text` within the cluster-name alphabet; a hash suffix when anything changed."""
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-").lower()
    if slug != text or len(slug) > _MAX_SLUG:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        slug = f"{slug[: _MAX_SLUG - 7]}-{digest}".strip("-")
    return slug


def cluster_prefix(namespace: str, service: str) -> str:
    """Every cluster of `service` starts with this (followed by `-r{id}-v{version}`);
    with service "" it is the namespace's own prefix, ending with the `.`."""
    ns = _slug(namespace) or "sluice"
    if not ns[0].isalpha():
        ns = f"s{ns}"
    return f"{ns}.{_slug(service)}"


def cluster_name(namespace: str, service: str, replica_id: int, version: int) -> str:
    """The cluster of one replica; matches SkyPilot's CLUSTER_NAME_RE."""
    return f"{cluster_prefix(namespace, service)}-r{replica_id}-v{version}"


def parse_cluster(prefix: str, name: str) -> tuple[int, int] | None:
    """(replica id, version) of a cluster named by `cluster_name` with `prefix`, else None."""
    m = re.fullmatch(rf"{re.escape(prefix)}-r([0-9]+)-v([0-9]+)", name)
    return (int(m[1]), int(m[2])) if m else None


def replica_url(endpoint: str) -> str:
    """The replica URL from a SkyPilot endpoint: `host:port` gets `http://`; a URL (a
    Kubernetes ingress endpoint with its path prefix) is kept as it is."""
    endpoint = endpoint.strip()
    if re.match(r"^https?://", endpoint):
        return endpoint.rstrip("/")
    return f"http://{endpoint}".rstrip("/")


# -- the task ------------------------------------------------------------------------------------


def location_of(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """(cloud, region, zone) of a resources entry or handle, as far as it says, lowercase."""
    infra = entry.get("infra")
    if isinstance(infra, str) and infra:
        parts = [p for p in infra.split("/") if p]
        if parts and parts[0].lower() in ("k8s", "kubernetes"):
            return ("kubernetes", *parts[1:2])
        return tuple(p.lower() for p in parts[:3])
    out: list[str] = []
    for part in (entry.get(k) for k in ("cloud", "region", "zone")):
        if not part:
            break
        out.append(str(part).lower())
    return tuple(out)


def _covers(entry: tuple[str, ...], place: tuple[str, ...]) -> bool:
    """True when a resources entry for `entry` could land in `place` (a preempted spot)."""
    return bool(entry) and place[: len(entry)] == entry


def task_config(
    spec: ServiceSpec,
    *,
    replica_id: int,
    port: int,
    on_demand: bool = False,
    base_dir: Path | None = None,
    avoid: Collection[tuple[str, ...]] = (),
) -> dict[str, Any]:
    """The SkyPilot task (YAML mapping) for one replica of `spec`; see the module docstring.

    `avoid`: locations where spot replicas were preempted; entries of
    `resources.ordered` there move to the end, entries of `resources.any_of` there
    are left out (nothing changes when every entry was preempted somewhere: Sky
    Serve's placer then starts over too).
    """
    raw: dict[str, Any] = {
        k: v for k, v in _plain(spec).items() if k in _TASK_KEYS and v not in (None, {}, [])
    }
    if raw.get("num_nodes") == 1:
        del raw["num_nodes"]
    resources: dict[str, Any] = {k: v for k, v in raw.get("resources", {}).items()
                                 if v is not None and k != "use_spot"}  # fmt: skip
    if spec.resources.use_spot:
        resources["use_spot"] = not on_demand
    ports = [str(p) for p in _as_list(resources.get("ports"))]
    if not any(_port_in(port, p) for p in ports):
        ports.insert(0, str(port))
    resources["ports"] = ports if len(ports) > 1 else int(ports[0]) if ports[0].isdigit() else ports
    for key in ("any_of", "ordered"):
        entries = resources.get(key)
        if not entries:
            continue
        entries = [dict(e) for e in entries]
        if on_demand:
            for entry in entries:
                if "use_spot" in entry:
                    entry["use_spot"] = False
        if avoid:
            fresh = [e for e in entries if not any(_covers(location_of(e), a) for a in avoid)]
            stale = [e for e in entries if e not in fresh]
            if fresh and stale:
                # `ordered`: the fresh locations first. `any_of` has no order, and SkyPilot
                # refuses `ordered` beside several accelerators: leave the stale ones out.
                entries = fresh + stale if key == "ordered" else fresh
        resources[key] = entries
    raw["resources"] = resources
    if spec.workdir is not None and base_dir is not None:
        raw["workdir"] = str(base_dir / spec.workdir)
    envs = dict(spec.envs)
    envs.setdefault("PORT", str(port))
    envs["SLUICE_REPLICA_ID"] = str(replica_id)
    envs["SKYPILOT_SERVE_REPLICA_ID"] = str(replica_id)
    raw["envs"] = envs
    return raw


def _plain(spec: ServiceSpec) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(spec)
    data.pop("service", None)
    return copy.deepcopy(data)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _port_in(port: int, spec: str) -> bool:
    lo, sep, hi = spec.partition("-")
    try:
        return int(lo) <= port <= int(hi if sep else lo)
    except ValueError:
        return False


# -- what `sluice status` shows -----------------------------------------------------------------


def infra_text(handle: Handle) -> str | None:
    """`AWS (us-east-1, us-east-1a)` from a handle, like Sky Serve's INFRA column."""
    cloud = handle.get("cloud")
    if not cloud:
        return None
    where = ", ".join(str(handle[k]) for k in ("region", "zone") if handle.get(k))
    return f"{cloud} ({where})" if where else str(cloud)


def resources_text(handle: Handle) -> str | None:
    """`1x[Spot](g6.xlarge, L4:1) $0.40/h` from a handle, like Sky Serve's RESOURCES column."""
    if not handle.get("cloud") and not handle.get("resources"):
        return None
    parts = [str(handle[k]) for k in ("instance_type", "accelerators") if handle.get(k)]
    spot = "[Spot]" if handle.get("spot") else ""
    text = f"1x{spot}({', '.join(parts)})" if parts else str(handle.get("resources") or "-")
    price = handle.get("price")
    if isinstance(price, int | float) and not isinstance(price, bool):
        text += f" ${price:.2f}/h"
    return text
