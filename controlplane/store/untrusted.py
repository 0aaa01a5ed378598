"""What a proxy's Redis user can write, read defensively: the request counts (`rps`),
the in-flight entries (`inflight`), the heartbeats (`proxies`) and the nudges on the
control channel. The rule (docs/redis.md, "What a proxy user can write"):

- **parsed defensively**: a field or value that does not decode (not UTF-8, not a
  number, a 401-digit number, a negative count, NaN or 1e999, the wrong JSON type, a
  proxy id with terminal escapes) is skipped and counted (`Rejects`), and logged at
  most once a minute per service and kind with the count since; no decoder here
  raises, whatever the bytes (tests/controlplane/test_untrusted_decoders.py);
- **bounded**: a hash holding more than `MAX_FIELDS` fields or `MAX_HASH_BYTES` bytes
  is deleted whole before anything of it is read (`BOUNDED_READ`, one Lua script, so
  nothing is transferred and a write cannot slip in between the check and the read);
  a field over `MAX_FIELD_BYTES` or a value over `MAX_VALUE_BYTES` is skipped; counts
  are at most `MAX_COUNT`, times finite, lists and maps bounded
  (proxy/wire/telemetry.py);
- **moves the controller only within documented limits**: the autoscaler clips what
  these values make of a target to [min_replicas, max_replicas]; nothing read here
  changes the ready set.

Pure but for the script text: no I/O.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TypeVar

import msgspec

from controlplane.records import SERVICE_NAME_MAX, SERVICE_NAME_PATTERN
from proxy.wire.telemetry import MAX_COUNT, InflightEntry, Nudge, ProxyHeartbeat, decode_nudge

log = logging.getLogger("sluice.store")

#: A hash a proxy user writes with more fields than this is deleted whole (legitimate
#: ones hold one field per proxy process, or one per second of the QPS window).
MAX_FIELDS = 4096
#: ... or taking more than this many bytes of Redis memory (MEMORY USAGE).
MAX_HASH_BYTES = 8 * 1024 * 1024
#: The shared placement hash of the `prefix` policy: the proxies cap it at 16 entries
#: per family slot of the fleet (proxy/sources/placement.py); past this it is deleted.
MAX_PLACEMENT_FIELDS = 65536
#: A field name longer than this is skipped (proxy ids are host:pid; seconds 10 digits).
MAX_FIELD_BYTES = 256
#: A value longer than this is skipped (an in-flight entry of 1,000 busy replicas is
#: about 60 KiB).
MAX_VALUE_BYTES = 256 * 1024
#: A nudge longer than this is skipped.
MAX_NUDGE_BYTES = 4096
#: Seconds between two log lines about rejected values of one service and kind.
LOG_INTERVAL_SECONDS = 60.0

# KEYS[1]: a hash proxies write. ARGV[1]: max fields, ARGV[2]: max bytes.
# Returns {fields, 0} and deletes the hash when it is over a bound (UNLINK frees the
# memory in the background; DEL/UNLINK are allowed under `noeviction` at maxmemory),
# else {fields, 1, field, value, ...}.
BOUNDED_READ = """
local n = redis.call('HLEN', KEYS[1])
if n == 0 then return {0, 1} end
local over = n > tonumber(ARGV[1])
if not over then
  local size = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0')
  over = size ~= false and size > tonumber(ARGV[2])
end
if over then
  redis.call('UNLINK', KEYS[1])
  return {n, 0}
end
local out = {n, 1}
for _, item in ipairs(redis.call('HGETALL', KEYS[1])) do out[#out + 1] = item end
return out
"""

# The same bounds without the read: run on every proxy-written hash of every service
# every few seconds, whatever it autoscales on. KEYS: the hashes; ARGV as above.
# Returns how many were deleted.
ENFORCE_BOUNDS = """
local deleted = 0
for _, key in ipairs(KEYS) do
  local n = redis.call('HLEN', key)
  local over = n > tonumber(ARGV[1])
  if n > 0 and not over then
    local size = redis.call('MEMORY', 'USAGE', key, 'SAMPLES', '0')
    over = size ~= false and size > tonumber(ARGV[2])
  end
  if over then
    redis.call('UNLINK', key)
    deleted = deleted + 1
  end
end
return deleted
"""

_INFLIGHT = msgspec.json.Decoder(InflightEntry)
_HEARTBEAT = msgspec.json.Decoder(ProxyHeartbeat)
_COUNT_DIGITS = len(str(MAX_COUNT))
T = TypeVar("T")


class Rejects:
    """Counts what was skipped, by (service, kind); logs at most once a minute per
    (service, kind) with the number skipped since, so a hostile writer cannot flood the
    controller's log (one line per step would be one per second)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.counts: Counter[tuple[str, str]] = Counter()
        self._unlogged: Counter[tuple[str, str]] = Counter()
        self._logged_at: dict[tuple[str, str], float] = {}

    def reject(self, service: str, kind: str, why: str, n: int = 1) -> None:
        """`n` values of `kind` (rps, inflight, proxies, nudge) of `service` skipped."""
        key = (service, kind)
        self.counts[key] += n
        self._unlogged[key] += n
        now = self._clock()
        last = self._logged_at.get(key)
        if last is not None and now - last < LOG_INTERVAL_SECONDS:
            return
        self._logged_at[key] = now
        skipped, self._unlogged[key] = self._unlogged[key], 0
        log.warning("service %s: skipped %d invalid %s value(s) written to Redis (last: %s)",
                    printable(service), skipped, kind, why)  # fmt: skip
        if len(self._logged_at) > 4 * MAX_FIELDS:  # names are untrusted too (nudges)
            self._logged_at.clear()

    def total(self, kind: str | None = None) -> int:
        """Everything skipped (of one kind), over all services."""
        return sum(n for (_, k), n in self.counts.items() if kind is None or k == kind)


def printable(value: str, limit: int = 100) -> str:
    """`value` safe for a terminal or a log line: control characters (escape sequences,
    BEL, newlines, C1 codes) as `\\x..` escapes, cut to `limit` characters."""
    if value.isprintable() and len(value) <= limit:
        return value
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in value[:limit])
    return out + ("..." if len(value) > limit else "")


def _utf8(raw: bytes | str, limit: int) -> str | None:
    if isinstance(raw, str):
        return raw if len(raw.encode("utf-8", "surrogatepass")) <= limit else None
    if len(raw) > limit:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def count(raw: bytes | str) -> int | None:
    """A non-negative integer of at most MAX_COUNT written as plain digits, else None."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if not 0 < len(raw) <= _COUNT_DIGITS or not raw.isdigit():
        return None
    value = int(raw)
    return value if value <= MAX_COUNT else None


def second(raw: bytes | str) -> int | None:
    """A unix second (0 ..< 10**11) written as plain digits, else None."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if not 0 < len(raw) <= 11 or not raw.isdigit():
        return None
    return int(raw)


def decode_rps(
    service: str, raw: Mapping[bytes | str, bytes | str], rejects: Rejects
) -> dict[int, int]:
    """`unix second -> request count` fields; anything else skipped and counted."""
    counts: dict[int, int] = {}
    bad = 0
    for field, value in raw.items():
        at, n = second(field), count(value)
        if at is None or n is None:
            bad += 1
            continue
        counts[at] = n
    if bad:
        rejects.reject(service, "rps", "not a unix second -> count in 0..1e9", bad)
    return dict(sorted(counts.items()))


def _decode_entries(
    service: str,
    kind: str,
    raw: Mapping[bytes | str, bytes | str],
    decoder: msgspec.json.Decoder[T],
    rejects: Rejects,
) -> tuple[dict[str, T], list[bytes | str]]:
    """Proxy id -> struct; also returns the fields that were skipped."""
    entries: dict[str, T] = {}
    skipped: list[bytes | str] = []
    why = ""
    for field, value in raw.items():
        proxy_id = _utf8(field, MAX_FIELD_BYTES)
        if proxy_id is None or not proxy_id or not proxy_id.isprintable():
            skipped.append(field)
            why = "a proxy id that is not short printable UTF-8"
            continue
        if len(value) > MAX_VALUE_BYTES:
            skipped.append(field)
            why = f"a value over {MAX_VALUE_BYTES} bytes"
            continue
        try:
            entries[proxy_id] = decoder.decode(value)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            skipped.append(field)
            why = str(exc)[:200]
    if skipped:
        rejects.reject(service, kind, why, len(skipped))
    return entries, skipped


def decode_inflight(
    service: str, raw: Mapping[bytes | str, bytes | str], rejects: Rejects
) -> tuple[dict[str, InflightEntry], list[bytes | str]]:
    """Proxy id -> InflightEntry, and the fields skipped."""
    return _decode_entries(service, "inflight", raw, _INFLIGHT, rejects)


def decode_heartbeats(
    service: str, raw: Mapping[bytes | str, bytes | str], rejects: Rejects
) -> tuple[dict[str, ProxyHeartbeat], list[bytes | str]]:
    """Proxy id -> ProxyHeartbeat, and the fields skipped."""
    return _decode_entries(service, "proxies", raw, _HEARTBEAT, rejects)


def parse_nudge(payload: object, rejects: Rejects) -> Nudge | None:
    """A control-channel message as a Nudge naming a well-formed service name, or None
    (skipped, counted under the service "-")."""
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogatepass")
    if not isinstance(payload, bytes) or len(payload) > MAX_NUDGE_BYTES:
        rejects.reject("-", "nudge", "not bytes, or too long")
        return None
    try:
        nudge = decode_nudge(payload)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, ValueError) as exc:
        rejects.reject("-", "nudge", str(exc)[:200])
        return None
    name = nudge.service
    if len(name) > SERVICE_NAME_MAX or not SERVICE_NAME_PATTERN.fullmatch(name):
        rejects.reject("-", "nudge", f"{printable(name)!r} is not a service name")
        return None
    return nudge
