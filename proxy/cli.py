"""`sluice-proxy` (also `sluice proxy`): parse options, build one ProxyConfig, run.

With `--workers N > 1` this process supervises N worker processes that share
the port with SO_REUSEPORT (proxy/supervisor.py); each runs its own ready-set
source and admin listener (worker i on admin port + i). uvloop is chosen here
and only here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading

import click

from proxy import compat
from proxy.app import CLOSE_BOUND, ProxyApp
from proxy.config import ProxyConfig
from proxy.errors import ConfigError
from proxy.policies import POLICIES
from proxy.redisurl import RedisURLError, validate
from proxy.supervisor import Supervisor
from proxy.wire.keys import DEFAULT_PREFIX
from proxy.wire.snapshot import PrefixOptions

log = logging.getLogger("sluice.proxy")


def _split_urls(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    urls = tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r} is not an http(s):// URL", param_hint="--replicas")
    return urls


def _target_qps(values: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in values:
        name, sep, qps = item.partition("=")
        try:
            value = float(qps)
        except ValueError:
            value = -1.0
        if not sep or not name or value <= 0:
            raise click.BadParameter(f"{item!r}: expected ACCELERATOR=QPS with QPS > 0",
                                     param_hint="--target-qps")
        out[name] = value
    return out


# A process still shutting down this long after grace + CLOSE_BOUND exits anyway.
WATCHDOG_SLACK = 0.5


def _exit_now(seconds: float) -> None:
    # From the watchdog thread: no logging (its lock may be held by the stuck loop).
    os.write(2, b"sluice-proxy: shutdown still not finished %.1fs after the signal; "
                b"exiting now\n" % seconds)
    os._exit(1)


_PREFIX_FLAGS = {
    "prefix_block_bytes": "block_bytes",
    "prefix_bytes": "prefix_bytes",
    "prefix_session_header": "session_header",
    "prefix_user_field": "user_field",
    "prefix_epsilon": "epsilon",
    "prefix_lru_size": "lru_size",
}


def _prefix_options(opts: dict[str, object]) -> PrefixOptions | None:
    """The --prefix-* flags given, over the defaults; None when none is given."""
    given = {field: opts[flag] for flag, field in _PREFIX_FLAGS.items()
             if opts.get(flag) is not None}
    if not given:
        return None
    try:
        return PrefixOptions(**given)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--prefix-*") from exc


def check_redis_url(ctx: click.Context, param: click.Parameter, url: str | None) -> str | None:
    """Reject a malformed --redis before anything starts (shared by `sluice`)."""
    if url:
        try:
            validate(url)
        except RedisURLError as exc:
            # One line (exit 1), as every other error of the CLI; no usage text.
            raise click.ClickException(f"--redis: {exc}") from exc
    return url


def run_proxy(config: ProxyConfig) -> None:
    """Run one proxy process until SIGTERM/SIGINT, on uvloop.

    Shutdown ends within `shutdown_grace + CLOSE_BOUND` (ProxyApp.aclose bounds
    every step); a watchdog thread armed at the signal ends the process shortly
    after that in any case, e.g. if a task ignores cancellation when the loop
    is torn down.
    """
    import uvloop

    watchdog: threading.Timer | None = None

    async def serve() -> None:
        nonlocal watchdog
        app = ProxyApp(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await app.start()
        try:
            await stop.wait()
            log.info("shutting down: draining in-flight requests (grace %.0fs)",
                     config.shutdown_grace)
        finally:
            limit = config.shutdown_grace + CLOSE_BOUND + WATCHDOG_SLACK
            watchdog = threading.Timer(limit, _exit_now, (limit,))
            watchdog.daemon = True
            watchdog.start()
            await app.aclose()

    try:
        compat.run(serve(), loop_factory=uvloop.new_event_loop)
    finally:
        if watchdog is not None:
            watchdog.cancel()


ARGS_KEY = "sluice.proxy.args"


class _ProxyCommand(click.Command):
    """Keeps the options it was given (ctx.meta[ARGS_KEY]): the supervisor re-executes its
    workers with them, whichever entry point (`sluice proxy`, `sluice-proxy`) parsed them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGS_KEY] = list(args)
        return super().parse_args(ctx, args)


@click.command(cls=_ProxyCommand,
               context_settings={"help_option_names": ["-h", "--help"],
                                 "max_content_width": 100})
@click.option("--replicas", help="Static ready set: comma-separated replica URLs "
              "(http://host:port). One of --replicas, --redis or --controller-addr.")
@click.option("--redis", "redis_url", envvar="SLUICE_REDIS_URL", callback=check_redis_url,
              help="Redis URL (redis://, rediss://, unix:// or redis+sentinel://host:port[,...]"
                   "/service-name[/db], password allowed) holding the ready set; "
                   "needs --service. Env: SLUICE_REDIS_URL.")
@click.option("--redis-ca-file", type=click.Path(dir_okay=False), envvar="SLUICE_REDIS_CA_FILE",
              help="CA certificate(s) that signed the rediss:// server's certificate "
                   "(default: the system's). Env: SLUICE_REDIS_CA_FILE.")
@click.option("--service", help="Service name whose ready set to follow (with --redis).")
@click.option("--redis-prefix", "--prefix", "redis_prefix", default=DEFAULT_PREFIX,
              show_default=True, help="Redis key prefix.")
@click.option("--controller-addr", help="Drop-in mode: URL of an unmodified Sky Serve "
              "controller to sync the ready set from.")
@click.option("--sync-interval", type=float, default=5.0, show_default=True,
              help="Sky Serve sync period in seconds (drop-in mode).")
@click.option("--sync-timeout", type=float, default=5.0, show_default=True,
              help="Timeout of one Sky Serve sync request (drop-in mode).")
@click.option("--quick-resync/--no-quick-resync", default=True, show_default=True,
              help="Drop-in mode: when a sync empties a non-empty set, resync after 0.5 s "
                   "and 1 s while holding requests.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", "--load-balancer-port", "port", type=int, default=8080,
              show_default=True, help="Port to listen on (0: any free port).")
@click.option("--admin-host", default="127.0.0.1", show_default=True,
              help="Admin listener address (/healthz /readyz /metrics /snapshot).")
@click.option("--admin-port", type=int, default=9090, show_default=True,
              help="Admin listener port; worker i uses admin port + i. -1 disables it.")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Processes sharing the port (SO_REUSEPORT).")
@click.option("--worker-index", type=int, default=None, hidden=True)
@click.option("--sync-relay", default=None, hidden=True)
@click.option("--policy", "--load-balancing-policy", "policy",
              type=click.Choice(sorted(POLICIES)), default=None,
              help="Load-balancing policy; default: the snapshot's (least_load).")
@click.option("--target-qps", multiple=True, metavar="ACCEL=QPS",
              help="Per-accelerator capacity for instance_aware_least_load (repeatable).")
@click.option("--prefix-epsilon", type=click.FloatRange(0, min_open=True), default=None,
              help="prefix policy: bounded load; a replica holding more than (1 + E) x the "
                   "mean in flight is skipped for the next in rendezvous order. [default: 1]")
@click.option("--prefix-session-header", default=None, metavar="NAME",
              help="prefix policy: header whose value is the routing key ('' : none). "
                   "[default: X-Session-Id]")
@click.option("--prefix-user-field/--no-prefix-user-field", default=None,
              help="prefix policy: route on the JSON body's \"user\" field when present. "
                   "[default: off]")
@click.option("--prefix-block-bytes", type=click.IntRange(16), default=None,
              help="prefix policy: block size of the prompt's hash chain. [default: 256]")
@click.option("--prefix-bytes", type=click.IntRange(16, 1 << 20), default=None,
              help="prefix policy: request body bytes read before routing. [default: 16384]")
@click.option("--prefix-lru-size", type=click.IntRange(0), default=None,
              help="prefix policy: entries of the longest-prefix memory. [default: 16384]")
@click.option("--pool-size", type=click.IntRange(1), default=256, show_default=True,
              help="Connection limit per replica.")
@click.option("--pool-grace", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds a departed replica's pool stays open (comes back warm).")
@click.option("--retry-deadline", type=click.FloatRange(0, min_open=True), default=60.0,
              show_default=True, help="Total budget per request until response headers: "
              "waiting for a replica, for a connection, and every attempt.")
@click.option("--max-attempts", type=click.IntRange(1), default=3, show_default=True,
              help="Attempts per request, each on a different replica where possible.")
@click.option("--connect-timeout", type=click.FloatRange(0, min_open=True), default=5.0,
              show_default=True, help="Per-attempt connect timeout.")
@click.option("--empty-wait", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Hold a request this long for a ready replica before 503.")
@click.option("--hold-heartbeat", type=click.FloatRange(0), default=0.0, show_default=True,
              help="While a `\"stream\": true` request is held for a replica, answer 200 "
                   "text/event-stream at once and send an SSE comment every this many "
                   "seconds (keeps clients and cloud load balancers from timing out). "
                   "0: off.")
@click.option("--stream-idle-timeout", type=click.FloatRange(0, min_open=True), default=120.0,
              show_default=True, help="Max seconds between chunks: of a response (the stream is "
              "cut) and of a request body (408).")
@click.option("--header-timeout", type=click.FloatRange(0, min_open=True), default=30.0,
              show_default=True, help="Seconds a client has to send a whole request head "
              "(slowloris defence).")
@click.option("--max-body", type=click.IntRange(0), default=100 * 1024 * 1024,
              show_default=True, help="Largest request body in bytes (413 beyond).")
@click.option("--shutdown-grace", type=click.FloatRange(0), default=30.0, show_default=True,
              help="On SIGTERM, seconds to let in-flight requests finish.")
@click.option("--tls-certfile", type=click.Path(dir_okay=False), help="Serve HTTPS: cert.")
@click.option("--tls-keyfile", type=click.Path(dir_okay=False), help="Serve HTTPS: key.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.version_option(package_name="sluice", prog_name="sluice-proxy")
def proxy_command(**opts: object) -> None:
    """sluice-proxy: a fast load-balancing proxy for replicated model servers.

    \b
    Examples:
      sluice-proxy --replicas http://127.0.0.1:8001,http://127.0.0.1:8002
      sluice-proxy --redis redis://127.0.0.1:6379 --service llm --port 8080
      sluice-proxy --controller-addr http://127.0.0.1:20001 --load-balancer-port 8080
    """
    logging.basicConfig(level=str(opts["log_level"]).upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    workers = int(opts["workers"])  # type: ignore[call-overload]
    index = opts["worker_index"]
    admin_port = int(opts["admin_port"])  # type: ignore[call-overload]
    config = ProxyConfig(
        host=str(opts["host"]),
        port=int(opts["port"]),  # type: ignore[call-overload]
        admin_host=str(opts["admin_host"]),
        admin_port=None if admin_port < 0 else admin_port,
        workers=workers,
        worker_index=int(index) if index is not None else 0,  # type: ignore[call-overload]
        replicas=_split_urls(opts["replicas"]),  # type: ignore[arg-type]
        redis_url=opts["redis_url"],  # type: ignore[arg-type]
        service=opts["service"],  # type: ignore[arg-type]
        redis_prefix=str(opts["redis_prefix"]),
        redis_ca_file=opts["redis_ca_file"],  # type: ignore[arg-type]
        controller_addr=opts["controller_addr"],  # type: ignore[arg-type]
        sync_interval=float(opts["sync_interval"]),  # type: ignore[arg-type]
        sync_timeout=float(opts["sync_timeout"]),  # type: ignore[arg-type]
        quick_resync=bool(opts["quick_resync"]),
        sync_relay=opts["sync_relay"],  # type: ignore[arg-type]
        policy=opts["policy"],  # type: ignore[arg-type]
        target_qps=_target_qps(opts["target_qps"]),  # type: ignore[arg-type]
        prefix_options=_prefix_options(opts),
        pool_size=int(opts["pool_size"]),  # type: ignore[call-overload]
        pool_grace=float(opts["pool_grace"]),  # type: ignore[arg-type]
        retry_deadline=float(opts["retry_deadline"]),  # type: ignore[arg-type]
        max_attempts=int(opts["max_attempts"]),  # type: ignore[call-overload]
        connect_timeout=float(opts["connect_timeout"]),  # type: ignore[arg-type]
        empty_wait=float(opts["empty_wait"]),  # type: ignore[arg-type]
        hold_heartbeat=float(opts["hold_heartbeat"]),  # type: ignore[arg-type]
        stream_idle_timeout=float(opts["stream_idle_timeout"]),  # type: ignore[arg-type]
        header_timeout=float(opts["header_timeout"]),  # type: ignore[arg-type]
        max_body=int(opts["max_body"]),  # type: ignore[call-overload]
        shutdown_grace=float(opts["shutdown_grace"]),  # type: ignore[arg-type]
        tls_certfile=opts["tls_certfile"],  # type: ignore[arg-type]
        tls_keyfile=opts["tls_keyfile"],  # type: ignore[arg-type]
        log_level=str(opts["log_level"]).upper(),
    )
    if workers > 1 and index is None:
        if config.port == 0:
            raise click.UsageError("--workers > 1 needs a fixed --port")
        args = list(click.get_current_context().meta[ARGS_KEY])
        relay_dir = None
        if config.controller_addr:
            # Drop-in mode: worker 0 alone syncs with the controller; the others relay
            # through a private unix socket (proxy/skyserve.py).
            relay_dir = tempfile.mkdtemp(prefix="sluice-sync-")
            args = [*args, "--sync-relay", os.path.join(relay_dir, "relay.sock")]
        try:
            code = Supervisor(workers, args, shutdown_grace=config.shutdown_grace).run()
        finally:
            if relay_dir is not None:
                shutil.rmtree(relay_dir, ignore_errors=True)
        sys.exit(code)
    try:
        run_proxy(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    proxy_command(auto_envvar_prefix="SLUICE_PROXY")


if __name__ == "__main__":
    main()
