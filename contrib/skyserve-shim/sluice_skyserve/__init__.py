"""Make Sky Serve run sluice as its load balancer, without editing SkyPilot's files.

Sky Serve's service process does `from sky.serve import load_balancer` and
starts `load_balancer.run_load_balancer(controller_addr, port, policy,
tls_credential, target_qps_per_replica, stream_timeout_seconds)` in a child
process. This package's .pth file (run by `site` at interpreter start) puts an
import hook in front of `sky.serve.load_balancer`: the real module loads as
usual, then its `run_load_balancer` is replaced by sluice's
(`proxy.skyserve.run_load_balancer`, same signature); Sky's own stays
reachable as `sky_run_load_balancer`. Nothing else of SkyPilot changes.

`SLUICE_SKYSERVE_LB=0` in the environment turns the hook off (Sky's own load
balancer runs). Checked against SkyPilot 0.14.1 (see docs/skyserve.md).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

TARGET = "sky.serve.load_balancer"
ENV = "SLUICE_SKYSERVE_LB"


class _Loader:
    """Runs the real loader, then swaps in sluice's entry point."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def create_module(self, spec: Any) -> ModuleType | None:
        create = getattr(self._real, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._real.exec_module(module)
        try:
            from proxy.skyserve import run_load_balancer
        except ImportError as exc:  # sluice missing or broken: Sky's own LB keeps working
            print(f"sluice-skyserve: cannot import sluice ({exc}); Sky Serve's own load "
                  "balancer stays in use", file=sys.stderr)
            return
        module.sky_run_load_balancer = module.run_load_balancer  # type: ignore[attr-defined]
        module.run_load_balancer = run_load_balancer  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Finder:
    """A meta-path finder for exactly one module name."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET or os.environ.get(ENV, "1") == "0":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)  # type: ignore[assignment]
                return spec
        return None


def install() -> None:
    """Put the hook first on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def active() -> bool:
    """True when `sky.serve.load_balancer.run_load_balancer` is sluice's."""
    module = sys.modules.get(TARGET)
    return module is not None and getattr(module, "sky_run_load_balancer", None) is not None
