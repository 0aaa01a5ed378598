"""`sluice`: the command line. Parse, build config, call one function.

    sluice run FILE [-n NAME] [--env K=V]     everything in the foreground (controlplane.run)
    sluice up FILE [-n NAME] [--env K=V] [-y] ops commands: Redis only (controlplane.ops)
    sluice update NAME FILE [--mode MODE]
    sluice down NAME... | -a  [--purge] [--replica-id ID] [-y]
    sluice status [NAME...] [-v] [--json] [--endpoint]
    sluice replica add|remove NAME URL
    sluice replica preempt NAME ID
    sluice snapshot NAME [--json] [--watch]
    sluice logs NAME [ID...] [--controller] [--load-balancer] [--no-follow] [--tail N]

The commands and options `sky serve` has take the same names and arguments (SkyPilot
0.14.1, sky/client/cli/command.py), so a Sky Serve user's habits work here.
    sluice controller                         long-running: the controller
    sluice proxy                              long-running: = sluice-proxy

Every command takes `--redis URL` (env SLUICE_REDIS_URL), `--redis-ca-file` (env
SLUICE_REDIS_CA_FILE) and `--prefix` (env SLUICE_PREFIX); without `--redis`, the
ops commands use the Redis of a `sluice run` alive on `--state-dir` (its
`run.json`, and the password from the 0600 file it names), else
redis://127.0.0.1:6379/0. Service names are checked (`check_service_name`)
before any Redis call or path.
Other options follow click's `auto_envvar_prefix="SLUICE"` (SLUICE_RUN_PORT ...).

Errors are translated at one boundary (`common.errors`), into one line on stderr
and exit code 1: a SpecError names the file and the field path, an unreachable
Redis names the URL (password redacted). A spec is loaded and validated before
any connection to Redis, so an invalid file never reaches it.

Modules: `common` (shared options, the error boundary, where Redis is), `services`
(up, update, down, status), `snapshot`, `replicas` (replica add|remove|preempt),
`logs`, `launch` (run, controller), `main` (the group and `main`). Option defaults
that the library also has are read from it (RunConfig, ControllerConfig, LagLimits,
DEFAULT_PREFIX, DEFAULT_STATE_DIR), so each is written once.

It may import all of controlplane and `proxy.cli` (the proxy command, --redis check);
nothing in controlplane imports it (children start it as `python -m controlplane.cli`).
The rules: scripts/import_graph.py `MAY_IMPORT` (run by tests/test_layout.py).
"""

from controlplane.cli.main import cli, main

__all__ = ["cli", "main"]
