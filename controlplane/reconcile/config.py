"""What a controller is built from: its config (`ControllerConfig`, built once by the
CLI or a test), the prober it needs (`ReadinessProber`), and the backends it runs
with unless given others (`default_backends`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from controlplane import processes
from controlplane.autoscaler import (
    DECISION_INTERVAL_SECONDS,
    NO_REPLICA_DECISION_INTERVAL_SECONDS,
    QPS_WINDOW_SECONDS,
)
from controlplane.backends.base import ReplicaBackend
from controlplane.backends.external import ExternalBackend
from controlplane.backends.local import LocalBackend
from controlplane.prober import ProbeResult
from controlplane.records import ReplicaRecord
from controlplane.servicespec import ReadinessProbe
from proxy.wire.keys import DEFAULT_PREFIX


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Everything the controller needs, built once by the CLI (or a test).

    `state_dir` holds replica logs and handle files (`{state_dir}/{service}/`).
    `drain_seconds`: the longest a retired replica keeps running after it left the
    ready set while proxies report requests on it (controlplane/reconcile/drain.py;
    a spec's `service.sluice.max_drain_seconds` overrides it).
    `lease_ttl`: the leader lease's TTL (renewed every third of it).
    `holder`: this controller's name in the lease (default host:pid); a random
    token is appended per process, so the lease value is unique.
    `reconcile_interval`: the longest a controller goes without a step.
    `term_timeout`: SIGTERM to SIGKILL for local replicas. `replica_env`: the host
    environment whose allow-listed variables local replicas get (None: the
    controller's own; see backends/local.py).
    `base_dir`: what a spec's relative `workdir` is relative to (None: cwd).
    `terminate_on_exit`: stop every replica when the controller closes
    (`sluice run`); otherwise replicas outlive it and the next one adopts them.
    `backend`: the backend new replicas are launched with.
    `autoscaler_interval` / `autoscaler_zero_interval`: seconds between autoscaling
    decisions (while the target is 0); `qps_window_seconds`: what QPS is averaged
    over. Sky Serve's values by default; tests shorten them.
    `nudge_gap`: nudges on the control channel (anyone with a proxy's Redis user
    publishes there) wake the loop at most once per this many seconds; the ones
    between are folded into one wake at the gap's end.
    """

    redis_url: str
    redis_ca_file: str | None = None  # the CA of a rediss:// server (None: the system's)
    prefix: str = DEFAULT_PREFIX
    state_dir: Path
    drain_seconds: float = 120.0
    lease_ttl: float = 10.0
    holder: str | None = None
    reconcile_interval: float = 1.0
    term_timeout: float = processes.TERM_TIMEOUT
    replica_env: Mapping[str, str] | None = None
    base_dir: Path | None = None
    terminate_on_exit: bool = False
    backend: str = "local"
    autoscaler_interval: float = DECISION_INTERVAL_SECONDS
    autoscaler_zero_interval: float = NO_REPLICA_DECISION_INTERVAL_SECONDS
    qps_window_seconds: int = QPS_WINDOW_SECONDS
    nudge_gap: float = 0.1


class ReadinessProber(Protocol):
    """What the controller needs from a prober (`controlplane.prober.Prober`)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def poll(
        self,
        service: str,
        replicas: list[tuple[ReplicaRecord, ReadinessProbe]],
        now: float,
    ) -> dict[int, ProbeResult]: ...

    def forget_service(self, service: str) -> None: ...

    def next_due(self, service: str, replica_id: int, interval: float) -> float | None: ...


def default_backends(config: ControllerConfig) -> dict[str, ReplicaBackend]:
    """The backends a controller runs with unless given others: local and external, and
    skypilot when it is `config.backend`."""
    backends: dict[str, ReplicaBackend] = {
        "local": LocalBackend(
            config.state_dir,
            base_env=config.replica_env,
            base_dir=config.base_dir,
            term_timeout=config.term_timeout,
        ),
        "external": ExternalBackend(),
    }
    if config.backend == "skypilot":
        from controlplane.backends.skypilot import SkyPilotBackend, SkyPilotConfig

        backends["skypilot"] = SkyPilotBackend(
            SkyPilotConfig(namespace=config.prefix, base_dir=config.base_dir)
        )
    return backends
