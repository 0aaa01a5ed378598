"""Which replicas the controller scrapes, and where (controlplane/reconcile/engines.py)."""

from __future__ import annotations

from controlplane.reconcile.engines import scrape_targets
from controlplane.servicespec import parse_spec
from controlplane.states import ReplicaStatus
from tests.support.builders import replica


def spec(**engine_metrics: object):  # type: ignore[no-untyped-def]
    service: dict[str, object] = {"readiness_probe": "/health"}
    if engine_metrics:
        service["sluice"] = {"engine_metrics": engine_metrics}
    return parse_spec({"service": service, "run": "true"})


def test_only_ready_replicas_with_a_url_on_their_versions_options() -> None:
    table = [replica(1), replica(2, status=ReplicaStatus.STARTING), replica(3, version=2),
             replica(4, url="")]  # fmt: skip
    specs = {1: spec(), 2: spec(path="/stats/prometheus", interval_seconds=5)}
    targets = scrape_targets(table, specs)
    assert [(t.replica_id, t.path, t.interval) for t in targets] == [
        (1, "/metrics", 1.0), (3, "/stats/prometheus", 5.0)]


def test_disabled_and_a_port_of_its_own() -> None:
    assert scrape_targets([replica(1)], {1: spec(enabled=False)}) == []
    (target,) = scrape_targets([replica(1, url="http://[::1]:8000/base")], {1: spec(port=9000)})
    assert target.url == "http://[::1]:9000/base"
