"""sluice's controller, state store and CLI (`sluice`): Python 3.11+.

The proxy package (`sluice-proxy`, and the Sky Serve drop-in `proxy.skyserve`)
also runs on 3.10, Sky Serve's controller runtime; this package does not.
"""

import sys

if sys.version_info < (3, 11):  # pragma: no cover - checked by a 3.10 subprocess test
    raise ImportError(
        "sluice's controller and CLI (the `sluice` command, package controlplane) need "
        f"Python 3.11 or newer; this is {sys.version.split()[0]}. On Python 3.10 only "
        "the proxy runs: `sluice-proxy` and the Sky Serve drop-in proxy.skyserve."
    )
