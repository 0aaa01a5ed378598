"""What proxies write to Redis beside the request path, and the nudges on the control
channel: the structs both sides encode and decode (key names in proxy/wire/keys.py).

Every struct allows unknown fields and gives every field added after the first release
a default, so an older reader reads a newer writer's payload.

They are untrusted input for the controller (anyone with a proxy's Redis user writes
them): every number is bounded in sign and range, every list and map in length, so a
payload a sluice proxy would never write fails to decode (`msgspec.ValidationError`)
instead of reaching the autoscaler. The controller's defensive reading is
controlplane/store/untrusted.py.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

#: Counts (requests in flight, per replica or in total) above this are not believable.
MAX_COUNT = 10**9
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
_Generation = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
_Time = Annotated[float, msgspec.Meta(ge=0.0)]  # JSON has no NaN; 1e999 fails to decode
_Url = Annotated[str, msgspec.Meta(max_length=2048)]
_Reason = Annotated[str, msgspec.Meta(max_length=32)]
_Total = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # a counter since the start
_Traffic = Annotated[float, msgspec.Meta(ge=0.0, le=float(MAX_COUNT))]


class InflightEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One proxy's in-flight counts, a field of the `{prefix}:svc:{name}:inflight` hash
    (written by the proxy every second; `at` is its wall clock at the write)."""

    at: _Time = 0.0
    total: _Count = 0
    # replica URL -> requests in flight there
    replicas: Annotated[dict[_Url, _Count], msgspec.Meta(max_length=10_000)] = {}
    # replica URL -> requests the proxy routed there recently (the prefix policy's
    # PlacementTable.traffic, halved every 30 s; per-slot engines only, else empty): the
    # other proxies add it to their own to place a new family on an idle fleet.
    traffic: Annotated[dict[_Url, _Traffic], msgspec.Meta(max_length=10_000)] = {}


class ProxyHeartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """One proxy process's heartbeat, a field of `{prefix}:svc:{name}:proxies` (written
    by the proxy every second; times are its wall clock)."""

    generation: _Generation = -1  # the snapshot generation it serves (-1: none yet)
    applied_at: _Time = 0.0  # when it applied that generation
    seen_at: _Time = 0.0  # when it wrote this heartbeat
    connected: bool = False  # subscribed and in sync with Redis
    # (generation, applied_at) of its last applies (a proxy keeps 32)
    recent: Annotated[list[tuple[_Generation, _Time]], msgspec.Meta(max_length=256)] = []
    # Cumulative counters since the process started (the dashboard takes rates from
    # successive heartbeats; a restart starts them again from 0). `responses`: "2xx",
    # "3xx", "4xx", "5xx" (proxy-generated ones included, 499 in 4xx; empty: an older
    # proxy); `cuts`: responses cut short (proxy/cuts.py); `routed`: the prefix
    # policy's reasons (affinity, spill, fallback; empty under other policies).
    responses: Annotated[dict[_Reason, _Total], msgspec.Meta(max_length=16)] = {}
    cuts: _Total = 0
    routed: Annotated[dict[_Reason, _Total], msgspec.Meta(max_length=16)] = {}


class Nudge(msgspec.Struct, frozen=True, kw_only=True):
    """A message on `{prefix}:control`: reconcile `service` now.

    `reason` is "changed" (an ops command wrote the service) or "demand" (a proxy
    holds requests while the service has no replica). Ops scripts may publish the
    bare service name instead of JSON; `decode_nudge` accepts both.
    """

    service: Annotated[str, msgspec.Meta(max_length=253)]
    reason: Annotated[str, msgspec.Meta(max_length=64)] = "changed"


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
