"""From an engine's Prometheus text to one `EngineStats` record: which names each engine
serves (checked against their source and docs: docs/engines.md cites them), how they
are read (`parse_metrics`, with prometheus_client's text parser), and what two
scrapes in a row say about the interval between them (`summarize`).

Pure: no I/O, no clock. The engine is detected from the names it serves; text with
none of them is "unknown", never an error.

Only the lines of names in `_NAMES` are read: an engine's page has hundreds of lines
(vLLM: a dozen histograms of 20-odd buckets per engine), and parsing what is never
read would be most of the cost with 100 replicas. The label grammar of each distinct
series goes through prometheus_client's parser once (`_series`); then only the value
changes (bench/engine_scrape.py has the costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from proxy.wire.engines import EngineStats

# sample name -> (engine, kind, key). Kinds: "sum" (a gauge of counts, summed over the
# series: vLLM and SGLang label one series per data-parallel engine), "mean" (a ratio,
# averaged over the series), "counter" (summed; rates come from two scrapes), "bucket"
# (a TTFT histogram bucket, summed per `le`), "capacity" (KV-cache size in tokens).
_NAMES: dict[str, tuple[str, str, str]] = {
    # vLLM V1: vllm/v1/metrics/loggers.py (PrometheusStatLogger)
    "vllm:num_requests_running": ("vllm", "sum", "running"),
    "vllm:num_requests_waiting": ("vllm", "sum", "waiting"),
    "vllm:kv_cache_usage_perc": ("vllm", "mean", "kv_usage"),
    "vllm:gpu_cache_usage_perc": ("vllm", "mean", "kv_usage_deprecated"),  # before 0.10
    "vllm:prefix_cache_queries_total": ("vllm", "counter", "cache_queries"),
    "vllm:prefix_cache_hits_total": ("vllm", "counter", "cache_hits"),
    "vllm:gpu_prefix_cache_queries_total": ("vllm", "counter", "cache_queries_deprecated"),
    "vllm:gpu_prefix_cache_hits_total": ("vllm", "counter", "cache_hits_deprecated"),
    "vllm:generation_tokens_total": ("vllm", "counter", "generated"),
    "vllm:time_to_first_token_seconds_bucket": ("vllm", "bucket", "ttft"),
    "vllm:cache_config_info": ("vllm", "capacity", "cache_config"),
    # SGLang: python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector,
    # TokenizerMetricsCollector); docs/references/production_metrics.md
    "sglang:num_running_reqs": ("sglang", "sum", "running"),
    "sglang:num_queue_reqs": ("sglang", "sum", "waiting"),
    "sglang:token_usage": ("sglang", "mean", "kv_usage"),
    "sglang:cache_hit_rate": ("sglang", "mean", "hit_rate"),
    "sglang:max_total_num_tokens": ("sglang", "capacity", "max_total_num_tokens"),
    "sglang:max_running_requests": ("sglang", "slots", "max_running_requests"),
    "sglang:generation_tokens_total": ("sglang", "counter", "generated"),
    "sglang:time_to_first_token_seconds_bucket": ("sglang", "bucket", "ttft"),
    # llama.cpp llama-server --metrics: tools/server/server.cpp (handle_metrics); the
    # KV gauges were dropped from recent builds and are read when present; the KV size
    # is not a metric (the scraper reads /props once: n_ctx per slot x total_slots).
    "llamacpp:requests_processing": ("llamacpp", "sum", "running"),
    "llamacpp:requests_deferred": ("llamacpp", "sum", "waiting"),
    "llamacpp:kv_cache_usage_ratio": ("llamacpp", "mean", "kv_usage"),
    "llamacpp:tokens_predicted_total": ("llamacpp", "counter", "generated"),
    "llamacpp:prompt_tokens_total": ("llamacpp", "counter", "prompt_uncached"),
    "llamacpp:prompt_tokens_cached_total": ("llamacpp", "counter", "prompt_cached"),
    # TGI: docs/source/reference/metrics.md (router/src/server.rs, infer/queue.rs)
    "tgi_batch_current_size": ("tgi", "sum", "running"),
    "tgi_queue_size": ("tgi", "sum", "waiting"),
    "tgi_request_generated_tokens_sum": ("tgi", "counter", "generated"),
}
_PREFIXES = (("vllm:", "vllm"), ("sglang:", "sglang"), ("llamacpp:", "llamacpp"),
             ("tgi_", "tgi"))  # fmt: skip


@dataclass(slots=True)
class Sample:
    """What one scrape read: the engine, its gauges, counters and TTFT buckets."""

    engine: str = "unknown"
    sums: dict[str, float] = field(default_factory=dict)
    means: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    ttft: dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    capacity: int | None = None
    slots: int | None = None

    def mean(self, key: str) -> float | None:
        values = self.means.get(key)
        return sum(values) / len(values) if values else None


def _wanted(text: str) -> list[tuple[str, str]]:
    """(series, value text) of the sample lines of names in `_NAMES`; comments and every
    other name dropped. The series is `name{labels}`: the labels end at the line's last
    `}` (a label value may hold one; the value and timestamp never do)."""
    kept = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if 0 <= brace < space or (brace >= 0 and space < 0):
            if line[:brace] not in _NAMES:
                continue
            end = line.rfind("}") + 1
            if end <= brace:
                raise ValueError(f"unterminated labels in {line[:80]!r}")
            kept.append((line[:end], line[end:]))
        elif space > 0 and line[:space] in _NAMES:
            kept.append((line[:space], line[space:]))
    return kept


#: series text -> (name, labels) as prometheus_client's parser reads it. The label
#: grammar (escapes, quoting) is the parser's; it costs ~25 us a line, and a page's
#: series repeat at every scrape while only their values change, so each distinct
#: series is parsed once. Bounded: cleared when full.
_SERIES: dict[str, tuple[str, dict[str, str]]] = {}
_SERIES_MAX = 16384


def _series(series: str) -> tuple[str, dict[str, str]]:
    known = _SERIES.get(series)
    if known is None:
        samples = [s for f in text_string_to_metric_families(series + " 0\n")
                   for s in f.samples]  # fmt: skip
        if len(samples) != 1:
            raise ValueError(f"not one sample: {series[:80]!r}")
        known = (samples[0].name, dict(samples[0].labels))
        if len(_SERIES) >= _SERIES_MAX:
            _SERIES.clear()
        _SERIES[series] = known
    return known


def detect(text: str) -> str:
    """The engine whose names `text` serves, or "unknown"."""
    for prefix, engine in _PREFIXES:
        if f"\n{prefix}" in text or text.startswith(prefix) or f"# TYPE {prefix}" in text:
            return engine
    return "unknown"


def parse_metrics(text: str) -> Sample:
    """Read an engine's Prometheus text. Raises ValueError on text the parser rejects."""
    sample = Sample()
    for series, rest in _wanted(text):
        name, labels = _series(series)
        fields = rest.split()
        if not 1 <= len(fields) <= 2:  # a value, and maybe a timestamp
            raise ValueError(f"bad sample line for {series[:80]!r}")
        value = float(fields[0])
        known = _NAMES.get(name)
        if known is None or not math.isfinite(value):
            continue
        engine, kind, key = known
        sample.engine = engine
        match kind:
            case "sum":
                sample.sums[key] = sample.sums.get(key, 0.0) + value
            case "mean":
                sample.means.setdefault(key, []).append(value)
            case "counter":
                sample.counters[key] = sample.counters.get(key, 0.0) + value
            case "bucket":
                le = float(labels.get("le", "nan"))
                if not math.isnan(le):
                    sample.ttft[le] = sample.ttft.get(le, 0.0) + value
            case "slots":
                if value >= 0:
                    sample.slots = (sample.slots or 0) + int(value)
            case "capacity":
                tokens = _capacity(key, labels, value)
                if tokens is not None:
                    sample.capacity = (sample.capacity or 0) + tokens
    if sample.engine == "unknown":
        sample.engine = detect(text)
    return sample


def _capacity(key: str, labels: dict[str, str], value: float) -> int | None:
    if key == "cache_config":  # vLLM: an info gauge; the sizes are labels
        try:
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            return None
    return int(value) if math.isfinite(value) and value >= 0 else None


def _delta(cur: Sample, prev: Sample | None, key: str) -> float | None:
    """A counter's increase since `prev` (None: unknown, or the engine restarted). A
    series absent from `prev` started since (prometheus_client shows a labelled series
    once it is first touched): it counts from 0."""
    if prev is None or key not in cur.counters:
        return None
    d = cur.counters[key] - prev.counters.get(key, 0.0)
    return d if d >= 0 else None


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over (le, cumulative count) pairs sorted by le:
    linear within the bucket; the highest finite bound when the rank falls in +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _ttft(cur: Sample, prev: Sample | None) -> tuple[float | None, float | None]:
    if prev is None or not cur.ttft:
        return None, None
    buckets = []
    for le in sorted(cur.ttft):
        d = cur.ttft[le] - prev.ttft.get(le, 0.0)
        if d < 0:
            return None, None  # restarted
        buckets.append((le, d))
    return quantile(0.5, buckets), quantile(0.99, buckets)


def _ratio(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else min(1.0, max(0.0, value))


def summarize(cur: Sample, prev: Sample | None, dt: float, *, url: str, at: float) -> EngineStats:
    """One replica's record from this scrape and the one before (`dt` seconds earlier;
    None on the first). Interval figures (TTFT, tokens/s, vLLM's hit rate) are None on
    the first scrape and after an engine restart."""
    if prev is not None and prev.engine != cur.engine:
        prev = None
    kv = cur.mean("kv_usage")
    if kv is None:
        kv = cur.mean("kv_usage_deprecated")
    hit_rate = cur.mean("hit_rate")  # SGLang's own gauge
    if hit_rate is None:
        for suffix in ("", "_deprecated"):
            queries = _delta(cur, prev, "cache_queries" + suffix)
            hits = _delta(cur, prev, "cache_hits" + suffix)
            if queries and hits is not None:
                hit_rate = hits / queries
                break
    if hit_rate is None:  # llama.cpp: prompt_tokens_total excludes the cached ones
        cached = _delta(cur, prev, "prompt_cached")
        uncached = _delta(cur, prev, "prompt_uncached")
        if cached is not None and uncached is not None and cached + uncached > 0:
            hit_rate = cached / (cached + uncached)
    generated = _delta(cur, prev, "generated")
    p50, p99 = _ttft(cur, prev)
    running, waiting = cur.sums.get("running"), cur.sums.get("waiting")
    return EngineStats(
        url=url,
        engine=cur.engine,
        at=at,
        running=max(0.0, running) if running is not None else None,
        waiting=max(0.0, waiting) if waiting is not None else None,
        kv_usage=_ratio(kv),
        kv_capacity_tokens=cur.capacity,
        slots=cur.slots,
        prefix_hit_rate=_ratio(hit_rate),
        ttft_p50=p50,
        ttft_p99=p99,
        tokens_per_s=generated / dt if generated is not None and dt > 0 else None,
    )
