"""`service.sluice.engine_metrics`: how the controller scrapes the replicas' model
servers (docs/engines.md). A sluice-only section; a Sky Serve YAML has none, and then
every READY replica is scraped at `/metrics` every second (a replica that serves no
metrics is "unknown", and is asked again less and less often, up to every 30 s).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

#: vLLM, SGLang (with --enable-metrics), llama-server (with --metrics) and TGI all serve
#: their metrics at this path of their API port.
DEFAULT_METRICS_PATH = "/metrics"
DEFAULT_SCRAPE_INTERVAL = 1.0


class EngineMetrics(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`service.sluice.engine_metrics`."""

    enabled: bool = True
    # None: the engines' default path (all four serve /metrics).
    path: Annotated[str, Meta(pattern=r"^/[^\s]*$", max_length=1024)] | None = None
    interval_seconds: Annotated[float, Meta(ge=0.2, le=300)] = DEFAULT_SCRAPE_INTERVAL
    # None: the replica's own port (where all four engines serve their metrics); set it
    # for a server that exports them on a port of its own.
    port: Annotated[int, Meta(ge=1, le=65535)] | None = None

    @property
    def metrics_path(self) -> str:
        return self.path or DEFAULT_METRICS_PATH
