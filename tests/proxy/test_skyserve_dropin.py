"""Drop-in mode as Sky Serve really runs it (issue 14): fresh sync connections, `~` TLS
paths, two load balancers on one host, --workers 2 with one sync, Sky's instance-aware
weights, logs in load_balancer.log, path-prefixed replica URLs, Sky's stream timeout as
the retry deadline, and a bounded request-timestamp buffer. Against the stub controller
(tests/support/skyserve_stub.py), real replica processes and real sluice-proxy processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import trustme

from proxy.policies import InstanceAwareLeastLoad
from proxy.skyserve import dropin_config
from proxy.sources.skyserve_protocol import RequestLog, encode_sync_body
from tests.support.builders import Fake
from tests.support.harness import ManualSource, ScriptedUpstream, inprocess_proxy
from tests.support.poll import until, until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import Proxy, https_get
from tests.support.skyserve_stub import threaded_stub_code

# -- 1. syncs never reuse a connection the controller may have closed ----------------------


async def test_each_sync_opens_a_fresh_connection(stub, replica_factory, proxy_factory) -> None:
    # uvicorn (the controller's server) drops idle keep-alive connections after 5 s, our
    # sync interval: a reused connection fails the next sync ("Can not write request body").
    (r1,) = await replica_factory.astart(1)
    stub.script = [{r1.url: "unknown"}]
    await proxy_factory.astart("--controller-addr", stub.url, "--sync-interval", "0.2",
                               wait="ready")
    await stub.wait_syncs(4)
    ports = [port for _, port in stub.peers]
    assert len(set(ports)) == len(ports), f"a connection was reused: {ports}"


# -- 2. TLS key/cert paths with `~`, as Sky Serve passes them -----------------------------


def _lb_child(script: str, home: Path, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HOME": str(home)}
    with out.open("wb") as f:
        return subprocess.Popen([sys.executable, "-c", script], env=env,
                                stdout=f, stderr=subprocess.STDOUT)


def _wait_https(port: int, ctx: ssl.SSLContext, proc: subprocess.Popen[bytes],
                log: Path) -> int:
    def answer() -> int | None:
        with contextlib.suppress(OSError):
            return https_get(HOST, port, "/fast", ctx)[0]
        assert proc.poll() is None, log.read_text()
        return None

    return until_sync(answer, timeout=20, what="run_load_balancer to serve TLS", interval=0.1)


def test_run_load_balancer_tls_paths_with_tilde_and_logs_to_stdout(
        tmp_path, replica_factory) -> None:
    (r1,) = replica_factory(1)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    serve_dir = tmp_path / ".sky" / "serve" / "svc"
    serve_dir.mkdir(parents=True)
    cert.cert_chain_pems[0].write_to_path(serve_dir / "tls_certfile")
    cert.private_key_pem.write_to_path(serve_dir / "tls_keyfile")
    ctrl_port, lb_port = free_port(), free_port()
    log_file = tmp_path / "load_balancer.log"
    # As Sky's service process does: stdout redirected to load_balancer.log, then
    # run_load_balancer(addr, port, policy, tls_credential, target_qps, stream_timeout).
    script = threaded_stub_code(ctrl_port, r1.url) + textwrap.dedent(f"""
        import sys
        from types import SimpleNamespace
        sys.stdout = sys.stderr = open({str(log_file)!r}, 'w')
        from proxy.skyserve import run_load_balancer
        cred = SimpleNamespace(certfile='~/.sky/serve/svc/tls_certfile',
                               keyfile='~/.sky/serve/svc/tls_keyfile')
        run_load_balancer('http://127.0.0.1:{ctrl_port}', {lb_port}, 'least_load', cred,
                          6.0, 120)
    """)
    proc = _lb_child(script, tmp_path, tmp_path / "child.out")
    try:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        assert _wait_https(lb_port, ctx, proc, log_file) == 200
    finally:
        proc.terminate()
        proc.wait(10)
    text = log_file.read_text()
    assert "sluice-proxy listening" in text, text
    assert "ready set from the Sky Serve controller: 1 replicas" in text, text


# -- 3. two drop-in load balancers on one host -----------------------------------------------


async def test_second_load_balancer_starts_when_the_admin_port_is_taken(
        stub, replica_factory, proxy_factory) -> None:
    (r1,) = await replica_factory.astart(1)
    stub.script = [{r1.url: "unknown"}]
    first = await proxy_factory.astart("--controller-addr", stub.url, wait="ready")
    # The same command line (Sky Serve runs one per service): same admin port.
    second = Proxy(["--controller-addr", stub.url, "--admin-port", str(first.admin_port),
                    "--host", HOST, "--shutdown-grace", "2"],
                   free_port(), first.admin_port, 1, proxy_factory.log_dir, None)
    proxy_factory.started.append(second)

    async def serves() -> bool:
        assert second.alive, second.output()
        try:
            async with aiohttp.ClientSession() as s, s.get(second.url + "/fast") as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False

    await until(serves, timeout=20, what="the second load balancer serving")
    out = second.output()
    assert f"admin port {first.admin_port} is taken" in out, out
    assert first.alive


# -- 5. --workers 2: one sync per load balancer, every request once, in order ---------------


async def test_two_workers_sync_once_per_interval_with_all_counts_sorted(
        stub, replica_factory, proxy_factory) -> None:
    r1, r2 = await replica_factory.astart(2)
    stub.script = [{r1.url: "unknown", r2.url: "unknown"}]
    proxy = await proxy_factory.astart("--controller-addr", stub.url, "--sync-interval", "1.5",
                                       workers=2, wait="ready")
    sent = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for _ in range(8):  # new connections: SO_REUSEPORT spreads them over both workers
            for _ in range(15):
                async with s.get(proxy.url + "/fast") as resp:
                    assert resp.status == 200
                    await resp.read()
                sent += 1
            await asyncio.sleep(0.25)
        served = []
        for admin in proxy.admin_urls:
            async with s.get(admin + "/metrics") as resp:
                text = await resp.text()
            served.append(sum(float(line.split()[-1]) for line in text.splitlines()
                              if line.startswith("sluice_requests_total")))
    assert all(n > 0 for n in served), f"a worker got no traffic: {served}"
    await until(lambda: len(stub.timestamps) >= sent, timeout=15,
                what=f"{sent} timestamps at the controller")
    await stub.wait_syncs(1)
    assert len(stub.timestamps) == sent
    assert stub.timestamps == sorted(stub.timestamps)  # Sky trims its window with bisect
    gaps = [b - a for a, b in zip(stub.sync_times[1:], stub.sync_times[2:], strict=False)]
    assert min(gaps) > 1.0, f"more than one process syncs: gaps {gaps}"


# -- the request log: bounded, sorted, resends first ----------------------------------------


def test_request_log_batches_are_sorted_and_never_earlier_than_the_last() -> None:
    log = RequestLog(window=60)
    log.add(10.0, 2)
    log.add(10.1, 1)
    first = log.take(until=10.1)
    assert first == [(10.0, 2), (10.1, 1)]
    log.give_back(first)  # the sync failed
    log.extend([(10.05, 3), (10.3, 1)])  # a worker's late counts, and a later one
    log.add(10.2, 1)
    batch = log.take(until=10.25)
    assert batch == [(10.0, 2), (10.1, 1), (10.1, 3), (10.2, 1)]  # late ones at the mark
    assert log.take(until=11.0) == [(10.3, 1)]
    stamps = msgspec.json.decode(encode_sync_body(batch))["request_aggregator"]["timestamps"]
    assert stamps == sorted(stamps) and len(stamps) == 7


def test_request_log_keeps_only_the_autoscaler_window_and_counts_drops() -> None:
    # Issue 12 item 10: the controller unreachable for long must not grow the buffer forever.
    log = RequestLog(window=60)
    for i in range(1000):  # 1000 s of 5 requests per 100 ms, never sent
        batch = log.take(until=float(i))
        log.give_back(batch)
        log.add(float(i) + 0.5, 5)
        log.trim(float(i) + 0.5)
    assert log.buffered <= 61 * 5
    assert log.dropped + log.buffered == 5000


# -- 6. instance_aware_least_load weighs as Sky does ----------------------------------------


def test_instance_aware_strips_the_count_from_the_config_key_like_sky() -> None:
    # target_qps_per_replica {A100:1: 10, L4:1: 5}; Sky's controller reports gpu_type "A100".
    policy = InstanceAwareLeastLoad({"A100:1": 10.0, "L4:1": 5.0})
    assert policy.weight_of(Fake("a", accelerator="A100")) == 10.0
    assert policy.weight_of(Fake("l", accelerator="L4")) == 5.0
    assert policy.weight_of(Fake("t", accelerator="T4")) == 1.0


# -- path-prefixed replica URLs (Sky Serve's Kubernetes ingress) ----------------------------


async def test_path_prefixed_replica_url_keeps_its_path() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with ScriptedUpstream({"/skypilot/ns/c/8080/v1/models": ok}) as up:
        source = ManualSource()
        async with inprocess_proxy(source) as app:
            source.publish(up.url + "/skypilot/ns/c/8080")
            async with aiohttp.ClientSession() as s, \
                    s.get(f"http://{HOST}:{app.port}/v1/models?x=1") as resp:
                assert resp.status == 200 and await resp.read() == b"ok"
    assert up.requests[0].url == "/skypilot/ns/c/8080/v1/models?x=1"


# -- the retry deadline honours Sky's stream timeout -----------------------------------------


def test_dropin_deadline_waits_as_long_as_skys_stream_timeout() -> None:
    # Sky's LB waits stream_timeout_seconds (default 120) for an answer: a 90 s
    # non-streaming answer must not get our 504 at 60 s.
    config = dropin_config("http://127.0.0.1:1", 8080, None, None, None, 120)
    assert config.retry_deadline == 120.0
    assert config.stream_idle_timeout == 120.0
    assert dropin_config("http://127.0.0.1:1", 8080, None, None, None, 600).retry_deadline == 600
    assert dropin_config("http://127.0.0.1:1", 8080, None, None, None, 10).retry_deadline == 60


async def test_sync_body_is_encoded_off_the_event_loop(stub, monkeypatch) -> None:
    # Issue 12 item 10: a minute of timestamps at 5k req/s is 300k floats to encode.
    from proxy.config import ProxyConfig
    from proxy.readyset import ReadySet
    from proxy.sources import skyserve
    from proxy.stats import Stats

    threads: list[threading.Thread] = []
    real = skyserve.encode_sync_body

    def spy(batch: list[tuple[float, int]]) -> bytes:
        threads.append(threading.current_thread())
        return real(batch)

    monkeypatch.setattr(skyserve, "encode_sync_body", spy)
    stub.script = [{}]
    stats = Stats()
    source = skyserve.SkyServeSource(ProxyConfig(controller_addr=stub.url, port=0), stats)
    await source.start(ReadySet())
    stats.requests_total += 3
    assert await source.sync_once()
    await source.aclose()
    assert len(stub.timestamps) == 3
    assert threads and all(t is not threading.main_thread() for t in threads)


async def test_counts_older_than_the_window_are_dropped_and_counted(stub) -> None:
    from proxy.config import ProxyConfig
    from proxy.readyset import ReadySet
    from proxy.sources import skyserve
    from proxy.stats import Stats

    stub.script = [{}]
    stats = Stats()
    source = skyserve.SkyServeSource(ProxyConfig(controller_addr=stub.url, port=0), stats)
    await source.start(ReadySet())
    try:
        # What an unreachable controller leaves behind: counts from two minutes ago.
        source.requests.add(time.time() - 120, 5)
        source.requests.add(time.time() - 1, 2)
        assert await source.sync_once()
    finally:
        await source.aclose()
    assert len(stub.timestamps) == 2
    assert stats.timestamps_dropped == 5
