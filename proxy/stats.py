"""Plain counters on the request path; exported to Prometheus only at scrape time.

A prometheus_client Counter.inc() takes a lock (about a microsecond); the
request path instead bumps plain ints on one Stats object per process, and
`proxy.metrics` reads them when /metrics is scraped.
"""

from __future__ import annotations

import bisect

# Latency buckets in seconds, shared by the upstream latency and TTFB histograms.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0)


class Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum += value


class Stats:
    def __init__(self) -> None:
        self.requests_total = 0  # every request received (incl. 503s); the autoscaler's input
        self.responses: dict[int, int] = {}  # status code -> count (499 = client gone)
        self.cuts: dict[str, int] = {}  # cause -> responses cut short (proxy/cuts.py)
        self.attempts = 0
        self.retries = 0
        self.upstream_latency = Histogram()  # request start -> response complete
        self.ttfb = Histogram()  # request start -> response headers
        # Stream resumes (proxy/resume.py): (replica cut, cause, outcome) -> count.
        self.resumes: dict[tuple[str, str, str], int] = {}
        # Warm-ups of a family's new replica (proxy/warmup.py): outcome -> count.
        self.warmups: dict[str, int] = {}
        # Ready-set source figures, set by the source (Redis subscriber, Sky Serve sync).
        self.snapshots_rejected = 0
        self.placements_skipped = 0  # shared placement entries that failed to parse
        self.propagation = Histogram()  # published_at -> applied (seconds)
        self.source_connected = 0  # 1 when the source is reachable
        self.fleet_load = 0  # 1 while the prefix bound counts the other proxies' in flight
        # Drop-in mode: request timestamps dropped unsent (older than the autoscaler's window).
        self.timestamps_dropped = 0
        # Bounds (docs/security.md): gauges kept by the request path, refusals counted.
        self.connections_open = 0  # set by the sweeper
        self.connections_refused = 0  # closed at once: --max-connections reached
        self.pipeline_overflows = 0  # connections that queued more than --max-pipeline
        self.held = 0  # requests held for a ready replica now
        self.held_bytes = 0  # their request body bytes
        self.held_refused = 0  # 503 at once: --max-held or --max-held-bytes reached
        self.departed_while_held = 0  # clients found gone while held with reading paused

    def count_response(self, status: int) -> None:
        responses = self.responses
        responses[status] = responses.get(status, 0) + 1
