"""A flood of nudges on the control channel (anyone with a proxy's Redis user can
publish there) wakes the controller's loop at most once per `nudge_gap`, instead of
making it step back to back; garbage among them is skipped and counted; and the loop
still stops when cancelled (on main a cancellation that met its idle timeout was
swallowed: `run()` went on forever). A real controller loop on a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import redis.asyncio as aioredis

from controlplane.reconcile import Controller, ControllerConfig
from controlplane.store import Store, StoreUnavailable
from tests.support.cancel import SwallowsCancel
from tests.support.poll import must_finish, until


async def test_a_flood_of_nudges_wakes_the_loop_once_per_gap(
    store: Store, redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    config = ControllerConfig(redis_url=redis_url, prefix=redis_prefix,
                              state_dir=tmp_path / "state", reconcile_interval=30.0,
                              terminate_on_exit=True)  # fmt: skip
    # A gap longer than the test: every wake after the first nudge's is folded away.
    config = dataclasses.replace(config, nudge_gap=3600.0)
    async with Controller(store, config) as controller:
        wakes: list[None] = []
        wake = controller.wake

        def counted() -> None:
            wakes.append(None)
            wake()

        controller.wake = counted  # type: ignore[method-assign]
        task = asyncio.create_task(controller.run())
        try:
            await until(lambda: len(wakes) >= 1, timeout=10, what="the listener subscribed")
            async with redis_client.pipeline(transaction=False) as pipe:
                for i in range(500):
                    pipe.publish(store.keys.control, f"svc-{i}")
                pipe.publish(store.keys.control, b"\xff\xfe")  # the last one: skipped
                await pipe.execute()
            await until(lambda: store.rejects.total("nudge") == 1, timeout=30,
                        what="every nudge consumed")  # fmt: skip
            # The subscription's own wake, and the first nudge's; none for the other 499.
            assert len(wakes) == 2, len(wakes)
            assert not task.done()
        finally:
            task.cancel()
            await must_finish(_ended(task), "the cancelled controller loop")


async def _ended(task: asyncio.Task[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_run_ends_when_a_library_under_its_step_swallows_the_cancel(
    store: Store, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    # redis-py turns a cancellation that lands in a command into a ConnectionError now
    # and then (StoreUnavailable here): run() took it for a failed step and idled on, and
    # whoever had cancelled it (a test's teardown, 120 s in CI) waited for ever.
    config = ControllerConfig(redis_url=redis_url, prefix=redis_prefix,
                              state_dir=tmp_path / "state", reconcile_interval=30.0)  # fmt: skip
    async with Controller(store, config) as controller:
        step = SwallowsCancel(StoreUnavailable("connection closed while reading"))
        controller.step = step  # type: ignore[method-assign]
        task = asyncio.create_task(controller.run())
        assert await step.stops(task), f"still running after {step.calls} steps"
        assert step.calls == 1
