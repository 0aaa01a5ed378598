"""The wire contract between the controller and every proxy: ReadySnapshot.

A snapshot is immutable and versioned. The controller commits it to Redis (and
publishes it) in one MULTI/EXEC; a proxy applies it only when its generation is
newer than the one it holds. Encoded as JSON with msgspec.

Wire structs allow unknown fields and give every field added after the first
release a default, so an old proxy reads a snapshot from a newer controller.
"""

from __future__ import annotations

import msgspec

from proxy.errors import SnapshotInvalid


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


class ReadySnapshot(msgspec.Struct, frozen=True, kw_only=True):
    service: str
    generation: int
    published_at: float
    status: str = "READY"
    policy: str = "least_load"
    active_versions: list[int] = msgspec.field(default_factory=list)
    replicas: tuple[ReadyReplica, ...] = ()

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
