"""`sluice-proxy` (also `sluice proxy`): parse options, build one ProxyConfig, run.

With `--workers N > 1` this process supervises N worker processes that share
the port with SO_REUSEPORT (proxy/runner.py); each runs its own ready-set
source and admin listener (worker i on admin port + i).

Every default is ProxyConfig's (or PrefixOptions'): the options read them from
DEFAULTS and PREFIX_DEFAULTS, so a default is written once.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

import click
import msgspec

from proxy.config import ProxyConfig
from proxy.errors import ConfigError
from proxy.policies import POLICIES
from proxy.redisurl import RedisURLError, validate
from proxy.runner import run_proxy, run_workers
from proxy.wire.snapshot import PrefixOptions

DEFAULTS = ProxyConfig()
PREFIX_DEFAULTS = PrefixOptions()


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


_PREFIX_FLAGS = {
    "prefix_block_bytes": "block_bytes",
    "prefix_bytes": "prefix_bytes",
    "prefix_session_header": "session_header",
    "prefix_user_field": "user_field",
    "prefix_epsilon": "epsilon",
    "prefix_spill_margin": "spill_margin",
    "prefix_lru_size": "lru_size",
    "prefix_placement": "placement",
    "prefix_replica_families": "replica_families",
    "prefix_warm_copies": "warm_copies",
}


def _prefix_options(flags: Mapping[str, object]) -> PrefixOptions | None:
    """The --prefix-* flags given (by option name), over the defaults; None when none is given."""
    given = {field: flags[flag] for flag, field in _PREFIX_FLAGS.items()
             if flags.get(flag) is not None}
    if not given:
        return None
    try:
        # replace() runs PrefixOptions' own checks (__post_init__), as the constructor does.
        return msgspec.structs.replace(PREFIX_DEFAULTS, **given)
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
              help="Redis URL (redis://, rediss://, unix:// or redis[s]+sentinel://host:port[,...]"
                   "/service-name[/db], password allowed) holding the ready set; "
                   "needs --service. Env: SLUICE_REDIS_URL.")
@click.option("--redis-ca-file", type=click.Path(dir_okay=False), envvar="SLUICE_REDIS_CA_FILE",
              help="CA certificate(s) that signed the rediss:// server's certificate "
                   "(default: the system's). Env: SLUICE_REDIS_CA_FILE.")
@click.option("--service", help="Service name whose ready set to follow (with --redis).")
@click.option("--redis-prefix", "--prefix", "redis_prefix", default=DEFAULTS.redis_prefix,
              show_default=True, help="Redis key prefix.")
@click.option("--controller-addr", help="Drop-in mode: URL of an unmodified Sky Serve "
              "controller to sync the ready set from.")
@click.option("--sync-interval", type=float, default=DEFAULTS.sync_interval, show_default=True,
              help="Sky Serve sync period in seconds (drop-in mode).")
@click.option("--sync-timeout", type=float, default=DEFAULTS.sync_timeout, show_default=True,
              help="Timeout of one Sky Serve sync request (drop-in mode).")
@click.option("--quick-resync/--no-quick-resync", default=DEFAULTS.quick_resync,
              show_default=True,
              help="Drop-in mode: when a sync empties a non-empty set, resync after 0.5 s "
                   "and 1 s while holding requests.")
@click.option("--host", default=DEFAULTS.host, show_default=True, help="Address to listen on.")
@click.option("--port", "--load-balancer-port", "port", type=int, default=DEFAULTS.port,
              show_default=True, help="Port to listen on (0: any free port).")
@click.option("--admin-host", default=DEFAULTS.admin_host, show_default=True,
              help="Admin listener address (/healthz /readyz /metrics /snapshot).")
@click.option("--admin-port", type=int, default=DEFAULTS.admin_port, show_default=True,
              help="Admin listener port; worker i uses admin port + i. -1 disables it.")
@click.option("--workers", type=click.IntRange(1, 64), default=DEFAULTS.workers,
              show_default=True, help="Processes sharing the port (SO_REUSEPORT).")
@click.option("--worker-index", type=int, default=None, hidden=True)
@click.option("--sync-relay", default=None, hidden=True)
@click.option("--policy", "--load-balancing-policy", "policy",
              type=click.Choice(sorted(POLICIES)), default=None,
              help="Load-balancing policy; default: the snapshot's (least_load).")
@click.option("--target-qps", multiple=True, metavar="ACCEL=QPS",
              help="Per-accelerator capacity for instance_aware_least_load (repeatable).")
@click.option("--prefix-epsilon", type=click.FloatRange(0, min_open=True), default=None,
              help="prefix policy: bounded load; a replica holding (1 + E) x the mean in "
                   "flight takes no more of a known prefix's requests (they spill to a "
                   "second replica); no bound when 1 + E >= the number of replicas "
                   "(--prefix-spill-margin still bounds it). "
                   f"[default: {PREFIX_DEFAULTS.epsilon:g}]")
@click.option("--prefix-spill-margin", type=click.IntRange(0, 1 << 20), default=None,
              metavar="N",
              help="prefix policy: a replica holding N requests more than the mean in "
                   "flight takes no more of a known prefix's requests either, on any "
                   "number of replicas, up to 2N as placed prompt families fill the "
                   "replicas' caches (0: no such bound). N is the fleet's: with K "
                   "proxies on Redis each applies N / sqrt(K) to its own requests, and "
                   "about N / 2K before a family's warm second replica (with "
                   "--fleet-load, 1 proxy's margin to the fleet's counts). "
                   f"[default: {PREFIX_DEFAULTS.spill_margin}]")
@click.option("--prefix-session-header", default=None, metavar="NAME",
              help="prefix policy: header whose value is the routing key ('' : none). "
                   f"[default: {PREFIX_DEFAULTS.session_header}]")
@click.option("--prefix-user-field/--no-prefix-user-field", default=None,
              help="prefix policy: route on the JSON body's \"user\" field when present. "
                   f"[default: {'on' if PREFIX_DEFAULTS.user_field else 'off'}]")
@click.option("--prefix-block-bytes", type=click.IntRange(16), default=None,
              help="prefix policy: block size of the prompt's hash chain. "
                   f"[default: {PREFIX_DEFAULTS.block_bytes}]")
@click.option("--prefix-bytes", type=click.IntRange(16, 1 << 20), default=None,
              help="prefix policy: request body bytes read before routing. "
                   f"[default: {PREFIX_DEFAULTS.prefix_bytes}]")
@click.option("--prefix-placement", type=click.Choice(["auto", "capacity", "rendezvous"]),
              default=None, help="prefix policy: place a new prompt family by load and "
                   "free cache capacity, by the hash alone, or (auto) by capacity once "
                   "shared through Redis. "
                   f"[default: {PREFIX_DEFAULTS.placement}]")
@click.option("--prefix-replica-families", type=click.IntRange(0, 1 << 16), default=None,
              help="prefix policy: families a replica's cache holds when its engine does "
                   "not report its slots (0: 4).")
@click.option("--prefix-warm-copies/--no-prefix-warm-copies", default=None,
              help="prefix policy: when a hot prompt family gets another replica, send "
                   "that replica a one-token warm-up of the family's prompt and keep the "
                   "family's requests where the prompt is cached until it answers, instead "
                   "of a client's request computing the prompt there cold (docs/routing.md). "
                   f"[default: {'on' if PREFIX_DEFAULTS.warm_copies else 'off'}]")
@click.option("--prefix-lru-size", type=click.IntRange(0), default=None,
              help="prefix policy: entries of the longest-prefix memory. "
                   f"[default: {PREFIX_DEFAULTS.lru_size}]")
@click.option("--engine-load/--no-engine-load", default=DEFAULTS.engine_load, show_default=True,
              help="least_load, p2c and prefix also count the requests waiting in each "
                   "replica's engine, as the controller scrapes them (Redis source only; "
                   "docs/engines.md).")
@click.option("--fleet-load", type=click.Choice(["auto", "on", "off"]), is_flag=False,
              flag_value="on", default=DEFAULTS.fleet_load, show_default=True,
              help="prefix policy: a known family's load bound also counts the requests "
                   "the other proxies have in flight, as they announce them on the "
                   "placement channel about every 100 ms, and a new family's placement "
                   "counts their cold prompts in flight, announced within 20 ms "
                   "(Redis source only). auto (the "
                   "default): on while the controller's engine view shows only batching "
                   "engines (vLLM, SGLang, TGI), off when it shows a llama.cpp server or "
                   "nothing. Measured in docs/routing.md: on a simulated vLLM fleet with 4 "
                   "proxies it ended the bursts that sent one replica twice its share "
                   "(overload: 0.065-0.081 s mean TTFT against 0.070-0.176 s off); on "
                   "llama.cpp servers with 2 slots it computed 6-10 % more prompt tokens. "
                   "A bare --fleet-load means on.")
@click.option("--no-fleet-load", "no_fleet_load", is_flag=True, hidden=True,
              help="Same as --fleet-load off (the flag of earlier releases).")
@click.option("--pool-size", type=click.IntRange(1), default=DEFAULTS.pool_size,
              show_default=True, help="Connection limit per replica.")
@click.option("--pool-grace", type=click.FloatRange(0), default=DEFAULTS.pool_grace,
              show_default=True,
              help="Seconds a departed replica's pool stays open (comes back warm).")
@click.option("--upstream-idle-timeout", type=click.FloatRange(0, min_open=True),
              default=DEFAULTS.upstream_idle_timeout, show_default=True,
              help="Reuse a pooled connection to a replica only if it has been idle less "
                   "than this many seconds. Keep it under the replicas' own keep-alive "
                   "timeout (uvicorn under vLLM and SGLang, and llama-server: 5 s), so "
                   "that no request is written as the replica closes the connection.")
@click.option("--retry-deadline", type=click.FloatRange(0, min_open=True),
              default=DEFAULTS.retry_deadline,
              show_default=True, help="Total budget per request until response headers: "
              "waiting for a replica, for a connection, and every attempt.")
@click.option("--max-attempts", type=click.IntRange(1), default=DEFAULTS.max_attempts,
              show_default=True,
              help="Attempts per request, each on a different replica where possible.")
@click.option("--connect-timeout", type=click.FloatRange(0, min_open=True),
              default=DEFAULTS.connect_timeout,
              show_default=True, help="Per-attempt connect timeout.")
@click.option("--empty-wait", type=click.FloatRange(0), default=DEFAULTS.empty_wait,
              show_default=True,
              help="Hold a request this long for a ready replica before 503.")
@click.option("--hold-heartbeat", type=click.FloatRange(0), default=DEFAULTS.hold_heartbeat,
              show_default=True,
              help="While a `\"stream\": true` request is held for a replica, answer 200 "
                   "text/event-stream at once and send an SSE comment every this many "
                   "seconds (keeps clients and cloud load balancers from timing out). "
                   "0: off.")
@click.option("--stream-idle-timeout", type=click.FloatRange(0, min_open=True),
              default=DEFAULTS.stream_idle_timeout,
              show_default=True, help="Max seconds between chunks: of a response (the stream is "
              "cut) and of a request body (408).")
@click.option("--resume-streams/--no-resume-streams", default=None,
              help="Resume a streamed /v1/chat/completions or /v1/completions cut by its "
                   "replica on another one (docs/resume.md). [default: as the service's "
                   "spec says (service.sluice.resume_streams), else off]")
@click.option("--resume-attempts", type=click.IntRange(1), default=DEFAULTS.resume_attempts,
              show_default=True, help="Continuations per stream before it is cut as without "
              "--resume-streams.")
@click.option("--header-timeout", type=click.FloatRange(0, min_open=True),
              default=DEFAULTS.header_timeout,
              show_default=True, help="Seconds a client has to send a whole request head "
              "(slowloris defence).")
@click.option("--max-body", type=click.IntRange(0), default=DEFAULTS.max_body,
              show_default=True, help="Largest request body in bytes (413 beyond).")
@click.option("--shutdown-grace", type=click.FloatRange(0), default=DEFAULTS.shutdown_grace,
              show_default=True, help="On SIGTERM, seconds to let in-flight requests finish.")
@click.option("--tls-certfile", type=click.Path(dir_okay=False), help="Serve HTTPS: cert.")
@click.option("--tls-keyfile", type=click.Path(dir_okay=False), help="Serve HTTPS: key.")
@click.option("--max-connections", type=click.IntRange(1), default=DEFAULTS.max_connections,
              show_default=True, help="Client connections per process; past it a new one is "
              "closed at once (logged once, counted). Lowered to fit the fd limit.")
@click.option("--max-pipeline", type=click.IntRange(0), default=DEFAULTS.max_pipeline,
              show_default=True, help="Pipelined requests parsed ahead per connection; past "
              "it the connection closes after answering those.")
@click.option("--max-held", type=click.IntRange(0), default=DEFAULTS.max_held,
              show_default=True, help="Requests held for a ready replica at once; past it "
              "503 with Retry-After at once.")
@click.option("--max-held-bytes", type=click.IntRange(0), default=DEFAULTS.max_held_bytes,
              show_default=True, help="Request body bytes the held requests may buffer in "
              "all; past it 503 with Retry-After at once.")
@click.option("--admin-token", envvar="SLUICE_ADMIN_TOKEN", default=None,
              help="Bearer token /metrics and /snapshot require (probes stay open). Give it "
                   "by env, not argv (argv is visible to every user). Env: SLUICE_ADMIN_TOKEN.")
@click.option("--admin-snapshot/--no-admin-snapshot", default=DEFAULTS.admin_snapshot,
              show_default=True, help="Serve /snapshot on the admin port (off: /metrics only).")
@click.option("--access-log", metavar="PATH", default=None,
              help="Write one line per request to PATH (\"-\": stderr), in nginx's "
              "combined format plus request time, replica and cut cause. Default: off.")
@click.option("--log-level", default=DEFAULTS.log_level, show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.version_option(package_name="sluice", prog_name="sluice-proxy")
def proxy_command(
    *, replicas: str | None, redis_url: str | None, redis_ca_file: str | None,
    service: str | None, redis_prefix: str, controller_addr: str | None,
    sync_interval: float, sync_timeout: float, quick_resync: bool, host: str, port: int,
    admin_host: str, admin_port: int, workers: int, worker_index: int | None,
    sync_relay: str | None, policy: str | None, target_qps: tuple[str, ...],
    prefix_epsilon: float | None, prefix_spill_margin: int | None,
    prefix_session_header: str | None, prefix_user_field: bool | None,
    prefix_block_bytes: int | None, prefix_bytes: int | None,
    prefix_lru_size: int | None, prefix_placement: str | None,
    prefix_replica_families: int | None, prefix_warm_copies: bool | None,
    engine_load: bool, fleet_load: str,
    no_fleet_load: bool,
    pool_size: int, pool_grace: float,
    upstream_idle_timeout: float, retry_deadline: float,
    max_attempts: int, connect_timeout: float, empty_wait: float, hold_heartbeat: float,
    stream_idle_timeout: float, resume_streams: bool | None, resume_attempts: int,
    header_timeout: float, max_body: int, shutdown_grace: float,
    tls_certfile: str | None, tls_keyfile: str | None, log_level: str,
    max_connections: int, max_pipeline: int, max_held: int, max_held_bytes: int,
    admin_token: str | None, admin_snapshot: bool,
    access_log: str | None,
) -> None:
    """sluice-proxy: a fast load-balancing proxy for replicated model servers.

    \b
    Examples:
      sluice-proxy --replicas http://127.0.0.1:8001,http://127.0.0.1:8002
      sluice-proxy --redis redis://127.0.0.1:6379 --service llm --port 8080
      sluice-proxy --controller-addr http://127.0.0.1:20001 --load-balancer-port 8080
    """
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    prefix_flags = {
        "prefix_epsilon": prefix_epsilon, "prefix_spill_margin": prefix_spill_margin,
        "prefix_session_header": prefix_session_header,
        "prefix_user_field": prefix_user_field, "prefix_block_bytes": prefix_block_bytes,
        "prefix_bytes": prefix_bytes, "prefix_lru_size": prefix_lru_size,
        "prefix_placement": prefix_placement, "prefix_replica_families": prefix_replica_families,
        "prefix_warm_copies": prefix_warm_copies,
    }
    config = ProxyConfig(
        host=host, port=port, admin_host=admin_host,
        admin_port=None if admin_port < 0 else admin_port,
        workers=workers, worker_index=0 if worker_index is None else worker_index,
        replicas=_split_urls(replicas), redis_url=redis_url, service=service,
        redis_prefix=redis_prefix, redis_ca_file=redis_ca_file, controller_addr=controller_addr,
        sync_interval=sync_interval, sync_timeout=sync_timeout, quick_resync=quick_resync,
        sync_relay=sync_relay, policy=policy, target_qps=_target_qps(target_qps),
        prefix_options=_prefix_options(prefix_flags), engine_load=engine_load,
        fleet_load="off" if no_fleet_load else fleet_load,
        pool_size=pool_size, pool_grace=pool_grace,
        upstream_idle_timeout=upstream_idle_timeout, retry_deadline=retry_deadline,
        max_attempts=max_attempts, connect_timeout=connect_timeout, empty_wait=empty_wait,
        hold_heartbeat=hold_heartbeat, stream_idle_timeout=stream_idle_timeout,
        resume_streams=resume_streams, resume_attempts=resume_attempts,
        header_timeout=header_timeout, max_body=max_body, shutdown_grace=shutdown_grace,
        tls_certfile=tls_certfile, tls_keyfile=tls_keyfile, log_level=log_level.upper(),
        max_connections=max_connections, max_pipeline=max_pipeline, max_held=max_held,
        max_held_bytes=max_held_bytes, admin_token=admin_token or None,
        admin_snapshot=admin_snapshot,
        access_log=access_log,
    )
    _run(config, supervise=workers > 1 and worker_index is None)


def _run(config: ProxyConfig, *, supervise: bool) -> None:
    """Supervise `config.workers` workers (this process is their parent), or be the proxy."""
    if supervise:
        if config.port == 0:
            raise click.UsageError("--workers > 1 needs a fixed --port")
        sys.exit(run_workers(config, click.get_current_context().meta[ARGS_KEY]))
    try:
        run_proxy(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    proxy_command(auto_envvar_prefix="SLUICE_PROXY")


if __name__ == "__main__":
    main()
