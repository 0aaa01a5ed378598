"""The wire contract between the controller and every proxy: ReadySnapshot.

A snapshot is immutable and versioned. The controller commits it to Redis (and
publishes it) in one MULTI/EXEC; a proxy applies it only when its generation is
newer than the one it holds. Encoded as JSON with msgspec.

Wire structs allow unknown fields and give every field added after the first
release a default, so an old proxy reads a snapshot from a newer controller.
"""

from __future__ import annotations

import msgspec

from proxy.wire.errors import SnapshotInvalid
from proxy.wire.policies import DEFAULT_POLICY


class ReadyReplica(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    url: str
    version: int = 1
    accelerator: str | None = None
    target_qps: float | None = None
    spot: bool = False

    def __post_init__(self) -> None:
        if not (self.url.startswith("http://") or self.url.startswith("https://")):
            raise ValueError(f"replica {self.id}: url must be http(s)://host:port, "
                             f"got {self.url!r}")


class PrefixOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options of the `prefix` policy (proxy/prefix.py); every field has a default.

    `block_bytes`: the chain's block size; `prefix_bytes`: how much of a request
    body is read before routing (the key covers at most this much);
    `session_header`: a header whose value is the key (empty: none);
    `user_field`: the JSON `user` field is the key when present; `epsilon`: bounded
    load, a replica with more than (1 + epsilon) x the mean in flight is skipped;
    `spill_margin`: a known prefix's replica is also skipped once it holds this many
    requests more than the mean in flight, up to twice this many as placed families fill
    the replicas' caches (split among several proxies: docs/routing.md; 0: no such
    bound);
    `lru_size`: entries of the per-proxy longest-prefix memory (0: off);
    `placement`: how a new prompt family gets its replica, "capacity" (by load and free
    cache capacity: proxy/placement.py), "rendezvous" (the hash alone) or "auto"
    (capacity once the placement is shared through Redis, else rendezvous);
    `replica_families`: families a replica's cache holds when its engine does not say
    (0: 4); `placement_ttl`: seconds a family stays placed after its last request;
    `warm_copies`: a family's new spill replica gets a one-token warm-up of its prompt
    before its overflow goes there (proxy/warmup.py), instead of a client's request
    computing it cold. On by default since 2026-12-06. Every field is encoded: a
    controller of the release before writes it false (off until it is upgraded; a
    stored spec with a `sluice.prefix` section keeps the value it was stored with), and
    a snapshot without the field reads as on.
    """

    block_bytes: int = 256
    prefix_bytes: int = 16384
    session_header: str = "X-Session-Id"
    user_field: bool = False
    epsilon: float = 3.0
    spill_margin: int = 8
    lru_size: int = 16384
    placement: str = "auto"
    replica_families: int = 0
    placement_ttl: float = 300.0
    warm_copies: bool = True

    def __post_init__(self) -> None:
        if not 16 <= self.block_bytes <= self.prefix_bytes:
            raise ValueError(f"prefix.block_bytes must be >= 16 and <= prefix_bytes "
                             f"({self.prefix_bytes}), got {self.block_bytes}")
        if self.prefix_bytes > 1 << 20:
            raise ValueError(f"prefix.prefix_bytes must be <= 1048576, got {self.prefix_bytes}")
        if not self.epsilon > 0:
            raise ValueError(f"prefix.epsilon must be > 0, got {self.epsilon}")
        if not 0 <= self.spill_margin <= 1 << 20:
            raise ValueError(f"prefix.spill_margin must be 0-1048576, got {self.spill_margin}")
        if self.lru_size < 0:
            raise ValueError(f"prefix.lru_size must be >= 0, got {self.lru_size}")
        if self.placement not in ("auto", "capacity", "rendezvous"):
            raise ValueError(f"prefix.placement must be auto, capacity or rendezvous, "
                             f"got {self.placement!r}")
        if not 0 <= self.replica_families <= 1 << 16:
            raise ValueError(f"prefix.replica_families must be 0-65536, "
                             f"got {self.replica_families}")
        if not 1 <= self.placement_ttl <= 86400:
            raise ValueError(f"prefix.placement_ttl must be 1-86400 s, got {self.placement_ttl}")


class ReadySnapshot(msgspec.Struct, frozen=True, kw_only=True):
    service: str
    generation: int
    published_at: float
    status: str = "READY"
    policy: str = DEFAULT_POLICY
    active_versions: list[int] = msgspec.field(default_factory=list)
    replicas: tuple[ReadyReplica, ...] = ()
    # Options of the `prefix` policy; None: its defaults. Added after the first release.
    prefix_options: PrefixOptions | None = None
    # Resume streamed completions cut by a replica on another one (docs/resume.md; spec
    # service.sluice.resume_streams). Added after the first release.
    resume_streams: bool = False

    def __post_init__(self) -> None:
        if self.generation < 0:
            raise ValueError(f"generation must be >= 0, got {self.generation}")
        urls = [r.url for r in self.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError("replica urls must be unique")


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(ReadySnapshot)


def encode_snapshot(snapshot: ReadySnapshot) -> bytes:
    return _ENCODER.encode(snapshot)


def decode_snapshot(payload: bytes | str) -> ReadySnapshot:
    """Decode and validate a snapshot; any defect raises SnapshotInvalid."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise SnapshotInvalid(str(exc)) from exc
