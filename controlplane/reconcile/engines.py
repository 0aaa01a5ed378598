"""Which replicas the engine scraper reads after a reconcile step: the READY ones with a
URL, on their version's `service.sluice.engine_metrics` (none when it is disabled)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from controlplane.engines.scraper import ScrapeTarget
from controlplane.records import ReplicaRecord
from controlplane.spec import ServiceSpec
from controlplane.spec.engines import EngineMetrics
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
            targets.append(ScrapeTarget(r.id, r.url, options.metrics_path,
                                        options.interval_seconds))  # fmt: skip
    return targets
