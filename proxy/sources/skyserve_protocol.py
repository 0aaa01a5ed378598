"""The payloads of Sky Serve's load-balancer sync protocol, and the request log behind them.

    POST {controller_addr}/controller/load_balancer_sync
         {"request_aggregator": {"timestamps": [unix seconds, one per request]}}
    <-   {"replica_info": {"<replica url>": {"gpu_type": "<accelerator or unknown>"}}}

(older controllers answer {"ready_replica_urls": [...]}; `parse_sync_reply` reads
both).

Timestamps are not taken per request: a sampler turns the proxy's request
counter into per-100 ms counts, kept here in a RequestLog. Sky's autoscaler
appends each batch to one list that it trims with `bisect`, so every batch must
be sorted and later than the one before: a batch ends at a watermark, resends go
first, and counts that arrive late (another worker) are stamped at the
watermark. The log is bounded by the autoscaler's 60 s window (older counts are
dropped and counted).

Pure data handling, no I/O: proxy/sources/skyserve.py does the syncing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

SYNC_PATH = "/controller/load_balancer_sync"
WINDOW_SECONDS = 60.0  # Sky's RequestRateAutoscaler window: older counts are useless to it

Sample = tuple[float, int]  # (end of a 100 ms slot, requests in it)

_ENCODER = msgspec.json.Encoder()


def parse_sync_reply(body: Any) -> dict[str, str | None]:
    """Replica URL -> accelerator (None when unknown), from either reply shape."""
    if not isinstance(body, dict):
        raise ValueError("sync reply is not a JSON object")
    out: dict[str, str | None] = {}
    info = body.get("replica_info")
    if isinstance(info, dict):
        for url, meta in info.items():
            gpu = meta.get("gpu_type") if isinstance(meta, dict) else None
            out[_normalise(url)] = None if gpu in (None, "", "unknown") else str(gpu)
        return out
    urls = body.get("ready_replica_urls")
    if isinstance(urls, list):
        return {_normalise(u): None for u in urls if isinstance(u, str)}
    raise ValueError("sync reply has neither replica_info nor ready_replica_urls")


def _normalise(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def encode_sync_body(batch: Sequence[Sample]) -> bytes:
    """The sync request body: one timestamp per request (a slot's requests at its end)."""
    stamps: list[float] = []
    for t, n in batch:
        stamps.extend([t] * n)
    return _ENCODER.encode({"request_aggregator": {"timestamps": stamps}})


class RequestLog:
    """Request counts waiting to reach the controller; bounded, and sent in time order.

    `take(until)` returns everything up to the watermark `until`, sorted and
    never earlier than the previous batch; `give_back(batch)` returns a batch
    whose sync failed, to be sent first next time. Counts older than `window`
    seconds are dropped (`dropped` counts the requests).
    """

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self._window = window
        self._pending: list[Sample] = []
        self._unsent: list[Sample] = []
        self.sent_until = 0.0
        self.dropped = 0

    def add(self, t: float, n: int) -> None:
        self._pending.append((t, n))

    def extend(self, samples: Sequence[Sample]) -> None:
        self._pending.extend(samples)

    @property
    def buffered(self) -> int:
        return sum(n for _, n in self._unsent) + sum(n for _, n in self._pending)

    def trim(self, now: float) -> int:
        """Drop counts older than the window; the number of requests dropped."""
        horizon = now - self._window
        self._unsent, old_unsent = _split_at(self._unsent, horizon)
        self._pending, old_pending = _split_at(self._pending, horizon)
        dropped = old_unsent + old_pending
        self.dropped += dropped
        return dropped

    def take(self, until: float) -> list[Sample]:
        floor = self.sent_until
        until = max(until, floor)
        now_part: list[Sample] = []
        later: list[Sample] = []
        for t, n in self._pending:
            if t > until:
                later.append((t, n))
            else:
                now_part.append((t if t > floor else floor, n))  # late: at the watermark
        now_part.sort()
        batch = self._unsent + now_part
        self._unsent = []
        self._pending = later
        self.sent_until = until
        return batch

    def give_back(self, batch: list[Sample]) -> None:
        self._unsent = batch + self._unsent


def _split_at(samples: list[Sample], horizon: float) -> tuple[list[Sample], int]:
    """The samples at or after `horizon`, and how many requests the others held."""
    if not samples or min(t for t, _ in samples) >= horizon:
        return samples, 0
    return [s for s in samples if s[0] >= horizon], sum(n for t, n in samples if t < horizon)
