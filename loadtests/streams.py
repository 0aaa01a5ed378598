"""Long streams for the rollout matrix (loadtests/rollout.py `--long-streams N`): N
chat-completion streams of `--stream-seconds` each (20 s by default; LLM answers run
for tens of seconds) at the start of the load, then `--stream-rate` new ones per
second, side by side with the short requests, until the load stops; the ones in
flight then are waited for (they are never cut by this script).

Every stream is one outcome:
- `completed`: HTTP 200, every token and `data: [DONE]`, and a clean end of the body;
- `cut`: HTTP 200, then the body ended early (a reset, an EOF before the last chunk,
  or no `[DONE]`): what a client sees when a replica is stopped under its stream;
- `failed`: no 200 (an error status, no answer, a timeout before the head).

Plain aiohttp in the script's own loop; one connection per stream (no pool reuse,
so one cut never hides behind another request's retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class StreamStats:
    started: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_replica: Counter[str] = field(default_factory=Counter)
    cuts: list[dict[str, Any]] = field(default_factory=list)  # the first few, for the table
    longest: float = 0.0
    durations: list[float] = field(default_factory=list)  # of the completed streams

    def to_json(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "completed": self.outcomes["completed"],
            "cut": self.outcomes["cut"],
            "failed": self.outcomes["failed"],
            "unfinished": self.started - sum(self.outcomes.values()),
            "by_replica": dict(self.by_replica),
            "longest_seconds": round(self.longest, 2),
            "median_seconds": round(statistics.median(self.durations), 2)
            if self.durations else None,
            "cuts": self.cuts[:20],
        }


class LongStreams:
    """Long streams against `endpoint` (see the module docstring): `count` at the start
    (a quarter second apart), then `rate` new ones per second (open loop), each of
    `seconds` (`tokens` tokens: their length on the replicas). `start()`, then `stop()`
    (waits for the ones in flight)."""

    def __init__(self, endpoint: str, *, count: int, rate: float, seconds: float,
                 tokens: int, started_at: float) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.count = count
        self.rate = rate
        self.tokens = tokens
        self.seconds = seconds
        self.stats = StreamStats()
        self._started_at = started_at
        self._stopping = asyncio.Event()
        self._streams: set[asyncio.Task[None]] = set()
        self._arrivals: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No total timeout: a stream takes `seconds`; a stall shows as a read timeout.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=30)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(force_close=True, limit=0))
        self._arrivals = asyncio.create_task(self._arrive())

    async def stop(self) -> dict[str, Any]:
        """Start no new stream; wait for those in flight (at most twice a stream's
        length plus a margin: a real engine under load runs slower), then close."""
        self._stopping.set()
        if self._arrivals is not None:
            await self._arrivals
        if self._streams:
            _done, pending = await asyncio.wait(self._streams, timeout=2 * self.seconds + 30)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._session is not None:
            await self._session.close()
        return self.stats.to_json()

    async def _arrive(self) -> None:
        # The first `count` a quarter second apart (all in flight when the scenario
        # changes the fleet), then `rate` per second: replicas launched later get
        # streams too, so a scale-down's newest replica has some to drain.
        for i in range(self.count):
            if i and await self._stopped_within(0.25):
                return
            self._spawn()
        if self.rate <= 0:
            return
        while not await self._stopped_within(1.0 / self.rate):
            self._spawn()

    async def _stopped_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    def _spawn(self) -> None:
        task = asyncio.create_task(self._one())
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)

    async def _one(self) -> None:
        assert self._session is not None
        stats = self.stats
        stats.started += 1
        body = {"model": "sluice/loadtest", "stream": True, "max_tokens": self.tokens,
                "messages": [{"role": "user", "content": "a long answer, please"}]}
        sent = time.time()
        replica, got, done, outcome, error = "-", 0, False, "failed", ""
        try:
            async with self._session.post(f"{self.endpoint}/v1/chat/completions",
                                          json=body) as resp:  # fmt: skip
                replica = resp.headers.get("X-Replica-Id", "-")
                if resp.status != 200:
                    error = f"HTTP {resp.status}"
                else:
                    outcome = "cut"
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            if line.strip() == b"data: [DONE]":
                                done = True
                            else:
                                got += 1
                    if done and got >= self.tokens:
                        outcome = "completed"
                    else:
                        error = f"ended after {got}/{self.tokens} tokens"
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        seconds = time.time() - sent
        stats.longest = max(stats.longest, seconds)
        stats.outcomes[outcome] += 1
        if outcome == "completed":
            stats.durations.append(seconds)
        stats.by_replica[replica] += 1
        if outcome != "completed" and len(stats.cuts) < 20:
            stats.cuts.append({"at": round(sent - self._started_at, 2), "outcome": outcome,
                               "replica": replica, "seconds": round(seconds, 2),
                               "tokens": got, "error": error})  # fmt: skip


def describe(row: dict[str, Any]) -> str:
    """One line for the scenario table."""
    return (f"{row['completed']} completed, {row['cut']} cut, {row['failed']} failed, "
            f"{row['unfinished']} unfinished of {row['started']} "
            f"(median {row.get('median_seconds')} s, longest {row['longest_seconds']} s)")

