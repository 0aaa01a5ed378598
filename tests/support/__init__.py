"""What the tests share: helpers, builders, fakes and the programs tests run.

Waiting and addresses (every test uses these, and no other):
- `poll`: `until()` / `until_sync()`, the one bounded poller (no sleeps as
  synchronisation); `retrying()` for calls that fail for a while (a Redis failover);
  `must_finish()` for teardown steps that must end.
- `ports`: `free_port()`, the one free 127.0.0.1 port helper.

Fixtures (registered as pytest plugins by tests/conftest.py):
- `redis_fixtures`: a real redis-server, clients, a Store, Redis and Sentinel factories.
- `processes`: replica and proxy processes (`replica_factory`, `proxy_factory`) and
  blocking HTTP(S) GETs.
- `llama`: real llama.cpp engines (`llama_factory`): a random-weight model written once
  into a cache directory, llama-server processes, their slots, metrics and timings.

Builders and drivers:
- `builders`: ReplicaRecord / ServiceRecord / ReadySnapshot / ServiceSpec builders,
  `pid_of`, `ready_view`.
- `cli`: running the `sluice` CLI in-process or as a child process
  (`spawn_sluice`, `sluice_child`), and reading the keys it left.
- `pids`: /proc helpers (`descendants`, `running`, `kill_all`) that stop what a test
  started, by pid.
- `controllers`: Controllers run in the test's loop and closed at teardown; a proxy
  process following a service through Redis.
- `harness`: an in-process proxy with a test-driven ready set, a scripted upstream,
  metrics scraping.
- `rawhttp`: byte-exact HTTP/1.1 client connections.
- `tls`: a CA and a certificate it signed, as PEM files (`write_cert`, `redis_tls`).
- `traffic`: open-loop HTTP load with every request timed.
- `faultproxy`: a TCP proxy in front of Redis that drops chosen commands.
- `sentinel`: `SentinelGroup`, a private Redis Sentinel deployment (primary, replicas,
  sentinels) with kill/failover; also used by bench/ and loadtests/.
- `browser`: a headless Chromium driven over the DevTools protocol (pages, JS,
  console errors, screenshots); skips when no chromium is installed.

Named fakes, for what cannot run here:
- `skyserve_stub`: a stub Sky Serve controller (the load-balancer sync protocol; the
  `stub` fixture).
- `skypilot_fake`: a fake SkyPilot SDK whose "clusters" are local processes.
- `fakes`: `FakeBackend` and `FakeProber` for controllers driven by `step()` on a fake
  clock; also `controller_config()`, `controller_starter()` and the `start_controller`
  fixture (on the module's `config`), the config and starter the end-to-end controller
  tests share.

Programs tests start as processes (``python -m tests.support.<name>``):
- `replica_app`: the replica every test runs; `slow_health_replica`: one whose /health
  is slow.

This package imports the product's public modules; the product never imports it.
"""
