"""What proxies write to Redis beside the request path, and the nudges on the control
channel: the structs both sides encode and decode (key names in proxy/wire/keys.py).

Every struct allows unknown fields and gives every field added after the first release
a default, so an older reader reads a newer writer's payload.
"""

from __future__ import annotations

import msgspec


class InflightEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One proxy's in-flight counts, a field of the `{prefix}:svc:{name}:inflight` hash
    (written by the proxy every second; `at` is its wall clock at the write)."""

    at: float = 0.0
    total: int = 0
    replicas: dict[str, int] = {}  # replica URL -> requests in flight there


class ProxyHeartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """One proxy process's heartbeat, a field of `{prefix}:svc:{name}:proxies` (written
    by the proxy every second; times are its wall clock)."""

    generation: int = -1  # the snapshot generation it serves (-1: none yet)
    applied_at: float = 0.0  # when it applied that generation
    seen_at: float = 0.0  # when it wrote this heartbeat
    connected: bool = False  # subscribed and in sync with Redis
    recent: list[tuple[int, float]] = []  # (generation, applied_at) of its last applies
    # Cumulative counters since the process started (the dashboard takes rates from
    # successive heartbeats; a restart starts them again from 0). `responses`: "2xx",
    # "3xx", "4xx", "5xx" (proxy-generated ones included, 499 in 4xx; empty: an older
    # proxy); `cuts`: responses cut short (proxy/cuts.py); `routed`: the prefix
    # policy's reasons (affinity, spill, fallback; empty under other policies).
    responses: dict[str, int] = {}
    cuts: int = 0
    routed: dict[str, int] = {}


class Nudge(msgspec.Struct, frozen=True, kw_only=True):
    """A message on `{prefix}:control`: reconcile `service` now.

    `reason` is "changed" (an ops command wrote the service) or "demand" (a proxy
    holds requests while the service has no replica). Ops scripts may publish the
    bare service name instead of JSON; `decode_nudge` accepts both.
    """

    service: str
    reason: str = "changed"


_NUDGE_DECODER = msgspec.json.Decoder(Nudge)
_ENCODER = msgspec.json.Encoder()


def encode_nudge(nudge: Nudge) -> bytes:
    """The JSON payload published on the control channel."""
    return _ENCODER.encode(nudge)


def decode_nudge(payload: bytes | str) -> Nudge:
    """Parse a control-channel message: JSON Nudge, or a bare service name."""
    raw = payload.encode() if isinstance(payload, str) else payload
    if raw.lstrip().startswith(b"{"):
        return _NUDGE_DECODER.decode(raw)
    return Nudge(service=raw.decode().strip())
