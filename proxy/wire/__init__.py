"""The contract between the control plane and every proxy, defined once.

Owns: the ReadySnapshot structs and codec (snapshot.py), the Redis key and channel
names (keys.py), the load-balancing policy names (policies.py), the structs proxies
write beside the request path and the control-channel nudges (telemetry.py), the
errors both sides share (errors.py), and the one way to follow a service's snapshots
(feed.py: subscribe, confirm, GET, follow, re-GET). docs/redis.md documents the same
contract for users.

It imports nothing else of sluice, only the standard library and msgspec (feed.py is
handed a redis-py client and imports redis-py's types for the type checker only).
Everything else imports it: the proxy, and the control plane, which imports from `proxy`
only this package, the Redis URL helpers (proxy/redisurl.py) and the proxy's command
(proxy/cli.py, for `sluice proxy`). The rules:
scripts/import_graph.py `MAY_IMPORT` (run by tests/test_layout.py).
"""
