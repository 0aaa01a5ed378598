"""Run by test_skyserve_corpus.py with the Python of the SkyPilot venv (.venv-sky): the
verdict of SkyPilot 0.14.1's own client-side checks on service YAMLs, as `sky serve up`
makes them before it sends anything to an API server:
`sky.client.cli.command._generate_task_with_service` (`sky.Task.from_yaml_config` with
the --env/--secret overrides: the task and service schemas, `SkyServiceSpec
.from_yaml_config`, resources; then the service port rules) and
`sky.serve.serve_utils.validate_service_task` (spot and fallback rules, the spot placer).

argv: OUT.json; stdin: JSON {label: {"file": name, "text": yaml, "envs": {..},
"secrets": {..}}}. Writes {label: null (accepted) | "Type: message"} to OUT.json (stdout
carries SkyPilot's own prints). Imports only SkyPilot and the standard library.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    from sky.client.cli import command
    from sky.serve import serve_utils

    cases = json.load(sys.stdin)
    verdicts: dict[str, str | None] = {}
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
            except BaseException as exc:  # click's UsageError, SystemExit too
                verdicts[label] = f"{type(exc).__name__}: {exc}"
    Path(sys.argv[1]).write_text(json.dumps(verdicts))


if __name__ == "__main__":
    main()
