"""The controller's launch and termination tasks, and what became of them.

The loop starts a task after the commit that recorded the replica (a launch for
a PROVISIONING record, a termination for a drained or failed one); every task
wakes the loop when it ends. The next plan reads the finished ones as plain
outcomes (`finished_launches`, `finished_terminations`) and records them; once
that plan is committed the loop `settle`s them, so an outcome is recorded once
even when a plan is made again after a conflicting write.

A launch that finished for a replica nobody wants any more (its record was
deleted meanwhile, or its service is gone) is an orphan: it is terminated at
once, and the task is kept here until it ends so that `aclose()` can await it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from controlplane.backends.base import Launched, ReplicaBackend

log = logging.getLogger("sluice.controller")


@dataclass(frozen=True, slots=True)
class _Launch:
    task: asyncio.Task[Launched]
    backend: ReplicaBackend


@dataclass(frozen=True, slots=True)
class LaunchOutcome:
    """A finished launch: `launched` when it succeeded, `error` when it raised,
    neither when it was cancelled."""

    replica_id: int
    backend: ReplicaBackend
    launched: Launched | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class TerminationOutcome:
    """A finished termination: `error` when it raised; `cancelled` when it never ended."""

    replica_id: int
    error: BaseException | None = None
    cancelled: bool = False


class TaskRegistry:
    """Launches, terminations and orphan terminations in flight, keyed by
    (service, replica id); see the module docstring."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._launches: dict[tuple[str, int], _Launch] = {}
        self._terminations: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._orphans: set[asyncio.Task[None]] = set()

    # -- starting --------------------------------------------------------------------------------

    def launch(
        self,
        name: str,
        replica_id: int,
        backend: ReplicaBackend,
        launch: Coroutine[Any, Any, Launched],
    ) -> None:
        task = asyncio.create_task(launch, name=f"launch {name}/{replica_id}")
        task.add_done_callback(lambda _t: self._wake())
        self._launches[(name, replica_id)] = _Launch(task, backend)

    def terminate(self, name: str, replica_id: int, terminate: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(terminate, name=f"terminate {name}/{replica_id}")
        task.add_done_callback(lambda _t: self._wake())
        self._terminations[(name, replica_id)] = task

    def terminate_orphan(self, name: str, backend: ReplicaBackend, launched: Launched) -> None:
        log.info("service %s: terminating a replica launched for nothing", name)
        task = asyncio.create_task(backend.terminate(launched.handle))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    # -- what the plan reads ---------------------------------------------------------------------

    def finished_launches(self, name: str) -> list[LaunchOutcome]:
        """The launches of `name` that ended, in the order they were started."""
        outcomes = []
        for (service, replica_id), launch in self._launches.items():
            if service != name or not launch.task.done():
                continue
            task = launch.task
            if task.cancelled():
                outcomes.append(LaunchOutcome(replica_id, launch.backend))
            elif (error := task.exception()) is not None:
                outcomes.append(LaunchOutcome(replica_id, launch.backend, error=error))
            else:
                outcomes.append(LaunchOutcome(replica_id, launch.backend, task.result()))
        return outcomes

    def finished_terminations(self, name: str) -> list[TerminationOutcome]:
        """The terminations of `name` that ended, in the order they were started."""
        outcomes = []
        for (service, replica_id), task in self._terminations.items():
            if service != name or not task.done():
                continue
            if task.cancelled():
                outcomes.append(TerminationOutcome(replica_id, cancelled=True))
            else:
                outcomes.append(TerminationOutcome(replica_id, task.exception()))
        return outcomes

    def launching(self, name: str) -> set[int]:
        """Replica ids of `name` with a launch task (finished or not) not yet settled."""
        return {replica_id for service, replica_id in self._launches if service == name}

    def has_launch(self, name: str, replica_id: int) -> bool:
        return (name, replica_id) in self._launches

    def terminating(self, name: str, replica_id: int) -> bool:
        return (name, replica_id) in self._terminations

    # -- forgetting ------------------------------------------------------------------------------

    def settle(self, name: str, launches: Iterable[int], terminations: Iterable[int]) -> None:
        """Forget finished tasks whose outcomes were just committed."""
        for replica_id in launches:
            self._launches.pop((name, replica_id), None)
        for replica_id in terminations:
            self._terminations.pop((name, replica_id), None)

    def forget_gone(self, names: set[str]) -> None:
        """Drop the finished tasks of services not in `names`; a launch that succeeded
        for a service that is gone is terminated."""
        for key, launch in list(self._launches.items()):
            if key[0] in names or not launch.task.done():
                continue
            del self._launches[key]
            if not launch.task.cancelled() and launch.task.exception() is None:
                self.terminate_orphan(key[0], launch.backend, launch.task.result())
        for key in [k for k in self._terminations if k[0] not in names]:
            if self._terminations[key].done():
                del self._terminations[key]

    async def stop_launches(self) -> None:
        """Cancel every launch in flight; terminate those that finished before the cancel
        (their processes are in no record)."""
        launches = list(self._launches.values())
        self._launches.clear()
        for launch in launches:
            launch.task.cancel()
        if launches:
            await asyncio.wait([launch.task for launch in launches])
        for launch in launches:
            # A launch that finished before the cancel has a process the records miss.
            if not launch.task.cancelled() and launch.task.exception() is None:
                with contextlib.suppress(Exception):
                    await launch.backend.terminate(launch.task.result().handle)

    async def aclose(self) -> None:
        """Cancel every task and wait for them; their outcomes do not matter any more."""
        tasks: list[asyncio.Task[Launched] | asyncio.Task[None]] = [
            *(launch.task for launch in self._launches.values()),
            *self._terminations.values(),
            *self._orphans,
        ]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for task in tasks:  # their outcomes do not matter any more
            if not task.cancelled():
                task.exception()
        self._launches.clear()
        self._terminations.clear()
        self._orphans.clear()
