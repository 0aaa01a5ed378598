"""Routing you can check: the `prefix` policy's predicted cache hits against the engine's.

When the `prefix` policy routes a request whose prefix it already knows (a
longest-prefix LRU hit, or a placed family on its replica) it *predicts* a hit:
it expects the replica to hold the prompt's prefix in its KV cache. Engines say
what they actually reused, in the response body:

- llama.cpp: `"cache_n": N` in `"timings"` (the non-streamed body; the last SSE
  event of a stream);
- vLLM, SGLang and OpenAI: `"cached_tokens": N` in
  `usage.prompt_tokens_details` (in a stream only when the client asked for
  `stream_options.include_usage`; vLLM only with `--enable-prompt-tokens-details`,
  SGLang with `--enable-cache-report`).

`cached_tokens(data, previous)` finds that report in a body chunk without a
JSON parse: one `bytes.find` for the common marker `"cache` in the chunk's last
`SCAN_TAIL` bytes (engines put the report last: llama.cpp's `cache_n` is ~250
bytes before the end of its body and of its stream's last event, vLLM's usage
closes its body and its stream), so a chunk costs the same however large; the
exchange does that find inline and calls in here only on a match. Then at most
`MAX_MARKERS` occurrences per chunk are looked at, each with one anchored,
bounded regular-expression match (key, colon, number: whitespace runs up to
`MAX_SPACE`, at most `MAX_DIGITS` digits) and a look back of at most
`MAX_SPACE` bytes. A report counts only when it looks like a JSON key: the marker's
quote is preceded (whitespace aside) by `{` or `,`, so a `"cache_n"` inside a
string (whose quotes are escaped, `\\"`) is not one. The digits must end
inside the chunk. What is therefore missed, by design: a report split across
two body chunks (the upstream read boundary fell inside it), a report more than
`SCAN_TAIL` bytes before the end of its chunk, a report past the 8th marker in
one chunk, a number of more than 12 digits, `null`, and
compressed bodies. The last report of a response wins (vLLM's continuous usage
stats repeat it).

Counts, per replica, two lists (predicted hit, predicted miss), each
`[engine hit, engine miss, cached tokens, hit threshold]`. An engine hit is a
report of at least one routing block's worth of tokens (`block_bytes / 4`, 64
by default), not merely > 0: engines reuse the chat template's opening across
unrelated prompts (vLLM caches whole 16-token blocks, and Llama 3's system
header is ~30 tokens; llama.cpp reuses a slot's common first tokens), so
"> 0" would call nearly every request on a warm replica a hit. The policy keys
on complete blocks only, so a prefix shorter than one block is not one it
predicts either.
The policy hands the request the list for its decision (`request.outcome`, no
allocation); the exchange adds the report when the response completes
(`record`). A response without a report counts nowhere. The exposition
(`prefix_metrics`) reads them at scrape time, with the families the placement
table holds per replica.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

MARKER = b'"cache'
SCAN_TAIL = 1024  # bytes at the end of a body chunk looked at (4x what the engines need)
SCAN_FROM = -SCAN_TAIL  # bytes.find(MARKER, SCAN_FROM): the start of that tail
MAX_MARKERS = 8  # occurrences of the marker looked at per body chunk
MAX_SPACE = 64  # whitespace bytes skipped around the key and the colon (pretty JSON)
MAX_DIGITS = 12  # longer numbers are not a report (10^12 tokens is no prompt)
NO_REPORT = -1

# Indexes into one outcome list.
ENGINE_HIT, ENGINE_MISS, CACHED_TOKENS, HIT_TOKENS = 0, 1, 2, 3
# Indexes into a replica's (predicted hit, predicted miss) pair.
PREDICTED_HIT, PREDICTED_MISS = 0, 1

_SPACE = frozenset(b" \t\r\n")
_KEY_BEFORE = frozenset(b"{,")
# The key, the colon and the number, matched at a marker (bounded: no unbounded repeat).
# The number must be followed by `,`, `}` or whitespace inside the chunk: one that reaches
# the chunk's end may go on in the next one, and is not read.
_REPORT = re.compile(rb'"cache(?:_n|d_tokens)"[ \t\r\n]{0,%d}:[ \t\r\n]{0,%d}([0-9]{1,%d})'
                     rb"[,} \t\r\n]" % (MAX_SPACE, MAX_SPACE, MAX_DIGITS))


def cached_tokens(data: bytes, previous: int) -> int:
    """The cached prompt tokens the last engine report in `data` gives, else `previous`."""
    pos = data.find(MARKER, SCAN_FROM)
    if pos < 0:
        return previous
    return _reports(data, pos, previous)


def _reports(data: bytes, pos: int, found: int) -> int:
    for _ in range(MAX_MARKERS):
        value, end = _report_at(data, pos)
        if value >= 0:
            found = value
        pos = data.find(MARKER, end)
        if pos < 0:
            break
    return found


def _report_at(data: bytes, pos: int) -> tuple[int, int]:
    """(the report whose marker starts at `pos`, or NO_REPORT; where to look on)."""
    m = _REPORT.match(data, pos)
    if m is None:
        return NO_REPORT, pos + len(MARKER)
    # A key, not text inside a string: `{` or `,` before its quote (whitespace aside).
    j = pos - 1
    stop = pos - 1 - MAX_SPACE
    if stop < -1:
        stop = -1
    while j > stop and data[j] in _SPACE:
        j -= 1
    if j <= stop or data[j] not in _KEY_BEFORE:
        return NO_REPORT, m.end()
    return int(m.group(1)), m.end()


def record(outcome: list[int], cached: int) -> None:
    """A response reported `cached` (>= 0) cached prompt tokens: count it in `outcome`."""
    outcome[ENGINE_HIT if cached >= outcome[HIT_TOKENS] else ENGINE_MISS] += 1
    outcome[CACHED_TOKENS] += cached


def new_outcomes(hit_tokens: int) -> tuple[list[int], list[int]]:
    """A replica's (predicted hit, predicted miss) counters; an engine hit is a report
    of at least `hit_tokens` cached tokens (at least 1)."""
    hit_tokens = max(1, hit_tokens)
    return [0, 0, 0, hit_tokens], [0, 0, 0, hit_tokens]


def prefix_metrics(policy: Any, worker: str) -> Iterator[Metric]:
    """The prefix policy's checkable routing, per replica (read at scrape time)."""
    outcomes: dict[str, tuple[list[int], list[int]]] | None = getattr(
        policy, "outcomes", None)
    if outcomes is None:
        return
    margin = GaugeMetricFamily(
        "sluice_prefix_spill_margin", "Requests above the mean in flight a known family's "
        "replica may hold on this proxy before its overflow spills: spill_margin times 1 to 2 "
        "as placed families fill the caches, or over the square root of the proxies "
        "sharing the fleet (docs/routing.md; 0: off)", labels=["worker"])
    margin.add_metric([worker], policy.spill_margin)
    yield margin
    placement = getattr(policy, "placement", None)
    if placement is not None:
        families = GaugeMetricFamily(
            "sluice_prefix_families", "Prompt families the prefix policy's placement table "
            "holds per replica (placement: capacity, or auto with Redis)",
            labels=["replica", "worker"])
        capacity = GaugeMetricFamily(
            "sluice_prefix_family_capacity", "Families a replica can keep cached, as the "
            "placement counts them (engine slots, KV tokens / window, or the default)",
            labels=["replica", "worker"])
        traffic = GaugeMetricFamily(
            "sluice_prefix_recent_traffic", "Requests routed to a replica recently (halved "
            "every 30 s; per-slot engines only), by this proxy and by the other proxies as "
            "their in-flight entries last showed it plus the new families they placed in "
            "the last 2 s: an idle fleet's new family goes where the sum is least",
            labels=["replica", "proxies", "worker"])
        caps = placement.capacity
        own, others, fresh = placement.traffic, placement.peer_traffic, placement.peer_fresh
        for replica, count in placement.placed.items():
            families.add_metric([replica.url, worker], count)
            cap = caps.get(replica)
            if cap is not None:
                capacity.add_metric([replica.url, worker], cap)
            traffic.add_metric([replica.url, "this", worker], own.get(replica, 0.0))
            traffic.add_metric([replica.url, "others", worker],
                               others.get(replica, 0.0) + fresh.get(replica, 0))
        yield families
        yield capacity
        yield traffic
    confusion = CounterMetricFamily(
        "sluice_prefix_outcomes", "Responses whose engine reported its cached prompt tokens "
        "(llama.cpp timings.cache_n, usage.prompt_tokens_details.cached_tokens), by the "
        "prefix policy's prediction (hit: it routed a known prefix or placed family to "
        "this replica) and the engine's report (hit: at least one routing block's worth "
        "of cached tokens, block_bytes / 4); responses without a report count nowhere",
        labels=["replica", "predicted", "engine", "worker"])
    tokens = CounterMetricFamily(
        "sluice_prefix_engine_cached_tokens", "Cached prompt tokens the engine reported, "
        "summed over the responses counted in sluice_prefix_outcomes_total",
        labels=["replica", "worker"])
    reports = CounterMetricFamily(
        "sluice_prefix_engine_reports", "Responses with an engine report of cached prompt "
        "tokens (the sum of sluice_prefix_outcomes_total over predicted and engine)",
        labels=["replica", "worker"])
    for url, pair in outcomes.items():
        total_tokens = total_reports = 0
        for predicted, counts in zip(("hit", "miss"), pair, strict=True):
            confusion.add_metric([url, predicted, "hit", worker], counts[ENGINE_HIT])
            confusion.add_metric([url, predicted, "miss", worker], counts[ENGINE_MISS])
            total_tokens += counts[CACHED_TOKENS]
            total_reports += counts[ENGINE_HIT] + counts[ENGINE_MISS]
        tokens.add_metric([url, worker], total_tokens)
        reports.add_metric([url, worker], total_reports)
    yield confusion
    yield tokens
    yield reports
