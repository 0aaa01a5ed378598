"""Which replicas the engine scraper reads after a reconcile step: the READY ones with a
URL, on their version's `service.sluice.engine_metrics` (none when it is disabled)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

from controlplane.engines.scraper import ScrapeTarget
from controlplane.records import ReplicaRecord
from controlplane.servicespec import ServiceSpec
from controlplane.servicespec.engines import EngineMetrics
from controlplane.states import ReplicaStatus

_DEFAULT = EngineMetrics()


def scrape_targets(
    replicas: Iterable[ReplicaRecord], specs: Mapping[int, ServiceSpec]
) -> list[ScrapeTarget]:
    """The scrape targets of a service's replica table (`specs`: spec by version)."""
    targets = []
    for r in replicas:
        if r.status is not ReplicaStatus.READY or not r.url:
            continue
        spec = specs.get(r.version)
        sluice = spec.service.sluice if spec is not None else None
        options = sluice.engine_metrics if sluice is not None else _DEFAULT
        if options.enabled:
            url = r.url if options.port is None else _with_port(r.url, options.port)
            targets.append(ScrapeTarget(r.id, url, options.metrics_path,
                                        options.interval_seconds))  # fmt: skip
    return targets


def _with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme, f"{host}:{port}", parts.path, "", ""))
