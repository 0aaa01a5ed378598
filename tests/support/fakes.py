"""FAKE replica backend and FAKE prober for controller tests that drive `step()` on a
fake clock (no processes, no HTTP); and the controller config, controller starter and
`start_controller` fixture (on the module's `config` fixture) the end-to-end tests share.

`FakeBackend`: a launch succeeds at once with a fake pid (unless the spec's envs say
BROKEN=provision; BROKEN=crash makes its "process" exit at once); `kill()` makes a
replica's process exit; `launched`, `dead` and `terminated` record what happened,
by fake pid. `FakeProber`: every probed replica answers at once, 200 unless it is in
`failing`, its version is in `never_ready_versions`, or it is a spot replica never
READY yet while `hold_spot` is set (spot instances still coming up).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from controlplane.backends.base import Launched, LaunchFailed
from controlplane.prober import ProbeResult
from controlplane.reconcile import Controller, ControllerConfig
from controlplane.records import Handle, ReplicaRecord
from controlplane.servicespec import ReadinessProbe, ServiceSpec
from controlplane.store import Store
from tests.support.controllers import Controllers


class FakeBackend:
    """A FAKE backend: no processes (see the module docstring)."""

    can_launch = True

    def __init__(self, name: str = "local") -> None:
        self.name = name
        self.launched: dict[int, int] = {}  # fake pid -> replica id
        self.dead: set[int] = set()
        self.terminated: set[int] = set()
        self._next_pid = 1000

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def launch(
        self, service: str, replica_id: int, version: int, spec: ServiceSpec
    ) -> Launched:
        if spec.envs.get("BROKEN") == "provision":
            raise LaunchFailed("fake: provisioning failed")
        self._next_pid += 1
        pid = self._next_pid
        self.launched[pid] = replica_id
        if spec.envs.get("BROKEN") == "crash":
            self.dead.add(pid)  # the user's command exits at once
        return Launched(url=f"http://127.0.0.1:{10000 + replica_id}", handle={"pid": pid})

    def recover(self, service: str, replica_id: int) -> Launched | None:
        return None

    def exited(self, handle: Handle) -> str | None:
        return "exited with code 1" if handle.get("pid") in self.dead else None

    async def terminate(self, handle: Handle) -> None:
        pid = handle.get("pid")
        assert isinstance(pid, int)
        self.terminated.add(pid)
        self.dead.add(pid)

    def kill(self, handle: Handle) -> None:
        pid = handle.get("pid")
        assert isinstance(pid, int)
        self.dead.add(pid)

    def terminated_replicas(self) -> set[int]:
        """The replica ids whose fake process was terminated."""
        return {self.launched[pid] for pid in self.terminated}


class FakeProber:
    """A FAKE prober: scripted readiness (see the module docstring)."""

    def __init__(self) -> None:
        self.failing: set[int] = set()
        self.never_ready_versions: set[int] = set()
        self.hold_spot = False

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def poll(
        self, service: str, replicas: list[tuple[ReplicaRecord, ReadinessProbe]], now: float
    ) -> dict[int, ProbeResult]:
        results = {}
        for replica, _probe in replicas:
            assert replica.url is not None
            coming_up = replica.spot and replica.first_ready_at is None
            ok = (replica.id not in self.failing
                  and replica.version not in self.never_ready_versions
                  and not (coming_up and self.hold_spot))  # fmt: skip
            results[replica.id] = ProbeResult(replica.id, ok, "200" if ok else "503", replica.url)
        return results

    def forget_service(self, service: str) -> None:
        pass

    def next_due(self, service: str, replica_id: int, interval: float) -> float | None:
        return None


def controller_config(redis_url: str, prefix: str, tmp_path: Path,
                      **overrides: Any) -> ControllerConfig:
    """The config the end-to-end controller tests start from (a short lease, a slow
    periodic reconcile, replicas stopped at teardown), with `overrides` applied."""
    base = ControllerConfig(
        redis_url=redis_url,
        prefix=prefix,
        state_dir=tmp_path / "state",
        drain_seconds=1.0,
        lease_ttl=1.0,
        reconcile_interval=30.0,
        term_timeout=3.0,
        terminate_on_exit=True,  # teardown stops every replica the test launched
    )
    return dataclasses.replace(base, **overrides)


StartController = Callable[..., Awaitable[Controller]]


@contextlib.asynccontextmanager
async def controller_starter(
    store: Store, config: ControllerConfig,
    backends: Callable[[ControllerConfig], Mapping[str, Any]] | None = None,
) -> AsyncIterator[StartController]:  # fmt: skip
    """`start(**overrides)` starts a controller on `config` with `overrides` (and the
    backends `backends(config)` makes, if given); every one is closed on exit."""
    controllers = Controllers()

    async def start(**overrides: Any) -> Controller:
        cfg = dataclasses.replace(config, **overrides)
        if backends is None:
            return await controllers.start(store, cfg)
        return await controllers.start(store, cfg, backends=backends(cfg))

    start.stop = controllers.stop  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        await controllers.aclose()


@pytest.fixture
async def start_controller(
    store: Store, config: ControllerConfig
) -> AsyncIterator[StartController]:
    """`controller_starter` on the test module's `config` fixture (a plugin fixture:
    tests/conftest.py); a module that starts controllers otherwise defines its own."""
    async with controller_starter(store, config) as start:
        yield start
