"""`sluice run FILE`: one service and everything it needs, in the foreground.

`ServiceRun.run()` starts, in order:

1. a private redis-server (`controlplane.redisserver.EmbeddedRedis`, state in
   `{state_dir}/redis`) unless a Redis URL is given;
2. the controller, `python -m controlplane.cli controller ...`, logging to
   `{state_dir}/controller.log`;
3. the proxy, `python -m proxy.cli --redis URL --service NAME ...`, logging to
   `{state_dir}/{name}/proxy.log`;
4. `ops.up` of the service; the controller launches the replicas;

then shows them coming up (a table redrawn in place on a terminal, one line per
change otherwise) until SIGINT, SIGTERM or SIGHUP. Shutdown, in order: `ops.down`;
wait (at most `down_timeout`) for the controller to terminate the replicas and
unregister the service; stop the proxy, then the controller (SIGTERM, SIGKILL
after `stop_timeout`); kill any replica process group still alive (a controller
that missed the deadline, or died; handles from Redis and from the local
backend's handle files, identified by pid and start time); stop redis. A
second signal skips the waiting. Nothing is left running.

Children run in their own sessions, so a Ctrl-C on the terminal reaches only
this process, which then stops them in the order above; each also gets SIGTERM
if this process dies (Linux PR_SET_PDEATHSIG).

`{state_dir}/run.json` (a `RunInfo`) says where this run's Redis is and which
pids it started; the ops commands read it to find Redis when no `--redis` is
given. One `sluice run` per state dir.

Secrets: the private redis-server gets a random password (and listens on
127.0.0.1 only). The password is kept in `{state_dir}/redis/password` (0600, in
a 0700 directory; so is a password given in `--redis`); run.json holds the URL
without it and the path of that file. The controller and the proxy get the URL
in their environment (SLUICE_REDIS_URL), never in argv; their logs are 0600.

Modules: `config` (RunConfig, RunInfo and run.json, RunError), `children` (the
controller and proxy processes), `service` (ServiceRun: the order above). The
paths under the state dir come from `controlplane.statedir.StateDir`; leftover
replicas are stopped by the local backend's `localproc.stop_groups`.

It may import the rest of controlplane but the CLI, and the proxy's wire contract
(`MAY_IMPORT` in scripts/import_graph.py, run by tests/test_layout.py); nothing
imports it but the CLI.
"""

from controlplane.run.config import (
    RunConfig,
    RunError,
    RunInfo,
    read_run_info,
    run_redis_url,
    tls_files,
)
from controlplane.run.service import ServiceRun, run_service

__all__ = [
    "RunConfig",
    "RunError",
    "RunInfo",
    "ServiceRun",
    "read_run_info",
    "run_redis_url",
    "run_service",
    "tls_files",
]
