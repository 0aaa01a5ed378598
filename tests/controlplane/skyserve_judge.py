"""Run by test_skyserve_corpus.py with the Python of the SkyPilot venv (.venv-sky): the
verdict of SkyPilot 0.14.1's own client-side checks on service YAMLs, as `sky serve up`
makes them before it sends anything to an API server:
`sky.client.cli.command._generate_task_with_service` (`sky.Task.from_yaml_config` with
the --env/--secret overrides: the task and service schemas, `SkyServiceSpec
.from_yaml_config`, resources; then the service port rules) and
`sky.serve.serve_utils.validate_service_task` (spot and fallback rules, the spot placer).

argv: OUT.json; stdin: JSON {label: {"file": name, "text": yaml, "envs": {..},
"secrets": {..}}}. Writes {"verdicts": {label: null (accepted) | "Type: message"},
"meanings": {label: what SkyPilot made of an accepted one (`_meaning`)}} to OUT.json
(stdout carries SkyPilot's own prints). Imports only SkyPilot and the standard library.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def _meaning(task: Any) -> dict[str, Any]:
    """What SkyPilot made of an accepted service: the fields sluice reads."""
    from sky.serve import constants

    spec = task.service
    post = spec.post_data
    # None where the YAML gives no delay: the autoscaler then uses these constants.
    up, down = spec.upscale_delay_seconds, spec.downscale_delay_seconds
    return {
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas if spec.max_replicas is not None
        else spec.min_replicas,
        "num_overprovision": spec.num_overprovision or 0,
        "target_qps_per_replica": spec.target_qps_per_replica,
        "upscale_delay_seconds": constants.AUTOSCALER_DEFAULT_UPSCALE_DELAY_SECONDS
        if up is None else up,
        "downscale_delay_seconds": constants.AUTOSCALER_DEFAULT_DOWNSCALE_DELAY_SECONDS
        if down is None else down,
        "base_ondemand_fallback_replicas": spec.base_ondemand_fallback_replicas or 0,
        "dynamic_ondemand_fallback": bool(spec.dynamic_ondemand_fallback),
        "readiness_path": spec.readiness_path,
        "initial_delay_seconds": spec.initial_delay_seconds,
        "readiness_timeout_seconds": spec.readiness_timeout_seconds,
        "endpoint_probe_interval_seconds": spec.endpoint_probe_interval_seconds,
        "post_data": json.loads(post) if isinstance(post, str) else post,
        "readiness_headers": dict(spec.readiness_headers or {}),
        "lb_stream_timeout_seconds": spec.lb_stream_timeout_seconds,
        "load_balancing_policy": spec.load_balancing_policy,
        "port": int(spec.ports) if spec.ports is not None else None,
        "num_nodes": task.num_nodes,
        "envs": dict(task.envs),
        "secrets": {k: v.get_secret_value() for k, v in task.secrets.items()},
        "use_spot": sorted({bool(r.use_spot) for r in task.resources}),
        "run": task.run,
    }  # fmt: skip


def main() -> None:
    from sky.client.cli import command
    from sky.serve import serve_utils

    cases = json.load(sys.stdin)
    verdicts: dict[str, str | None] = {}
    meanings: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, case in cases.items():
            path = Path(tmp) / label.replace("/", "_") / case["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(case["text"])
            try:
                task = command._generate_task_with_service(
                    service_name="svc", service_yaml_args=(str(path),), workdir=None,
                    cloud=None, region=None, zone=None, num_nodes=None, use_spot=None,
                    image_id=None, env_file=None, env=list(case["envs"].items()),
                    secret_file=None, secret=list(case["secrets"].items()), gpus=None,
                    instance_type=None, ports=None, cpus=None, memory=None, disk_size=None,
                    disk_tier=None, network_tier=None, local_disk=None,
                    not_supported_cmd="sky serve up", pool=False,
                )  # fmt: skip
                serve_utils.validate_service_task(task, pool=False)
                verdicts[label] = None
                meanings[label] = _meaning(task)
            except BaseException as exc:  # click's UsageError, SystemExit too
                verdicts[label] = f"{type(exc).__name__}: {exc}"
    Path(sys.argv[1]).write_text(json.dumps({"verdicts": verdicts, "meanings": meanings},
                                            default=str))


if __name__ == "__main__":
    main()
