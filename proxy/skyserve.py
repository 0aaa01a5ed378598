"""Sky Serve's load-balancer entry point, served by sluice-proxy (drop-in mode).

`run_load_balancer(...)` has the signature the Sky Serve service process calls;
`sluice_skyserve` (a separate small distribution, contrib/skyserve-shim) points
Sky Serve at it without editing SkyPilot's files, and docs/skyserve.md patches it
in with `from proxy import skyserve as load_balancer`: this import path is a
public interface and stays.

The source that syncs with Sky Serve's controller lives in proxy/sources/skyserve.py,
its sync protocol in proxy/sources/skyserve_protocol.py.
"""

from __future__ import annotations

import logging
import sys
from typing import Protocol

from proxy.config import ProxyConfig
from proxy.runner import run_proxy


class TlsCredential(Protocol):
    keyfile: str
    certfile: str


def dropin_config(
    controller_addr: str,
    load_balancer_port: int,
    load_balancing_policy_name: str | None = None,
    tls_credential: TlsCredential | None = None,
    target_qps_per_replica: float | dict[str, float] | None = None,
    stream_timeout_seconds: int | None = 120,
) -> ProxyConfig:
    """The proxy config for `run_load_balancer`'s arguments (Sky Serve's meaning of each)."""
    target_qps: dict[str, float] = {}
    if isinstance(target_qps_per_replica, dict):
        target_qps = {str(k): float(v) for k, v in target_qps_per_replica.items()}
    stream_timeout = float(stream_timeout_seconds or 120)
    defaults = ProxyConfig()
    return ProxyConfig(
        port=load_balancer_port,
        controller_addr=controller_addr,
        policy=load_balancing_policy_name,
        target_qps=target_qps,
        stream_idle_timeout=stream_timeout,
        # Sky waits up to stream_timeout_seconds for a replica's answer (httpx read
        # timeout): a slow non-streaming answer must not get our 504 sooner.
        retry_deadline=max(defaults.retry_deadline, stream_timeout),
        tls_certfile=tls_credential.certfile if tls_credential else None,
        tls_keyfile=tls_credential.keyfile if tls_credential else None,
        # No admin listener: Sky Serve starts one load balancer per service on the
        # controller host, and none of them owns a well-known port there.
        admin_port=None,
    )


def _log_to_stdout() -> None:
    """Send sluice's records to sys.stdout as Sky's own load balancer does.

    Sky Serve's service process runs the load balancer with sys.stdout redirected
    to ~/.sky/serve/<service>/load_balancer.log (`sky serve logs --load-balancer`).
    """
    logger = logging.getLogger("sluice")
    if any(getattr(h, "_sluice_skyserve", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler._sluice_skyserve = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(
        "%(levelname).1s %(asctime)s %(name)s[%(process)d]: %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def run_load_balancer(
    controller_addr: str,
    load_balancer_port: int,
    load_balancing_policy_name: str | None = None,
    tls_credential: TlsCredential | None = None,
    target_qps_per_replica: float | dict[str, float] | None = None,
    stream_timeout_seconds: int | None = 120,
) -> None:
    """Sky Serve's load-balancer entry point, served by sluice-proxy (blocks until SIGTERM)."""
    _log_to_stdout()
    config = dropin_config(controller_addr, load_balancer_port, load_balancing_policy_name,
                           tls_credential, target_qps_per_replica, stream_timeout_seconds)
    run_proxy(config)
