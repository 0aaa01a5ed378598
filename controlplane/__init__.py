"""sluice's control plane: the controller, the state store and the CLI (`sluice`).
Python 3.11+.

Owns everything but the request path, layered so imports go one way (bottom first):

    states, errors, statedir, processes       leaves (only proxy.wire, proxy.redisurl)
    records, servicespec/                     what is stored and what the user writes
    lease, store/                             the only Redis readers/writers
    prober, lifecycle, rollout, autoscaler    decisions, pure but for the prober's HTTP
    backends/                                 how replicas run (local, external, skypilot)
    ops/ | reconcile/                         side by side (neither imports the other): the
                                              ops commands (Redis only, they nudge the
                                              controller) | the controller
    run/, cli/, display, redisserver          the commands users run

May import from the proxy only `proxy.wire` (the contract), `proxy.redisurl` (Redis URL
parsing, shared so both sides accept the same URLs) and `proxy.cli` (for
`sluice proxy`); `MAY_IMPORT` in scripts/import_graph.py holds every package's rule
and tests/test_layout.py runs it. The proxy package
(`sluice-proxy`, and the Sky Serve drop-in `proxy.skyserve`) also runs on 3.10, Sky
Serve's controller runtime; this package does not.
"""

import sys

if sys.version_info < (3, 11):  # pragma: no cover - checked by a 3.10 subprocess test
    raise ImportError(
        "sluice's controller and CLI (the `sluice` command, package controlplane) need "
        f"Python 3.11 or newer; this is {sys.version.split()[0]}. On Python 3.10 only "
        "the proxy runs: `sluice-proxy` and the Sky Serve drop-in proxy.skyserve."
    )
