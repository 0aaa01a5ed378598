"""Run by test_skypilot_contract.py with the Python of the SkyPilot venv (.venv-sky):
asks the REAL SkyPilot package about what sluice's SkyPilot backend sends it.

stdin: JSON {"tasks": {label: task mapping}, "cluster_names": [...],
             "calls": {function: [keyword, ...]}, "status_fields": [...],
             "resources_attrs": [...]}
stdout: JSON {"version": ..., "tasks": {label: {"error": str | None, "resources": [...]}},
              "cluster_names": {name: error | None},
              "calls": {function: {"missing": [...], "error": str | None}}}

Imports only SkyPilot and the standard library (sluice is not installed there).
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any


def _resources(task: Any) -> list[dict[str, Any]]:
    out = []
    for r in task.resources:
        out.append(
            {
                "use_spot": bool(r.use_spot),
                "ports": [str(p) for p in (r.ports or [])],
                "accelerators": dict(r.accelerators or {}),
                "cloud": str(r.cloud) if r.cloud is not None else None,
                "region": r.region,
            }
        )
    return out


def _function(sky: Any, dotted: str) -> Any:
    obj = sky
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> None:
    import sky
    from sky.utils import common_utils

    request = json.load(sys.stdin)
    result: dict[str, Any] = {"version": sky.__version__, "tasks": {}, "cluster_names": {},
                              "calls": {}}  # fmt: skip
    for label, config in request["tasks"].items():
        try:
            task = sky.Task.from_yaml_config(config)
            result["tasks"][label] = {"error": None, "resources": _resources(task),
                                      "envs": dict(task.envs), "run": task.run}  # fmt: skip
        except Exception as exc:
            result["tasks"][label] = {"error": f"{type(exc).__name__}: {exc}", "resources": []}
    for name in request["cluster_names"]:
        try:
            common_utils.check_cluster_name_is_valid(name)
            result["cluster_names"][name] = None
        except Exception as exc:
            result["cluster_names"][name] = f"{type(exc).__name__}: {exc}"
    for dotted, keywords in request["calls"].items():
        try:
            params = inspect.signature(_function(sky, dotted)).parameters
            missing = [k for k in keywords if k not in params]
            result["calls"][dotted] = {"missing": missing, "error": None}
        except Exception as exc:
            result["calls"][dotted] = {"missing": keywords, "error": repr(exc)}
    # Names the client reads off the module.
    for attr in ("StatusRefreshMode.FORCE", "StatusRefreshMode.NONE",
                 "exceptions.ClusterDoesNotExist", "exceptions.ResourcesUnavailableError",
                 "exceptions.ServerTemporarilyUnavailableError"):  # fmt: skip
        try:
            _function(sky, attr)
            result["calls"][attr] = {"missing": [], "error": None}
        except Exception as exc:
            result["calls"][attr] = {"missing": [attr], "error": repr(exc)}
    from sky.schemas.api.responses import StatusResponse

    fields = StatusResponse.model_fields
    result["status_fields_missing"] = [f for f in request["status_fields"] if f not in fields]
    resources = sky.Resources()
    result["resources_attrs_missing"] = [
        a for a in request["resources_attrs"] if not hasattr(resources, a)
    ]
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
