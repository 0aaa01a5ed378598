"""`sluice dashboard`: a read-only web page of the fleet, live.

    model.py    pure: one poll of a service -> the fleet row, the service document,
                one chart sample (the replica rows are `sluice status --json`'s)
    poller.py   `Poller`: the one reader of Redis (once per second, whatever the number
                of open pages), the encoded documents and the charts' ring buffer
    server.py   the aiohttp app: the page, the JSON API, server-sent events; read-only
                (405), loopback by default, a token or TLS otherwise
    static/     the page: plain HTML, CSS and JS (no build step, no library, offline)

Its own process rather than a page of the proxy or controller: it needs neither's
privileges (only what `sluice status` reads), it can run where the operator is, and a
browser tab never adds load to the request path or the reconcile loop.

What it may import: scripts/import_graph.py `MAY_IMPORT` (run by tests/test_layout.py).
"""

from controlplane.dashboard.run import serve
from controlplane.dashboard.server import DashboardConfig, DashboardConfigError

__all__ = ["DashboardConfig", "DashboardConfigError", "serve"]
