"""The proxy's one frozen config object, built by the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.wire.keys import DEFAULT_PREFIX
from proxy.wire.snapshot import PrefixOptions


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int | None = 9090  # None: no admin listener
    workers: int = 1
    worker_index: int = 0
    # Source of the ready set: exactly one of these.
    replicas: tuple[str, ...] = ()
    redis_url: str | None = None
    service: str | None = None
    redis_prefix: str = DEFAULT_PREFIX
    redis_ca_file: str | None = None  # CA bundle that signed a rediss:// server's certificate
    controller_addr: str | None = None
    sync_interval: float = 5.0
    sync_timeout: float = 5.0
    quick_resync: bool = True  # resync at once when a sync empties a non-empty set
    sync_relay: str | None = None  # --workers N: unix socket where worker 0 relays the sync
    # Routing.
    policy: str | None = None  # None: the snapshot's policy (least_load by default)
    target_qps: dict[str, float] = field(default_factory=dict)
    prefix_options: PrefixOptions | None = None  # None: the snapshot's (or the defaults)
    engine_load: bool = False  # least_load/p2c/prefix also count the engines' queues (Redis source)
    # prefix: a known family's load bound also counts the other proxies' in-flight
    # requests, as they announce them (Redis source): "on", "off", or "auto" (the
    # default: on while the engine view shows batching engines only, proxy/sources/redis.py,
    # fleet_wanted; bench/README.md, "`--fleet-load auto` by default").
    fleet_load: str = "auto"
    # Pools and deadlines.
    pool_size: int = 256
    pool_grace: float = 30.0
    # Reuse an idle pooled connection only while idle less than this: under the 5 s after
    # which uvicorn (vLLM, SGLang) and llama-server close idle keep-alive connections.
    upstream_idle_timeout: float = 4.0
    retry_deadline: float = 60.0
    max_attempts: int = 3
    connect_timeout: float = 5.0
    empty_wait: float = 10.0
    hold_heartbeat: float = 0.0  # > 0: SSE comments every N s to held stream:true requests
    stream_idle_timeout: float = 120.0
    # Resuming cut streams (proxy/resume.py): None follows the service (snapshot), a bool
    # overrides it; at most `resume_attempts` continuations per stream.
    resume_streams: bool | None = None
    resume_attempts: int = 2
    max_body: int = 100 * 1024 * 1024
    retry_body_limit: int = 1024 * 1024  # bodies up to this are kept for retries
    header_timeout: float = 30.0  # whole request head must arrive within this
    keepalive_timeout: float = 75.0  # idle client connection
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    shutdown_grace: float = 30.0
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    proxy_id: str | None = None
    log_level: str = "INFO"
    # Bounds on what clients can make the proxy hold (docs/security.md, "Bounds").
    max_connections: int = 16384  # client connections per process (capped by the fd limit)
    max_pipeline: int = 16  # parsed requests queued behind the one being answered
    max_held: int = 1024  # requests held for a ready replica, per process
    max_held_bytes: int = 64 * 1024 * 1024  # their request body bytes, in all
    # The admin listener: a bearer token for /metrics and /snapshot; /snapshot can be off.
    admin_token: str | None = field(default=None, repr=False)
    admin_snapshot: bool = True
    access_log: str | None = None  # a path, "-" for stderr; None: off (proxy/accesslog.py)
