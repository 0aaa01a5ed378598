"""Prometheus exposition of the proxy's plain counters, built only when scraped."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from proxy.outcomes import prefix_metrics
from proxy.prefix import REASONS
from proxy.readyset import ReadySet
from proxy.stats import BUCKETS, Histogram, Stats


def _histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
    buckets = []
    total = 0
    for bound, count in zip(BUCKETS, hist.counts, strict=False):
        total += count
        buckets.append((repr(bound), total))
    total += hist.counts[-1]
    buckets.append(("+Inf", total))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist.sum)


# (metric suffix, help, EngineStats attribute) of the re-exported engine gauges.
_ENGINE_GAUGES = (
    ("requests_running", "Requests running in the replica's engine", "running"),
    ("requests_waiting", "Requests waiting in the replica's engine queue", "waiting"),
    ("kv_cache_usage_ratio", "Fraction of the engine's KV cache in use (0-1)", "kv_usage"),
    ("kv_cache_capacity_tokens", "The engine's KV-cache size in tokens", "kv_capacity_tokens"),
    ("prefix_cache_hit_ratio", "Prompt tokens served from the engine's prefix cache over "
     "the last scrape interval (0-1)", "prefix_hit_rate"),
    ("slots", "Sequences the engine runs at once (llama.cpp slots, SGLang max running "
     "requests)", "slots"),
    ("generation_tokens_per_second", "Tokens the engine generated per second over the "
     "last scrape interval", "tokens_per_s"),
)


class ProxyCollector:
    """The proxy's metrics, read from its ready set and counters at each scrape."""

    def __init__(self, ready_set: ReadySet, stats: Stats, *, worker: int) -> None:
        self._ready_set = ready_set
        self._stats = stats
        self._worker = str(worker)

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._replicas()
        yield from self._engines()
        yield from self._snapshot()
        yield from self._bounds()

    def _bounds(self) -> Iterator[Metric]:
        """What the limits of docs/security.md ("Bounds") hold now, and what they refused."""
        stats = self._stats
        yield GaugeMetricFamily("sluice_client_connections", "Open client connections",
                                value=stats.connections_open)
        yield CounterMetricFamily("sluice_client_connections_refused",
                                  "Connections closed at once: --max-connections reached",
                                  value=stats.connections_refused)
        yield CounterMetricFamily("sluice_pipeline_overflows",
                                  "Connections that pipelined more than --max-pipeline requests "
                                  "(closed after answering those)",
                                  value=stats.pipeline_overflows)
        yield GaugeMetricFamily("sluice_held_requests", "Requests held for a ready replica",
                                value=stats.held)
        yield GaugeMetricFamily("sluice_held_body_bytes",
                                "Request body bytes of the held requests",
                                value=stats.held_bytes)
        yield CounterMetricFamily("sluice_held_refused",
                                  "503s at once: --max-held or --max-held-bytes reached",
                                  value=stats.held_refused)
        yield CounterMetricFamily("sluice_held_clients_departed",
                                  "Held requests whose client was found gone (never sent)",
                                  value=stats.departed_while_held)

    def _requests(self) -> Iterator[Metric]:
        stats = self._stats
        responses = CounterMetricFamily(
            "sluice_responses", "Responses by status code (499: client went away)",
            labels=["code", "worker"])
        for code, count in sorted(stats.responses.items()):
            responses.add_metric([str(code), self._worker], count)
        yield responses
        cut = CounterMetricFamily(
            "sluice_responses_cut", "Responses cut short after their head, by cause "
            "(not counted in sluice_responses; see proxy/cuts.py)", labels=["cause", "worker"])
        for cause, count in sorted(stats.cuts.items()):
            cut.add_metric([cause, self._worker], count)
        yield cut
        yield CounterMetricFamily("sluice_requests", "Requests received",
                                  value=stats.requests_total)
        yield CounterMetricFamily("sluice_upstream_attempts", "Attempts sent to replicas",
                                  value=stats.attempts)
        yield CounterMetricFamily("sluice_upstream_retries", "Attempts that were retries",
                                  value=stats.retries)
        yield CounterMetricFamily("sluice_client_disconnects",
                                  "Requests whose client went away (499)",
                                  value=stats.responses.get(499, 0))
        resumes = CounterMetricFamily(
            "sluice_stream_resumes", "Streams cut by a replica and resumed on another "
            "(docs/resume.md), by the replica that cut them, the cause (reset, eof, "
            "idle_timeout, bad_response) and outcome (attempted, succeeded, failed)",
            labels=["replica", "cause", "outcome", "worker"])
        for (replica, cause, outcome), count in sorted(stats.resumes.items()):
            resumes.add_metric([replica, cause, outcome, self._worker], count)
        yield resumes
        warmups = CounterMetricFamily(
            "sluice_prefix_warmups", "Warm-ups of a prompt family's new replica "
            "(--prefix-warm-copies, proxy/warmup.py) by outcome: sent, warmed (answered "
            "2xx), failed, skipped (not a JSON completion request, or too many at once)",
            labels=["outcome", "worker"])
        for outcome, count in sorted(stats.warmups.items()):
            warmups.add_metric([outcome, self._worker], count)
        yield warmups
        yield _histogram("sluice_upstream_latency_seconds",
                         "Request start to end of response", stats.upstream_latency)
        yield _histogram("sluice_upstream_ttfb_seconds",
                         "Request start to response headers", stats.ttfb)

    def _replicas(self) -> Iterator[Metric]:
        ready_set = self._ready_set
        inflight = GaugeMetricFamily("sluice_replica_inflight", "In-flight requests per replica",
                                     labels=["replica"])
        pool_size = GaugeMetricFamily("sluice_pool_connections",
                                      "Open connections per replica pool", labels=["replica"])
        for url, replica in ready_set.known.items():
            inflight.add_metric([url], replica.inflight)
            pool_size.add_metric([url], replica.pool.size if replica.pool else 0)
        yield inflight
        yield pool_size
        routed = getattr(ready_set.policy, "routed", None)
        if routed is not None:
            family = CounterMetricFamily(
                "sluice_routed", "Requests routed per replica by the prefix policy, by reason "
                "(affinity: first choice or longest-prefix hit; spill: skipped a replica over "
                "the load bound; fallback: no key, or nobody within the bound)",
                labels=["replica", "reason", "worker"])
            for url, counts in routed.items():
                for reason, count in zip(REASONS, counts, strict=True):
                    family.add_metric([url, reason, self._worker], count)
            yield family
        yield from prefix_metrics(ready_set.policy, self._worker)  # proxy/outcomes.py
        yield GaugeMetricFamily("sluice_ready_replicas", "Replicas in the ready set",
                                value=len(ready_set.replicas))

    def _engines(self) -> Iterator[Metric]:
        """The engines' own telemetry per replica (proxy/wire/engines.py), as scraped by
        the controller: one Prometheus scrape of any proxy gives the fleet."""
        snap = self._ready_set.snapshot
        service = snap.service if snap is not None else ""
        labels = ["service", "replica", "replica_id", "engine"]
        families = [
            (GaugeMetricFamily(f"sluice_engine_{name}", doc, labels=labels), attr)
            for name, doc, attr in _ENGINE_GAUGES
        ]
        ttft = GaugeMetricFamily("sluice_engine_ttft_seconds", "Engine-reported time to "
                                 "first token over the last scrape interval",
                                 labels=[*labels, "quantile"])  # fmt: skip
        for url, replica in self._ready_set.known.items():
            e = replica.engine
            if e is None:
                continue
            values = [service, url, str(replica.id), e.engine]
            for family, attr in families:
                value = getattr(e, attr)
                if value is not None:
                    family.add_metric(values, value)
            for q, value in (("0.5", e.ttft_p50), ("0.99", e.ttft_p99)):
                if value is not None:
                    ttft.add_metric([*values, q], value)
        for family, _ in families:
            yield family
        yield ttft

    def _snapshot(self) -> Iterator[Metric]:
        ready_set, stats = self._ready_set, self._stats
        snap = ready_set.snapshot
        yield GaugeMetricFamily("sluice_snapshot_generation", "Generation of the snapshot in force",
                                value=snap.generation if snap else -1)
        yield GaugeMetricFamily("sluice_snapshot_applied_timestamp_seconds",
                                "Unix time this proxy applied the snapshot in force (0: none)",
                                value=ready_set.applied_at if snap else 0.0)
        yield GaugeMetricFamily("sluice_snapshot_age_seconds",
                                "Seconds since the snapshot in force was published",
                                value=time.time() - snap.published_at if snap else 0.0)
        yield CounterMetricFamily("sluice_snapshots_rejected",
                                  "Snapshot payloads that failed validation",
                                  value=stats.snapshots_rejected)
        yield CounterMetricFamily("sluice_placements_skipped",
                                  "Shared prefix placement entries skipped (malformed, "
                                  "unknown replica)", value=stats.placements_skipped)
        yield _histogram("sluice_snapshot_propagation_seconds",
                         "Snapshot published_at to applied by this proxy", stats.propagation)
        yield CounterMetricFamily("sluice_skyserve_timestamps_dropped",
                                  "Drop-in mode: request timestamps older than the "
                                  "autoscaler's 60 s window, dropped unsent",
                                  value=stats.timestamps_dropped)
        yield GaugeMetricFamily("sluice_source_connected",
                                "1 when the ready-set source (Redis, controller) is reachable",
                                value=stats.source_connected)
        yield GaugeMetricFamily("sluice_fleet_load",
                                "1 while the prefix policy's load bound counts the other "
                                "proxies' in-flight requests (--fleet-load, or auto on "
                                "batching engines)", value=stats.fleet_load)


def render(ready_set: ReadySet, stats: Stats, *, worker: int) -> bytes:
    """The Prometheus text exposition of one proxy process (`worker`: its index)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(ready_set, stats, worker=worker))
    return generate_latest(registry)
