"""How the store's values look in Redis: the service record as a hash (strings raw,
other fields JSON), replica records as JSON, and the comparison that decides whether a
commit changes what proxies route to (`same_ready_set`).

Pure: no I/O. Every decoder and encoder is built once, here.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from controlplane.errors import RecordInvalid
from controlplane.records import AutoscalerStatus, ReplicaRecord, ServiceRecord
from proxy.wire.snapshot import ReadySnapshot
from proxy.wire.telemetry import InflightEntry, ProxyHeartbeat


def _is_text(tp: Any) -> bool:
    """True for field types stored raw in the hash: str, str enums, and their optionals."""
    if isinstance(tp, types.UnionType):
        return all(_is_text(arg) for arg in tp.__args__)
    return tp is type(None) or (isinstance(tp, type) and issubclass(tp, str))


# name -> JSON decoder for that field's type, or None when the field is stored raw.
_SERVICE_FIELDS: dict[str, msgspec.json.Decoder[Any] | None] = {
    f.encode_name: None if _is_text(f.type) else msgspec.json.Decoder(f.type)
    for f in msgspec.structs.fields(ServiceRecord)
}
ENCODER = msgspec.json.Encoder()
REPLICA_DECODER = msgspec.json.Decoder(ReplicaRecord)
INFLIGHT_DECODER = msgspec.json.Decoder(InflightEntry)
HEARTBEAT_DECODER = msgspec.json.Decoder(ProxyHeartbeat)
AUTOSCALER_DECODER = msgspec.json.Decoder(AutoscalerStatus)


def encode_service_record(record: ServiceRecord) -> dict[str, bytes]:
    """Hash fields of a record: strings raw, other values JSON, None fields left out."""
    fields: dict[str, bytes] = {}
    for name, value in msgspec.structs.asdict(record).items():
        if value is None:
            continue
        fields[name] = value.encode() if isinstance(value, str) else ENCODER.encode(value)
    return fields


def decode_service_record(fields: Mapping[bytes | str, bytes | str]) -> ServiceRecord:
    """Inverse of `encode_service_record`; unknown fields are ignored. Raises RecordInvalid."""
    values: dict[str, Any] = {}
    try:
        for raw_name, raw in fields.items():
            name = text(raw_name)
            if name not in _SERVICE_FIELDS:
                continue  # written by a newer controller
            decoder = _SERVICE_FIELDS[name]
            values[name] = text(raw) if decoder is None else decoder.decode(raw)
        return msgspec.convert(values, ServiceRecord)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise RecordInvalid(f"service record {values.get('name', '?')!r}: {exc}") from exc


def text(value: bytes | str) -> str:
    """A hash field or value as text."""
    # The store's own clients answer bytes; a caller's client may decode responses.
    return value.decode() if isinstance(value, bytes) else value


def parse_int(raw: bytes | str) -> int | None:
    """An integer field or value of a hash, or None when it is not one."""
    try:
        return int(raw)
    except ValueError:
        return None


def decode_replica(name: str, raw_id: bytes | str, raw: bytes | str) -> ReplicaRecord:
    """One replica record of service `name`; raises RecordInvalid naming it."""
    try:
        return REPLICA_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RecordInvalid(f"service {name}: replica {text(raw_id)!r}: {exc}") from exc


def decode_replicas(name: str, raw: Mapping[bytes | str, bytes | str]) -> dict[int, ReplicaRecord]:
    """A replica table as read from its hash, by id (ascending)."""
    table = {}
    for raw_id, value in raw.items():
        replica = decode_replica(name, raw_id, value)
        table[replica.id] = replica
    return dict(sorted(table.items()))


def validated(name: str, replicas: Iterable[ReplicaRecord]) -> tuple[ReplicaRecord, ...]:
    """Round-trip records through JSON so their constraints (the URL) are checked now."""
    records = []
    for replica in replicas:
        try:
            records.append(REPLICA_DECODER.decode(ENCODER.encode(replica)))
        except msgspec.ValidationError as exc:
            raise ValueError(f"service {name}: replica {replica.id}: {exc}") from exc
    return tuple(records)


class _Routing(msgspec.Struct):
    """What of a stored snapshot decides routing; the replicas left as raw JSON."""

    service: str
    generation: int
    published_at: float
    status: str = ""
    policy: str = ""
    active_versions: list[int] = []
    replicas: msgspec.Raw = msgspec.Raw(b"[]")
    prefix_options: dict[str, Any] | None = None
    resume_streams: bool = False


_ROUTING_DECODER = msgspec.json.Decoder(_Routing)


def same_ready_set(
    stored: bytes | None, payload: bytes, snapshot: ReadySnapshot
) -> ReadySnapshot | None:
    """The stored snapshot if it routes exactly like `snapshot` (encoded as `payload`):
    `snapshot` with the stored generation and publication time. None when they differ
    (or nothing usable is stored). The only definition of "routes the same".

    Compares the replicas as raw JSON instead of decoding them: at 1,000 replicas,
    building ReadyReplica objects would be most of a commit's CPU.
    """
    if stored is None:
        return None
    try:
        old = _ROUTING_DECODER.decode(stored)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None  # corrupt: this commit replaces it
    new = _ROUTING_DECODER.decode(payload)
    if (old.service, old.status, old.policy, old.active_versions, old.prefix_options,
        old.resume_streams) != (
        new.service,
        new.status,
        new.policy,
        new.active_versions,
        new.prefix_options,
        new.resume_streams,
    ) or bytes(old.replicas) != bytes(new.replicas):
        return None
    return msgspec.structs.replace(
        snapshot, generation=old.generation, published_at=old.published_at
    )
