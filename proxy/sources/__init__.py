"""Sources of the ready set: where a proxy learns which replicas to route to.

Owns the Source protocol and the choice of one source per run (`make_source`):

    static.py     StaticSource   a fixed list of URLs (`--replicas URL,...`)
    redis.py      RedisSource    the controller's snapshots in Redis (`--redis URL --service
                                 NAME`), plus the telemetry a proxy writes back
    skyserve.py   SkyServeSource an unmodified Sky Serve controller's sync protocol
                  RelayFollower  (`--controller-addr`), and its relay between workers

Each feeds `ReadySet.apply()`; the proxy does not care which. A source is started
once and closed once by the proxy app:

    source = StaticSource(urls)
    await source.start(ready_set)
    ...
    await source.aclose()

What it may import (never the app, the runner or the CLI):
scripts/import_graph.py `MAY_IMPORT` (run by tests/test_layout.py).
"""

from __future__ import annotations

from typing import Protocol

from proxy.config import ProxyConfig
from proxy.errors import ConfigError
from proxy.readyset import ReadySet
from proxy.sources.static import StaticSource
from proxy.stats import Stats
from proxy.wire.policies import DEFAULT_POLICY


class Source(Protocol):
    async def start(self, ready_set: ReadySet) -> None: ...

    async def aclose(self) -> None: ...


def describe(config: ProxyConfig) -> str:
    """The ready-set source for the log, without secrets (a URL's user-info and query)."""
    if config.replicas:
        return f"--replicas ({len(config.replicas)} static)"
    if config.redis_url:
        scheme, sep, rest = config.redis_url.partition("://")
        where = rest.rpartition("@")[2].split("?", 1)[0]
        return f"{scheme}{sep}{where} (service {config.service})"
    return f"the Sky Serve controller at {config.controller_addr}"


def make_source(config: ProxyConfig, stats: Stats) -> Source:
    """The one source of the ready set the config names."""
    chosen = [bool(config.replicas), bool(config.redis_url), bool(config.controller_addr)]
    if sum(chosen) != 1:
        raise ConfigError(
            "give exactly one source of replicas: --replicas URL,..., "
            "--redis URL --service NAME, or --controller-addr URL"
        )
    if config.replicas:
        return StaticSource(config.replicas, policy=config.policy or DEFAULT_POLICY)
    if config.redis_url:
        if not config.service:
            raise ConfigError("--redis needs --service NAME")
        # Imported here: redis-py is loaded only by a proxy that follows Redis.
        from proxy.sources.redis import RedisSource

        return RedisSource(config, stats)
    from proxy.sources.skyserve import make_skyserve_source

    return make_skyserve_source(config, stats)
