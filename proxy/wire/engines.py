"""Engine telemetry on the wire: what each replica's model server (vLLM, SGLang,
llama.cpp's llama-server, TGI) reports about its own load, as the controller publishes
it for every proxy at `{prefix}:svc:{name}:engines` (docs/redis.md, docs/engines.md).

`EngineStats` is one replica's record, `EngineView` a service's. Every field but the
replica's URL may be None: the engine does not report it (TGI has no KV-usage gauge,
llama.cpp no TTFT histogram), or the replica serves no metrics at all (`engine` is
"unknown"). Unknown is never an error.

Readers parse the view defensively (`decode_engine_view`), like every shared key: the
payload is bounded in size and entries; a field out of range or of the wrong type is
dropped from its record (the rest of the record stays); a record that is not an object
is dropped; the counts of both come back for the reader to log once or count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

#: The engines a replica may be detected as (from the names it serves).
ENGINES = ("vllm", "sglang", "llamacpp", "tgi", "unknown")
#: A view larger than this is not parsed at all (about 100 bytes a field, 12 fields,
#: MAX_REPLICAS records).
MAX_VIEW_BYTES = 4 << 20
MAX_REPLICAS = 4096

Count = Annotated[float, Meta(ge=0, le=1e7)]
Ratio = Annotated[float, Meta(ge=0, le=1)]
Seconds = Annotated[float, Meta(ge=0, le=1e6)]


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's engine, as of its last scrape (`at`, controller wall clock).

    running / waiting: requests in the engine's batch / queue. kv_usage: fraction of the
    KV cache in use (0-1); kv_capacity_tokens: the cache's size in tokens where the
    engine reports it. prefix_hit_rate: prompt tokens served from the prefix cache over
    the last interval (0-1; SGLang's own gauge). ttft_p50 / ttft_p99: seconds, from the
    engine's TTFT histogram over the last interval (None when no request finished its
    first token in it). tokens_per_s: generated tokens per second over the last interval.
    slots: sequences the engine runs at once (llama.cpp's slots, SGLang's
    max_running_requests), where it says.
    `error`: why the last scrape failed (None when it worked; the values are then the
    last good ones, or None).
    """

    url: Annotated[str, Meta(max_length=2048)] = ""
    engine: Annotated[str, Meta(max_length=32)] = "unknown"
    at: Annotated[float, Meta(ge=0)] = 0.0
    running: Count | None = None
    waiting: Count | None = None
    kv_usage: Ratio | None = None
    kv_capacity_tokens: Annotated[int, Meta(ge=0, le=1 << 40)] | None = None
    prefix_hit_rate: Ratio | None = None
    ttft_p50: Seconds | None = None
    ttft_p99: Seconds | None = None
    tokens_per_s: Annotated[float, Meta(ge=0, le=1e9)] | None = None
    slots: Annotated[int, Meta(ge=0, le=1 << 20)] | None = None
    error: Annotated[str, Meta(max_length=200)] | None = None

    @property
    def queue(self) -> float:
        """Requests waiting in the engine (0 when unknown)."""
        return self.waiting or 0.0


# Engines that batch many requests over one shared prefix cache (continuous batching, a
# paged KV cache), as bench/routing.py's simulator does. llama.cpp keeps one cache per
# slot and runs as many requests at once as it has slots.
BATCHING_ENGINES = frozenset(("vllm", "sglang", "tgi"))


def batching_only(engines: Iterable[EngineStats | None]) -> bool:
    """Whether the engines named are all batching engines (BATCHING_ENGINES): yes when
    at least one is named and none is another (llama.cpp); records of engine "unknown"
    and replicas without one are left out. The proxy's `--fleet-load auto` and the prefix
    policy's placement on an idle fleet (proxy/placement.py) follow it."""
    named = False
    for engine in engines:
        if engine is None or engine.engine == "unknown":
            continue
        if engine.engine not in BATCHING_ENGINES:
            return False
        named = True
    return named


class EngineView(msgspec.Struct, frozen=True, kw_only=True):
    """Every READY replica's EngineStats of one service (key: replica id as a string)."""

    service: str = ""
    at: float = 0.0  # when the controller published it
    replicas: dict[str, EngineStats] = {}


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(EngineView)
_FIELD_TYPES: dict[str, Any] = {
    f.encode_name: f.type for f in msgspec.structs.fields(EngineStats)
}


def encode_engine_view(view: EngineView) -> bytes:
    """The JSON the controller stores at `{prefix}:svc:{name}:engines`."""
    return _ENCODER.encode(view)


def decode_engine_view(raw: bytes | str) -> tuple[EngineView, int]:
    """Parse a stored view leniently: (the view, how many fields and records were dropped).

    Raises ValueError only when the payload as a whole is unusable (too large, not JSON,
    not an object); every smaller defect drops what it touches and is counted.
    """
    if len(raw) > MAX_VIEW_BYTES:
        raise ValueError(f"engine view of {len(raw)} bytes is over {MAX_VIEW_BYTES}")
    # The common case, a valid view, in one typed pass (0.16 ms for 100 replicas; the
    # field-by-field pass below costs ~7 ms, and every proxy reads the view every second).
    try:
        view = _DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    else:
        if len(view.replicas) <= MAX_REPLICAS and all(len(k) <= 20 for k in view.replicas):
            return view, 0
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"engine view is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("engine view is not a JSON object")
    dropped = 0
    service = data.get("service")
    at = data.get("at")
    entries = data.get("replicas")
    if not isinstance(entries, dict):
        entries, dropped = {}, dropped + (entries is not None)
    replicas: dict[str, EngineStats] = {}
    for key, entry in entries.items():
        if len(replicas) >= MAX_REPLICAS or not isinstance(entry, dict) or len(key) > 20:
            dropped += 1
            continue
        fields = {}
        for name, value in entry.items():
            tp = _FIELD_TYPES.get(name)
            if tp is None:
                continue  # a newer controller's field
            try:
                fields[name] = msgspec.convert(value, tp)
            except msgspec.ValidationError:
                dropped += 1
        replicas[key] = EngineStats(**fields)
    view = EngineView(
        service=service if isinstance(service, str) else "",
        at=float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0,
        replicas=replicas,
    )
    return view, dropped
