"""The Redis key and channel names: the one definition both the proxy and the
control plane use (docs/redis.md documents them for users).

Prefix configurable, default `sluice`; `Keys` names each one:

    {p}:services                  set      service names
    {p}:svc:{name}                hash     ServiceRecord, one field per attribute
                                           (strings raw, everything else JSON)
    {p}:svc:{name}:spec:{v}       string   the service spec of version v (JSON)
    {p}:svc:{name}:replicas       hash     replica id -> ReplicaRecord (JSON)
    {p}:svc:{name}:snapshot       string   latest ReadySnapshot (JSON)
    {p}:svc:{name}:gen            string   generation counter (INCR); survives unregister
    {p}:svc:{name}:ready          channel  every new ReadySnapshot
    {p}:svc:{name}:rps            hash     unix second -> request count (proxies HINCRBY)
    {p}:svc:{name}:inflight       hash     proxy id -> InflightEntry JSON (proxies write)
    {p}:svc:{name}:proxies        hash     proxy id -> ProxyHeartbeat JSON (proxies write,
                                           every second; stale ones pruned by readers)
    {p}:svc:{name}:autoscaler     string   last AutoscalerStatus (JSON; controller writes)
    {p}:svc:{name}:engines        string   EngineView JSON: each READY replica's engine
                                           telemetry (controller writes, TTL; proxies read)
    {p}:svc:{name}:placement      hash     prompt family (hex) -> "at url": where the
                                           `prefix` policy placed it (proxies HSETNX, TTL);
                                           "s" + family (hex) -> "at url": its spill
    {p}:svc:{name}:placed         channel  placements just made (proxies publish)
    {p}:svc:{name}:events         stream   audit trail
    {p}:control                   channel  nudges to the controller (Nudge JSON or a name)
    {p}:leader                    string   controller leader lease (with TTL)
    {p}:op:{id}                   string   marks transaction {id} as applied (TTL 60 s)
"""

from __future__ import annotations

from dataclasses import dataclass

#: The key prefix when none is configured (`--prefix`, env SLUICE_PREFIX).
DEFAULT_PREFIX = "sluice"


@dataclass(frozen=True, slots=True)
class Keys:
    """Names every Redis key and channel under one prefix (docs/redis.md lists them).

    The proxy reads `snapshot` and `engines`, subscribes to `ready` and writes `rps`, `inflight`,
    `proxies` and demand nudges on `control`; everything else is the controller's.
    """

    prefix: str = DEFAULT_PREFIX

    @property
    def services(self) -> str:
        """Set of service names."""
        return f"{self.prefix}:services"

    @property
    def control(self) -> str:
        """Pub/sub channel of nudges to the controller."""
        return f"{self.prefix}:control"

    @property
    def leader(self) -> str:
        """The controller leader lease."""
        return f"{self.prefix}:leader"

    def op(self, op_id: str) -> str:
        """Marks the transaction `op_id` as applied (short TTL)."""
        return f"{self.prefix}:op:{op_id}"

    def service(self, name: str) -> str:
        """Hash holding the ServiceRecord."""
        return f"{self.prefix}:svc:{name}"

    def spec(self, name: str, version: int) -> str:
        """String holding the spec JSON of one version."""
        return f"{self.prefix}:svc:{name}:spec:{version}"

    def replicas(self, name: str) -> str:
        """Hash replica id -> ReplicaRecord JSON."""
        return f"{self.prefix}:svc:{name}:replicas"

    def snapshot(self, name: str) -> str:
        """String holding the latest ReadySnapshot JSON."""
        return f"{self.prefix}:svc:{name}:snapshot"

    def gen(self, name: str) -> str:
        """The generation counter."""
        return f"{self.prefix}:svc:{name}:gen"

    def ready(self, name: str) -> str:
        """Pub/sub channel carrying every new ReadySnapshot."""
        return f"{self.prefix}:svc:{name}:ready"

    def rps(self, name: str) -> str:
        """Hash unix second -> request count."""
        return f"{self.prefix}:svc:{name}:rps"

    def inflight(self, name: str) -> str:
        """Hash proxy id -> in-flight counts."""
        return f"{self.prefix}:svc:{name}:inflight"

    def proxies(self, name: str) -> str:
        """Hash proxy id -> ProxyHeartbeat JSON (each proxy process writes its own)."""
        return f"{self.prefix}:svc:{name}:proxies"

    def autoscaler(self, name: str) -> str:
        """String holding the controller's last AutoscalerStatus JSON."""
        return f"{self.prefix}:svc:{name}:autoscaler"

    def engines(self, name: str) -> str:
        """String holding the EngineView JSON the controller scraped (with a TTL)."""
        return f"{self.prefix}:svc:{name}:engines"

    def placement(self, name: str) -> str:
        """Hash family -> "at url" the `prefix` policy shares (proxy/sources/placement.py)."""
        return f"{self.prefix}:svc:{name}:placement"

    def placed(self, name: str) -> str:
        """Channel announcing the placements a proxy just won (same lines as the hash)."""
        return f"{self.prefix}:svc:{name}:placed"

    def events(self, name: str) -> str:
        """Stream of audit events."""
        return f"{self.prefix}:svc:{name}:events"
