"""The optional access log (proxy/accesslog.py), through a real sluice-proxy process."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp

from proxy.accesslog import request_line
from tests.support.harness import BASE_ARGS
from tests.support.poll import until
from tests.support.processes import ProxyFactory, ReplicaFactory

# nginx's combined format, then request time, replica and cut cause.
LINE = re.compile(
    r'^(?P<addr>\S+) - - \[(?P<time>\d\d/\w{3}/\d{4}:\d\d:\d\d:\d\d [+-]\d{4})\] '
    r'"(?P<request>[^"]*)" (?P<status>\d{3}) (?P<bytes>\d+) "-" "(?P<agent>[^"]*)" '
    r'(?P<seconds>\d+\.\d{3}) (?P<upstream>\S+) (?P<cut>\S+)$'
)


def test_the_request_line_drops_the_query_and_escapes() -> None:
    assert request_line(b"GET /v1/x?api_key=s3cret HTTP/1.1") == b"GET /v1/x HTTP/1.1"
    assert request_line(b'GET /a"b\\c\x01 HTTP/1.0') == b"GET /a\\x22b\\x5Cc\\x01 HTTP/1.0"


async def test_one_line_per_request_readable_as_nginx_combined(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory, tmp_path: Path,
) -> None:
    (replica,) = await replica_factory.astart(1)
    path = tmp_path / "access.log"
    proxy = await proxy_factory.astart(*BASE_ARGS, "--access-log", str(path),
                                       replicas=[replica])  # fmt: skip
    async with aiohttp.ClientSession(headers={"User-Agent": 'bench "1"'}) as session:
        async with session.get(f"{proxy.url}/fast?api_key=s3cret") as resp:
            assert resp.status == 200
            body = await resp.read()
        async with session.get(f"{proxy.url}/status/404") as resp:
            assert resp.status == 404
        async with session.get(f"{proxy.url}/stream_then_die") as resp:
            try:
                await resp.read()
            except aiohttp.ClientPayloadError:
                pass

    def lines() -> list[str]:
        return path.read_text().splitlines() if path.exists() else []

    await until(lambda: len(lines()) == 3, what="three access-log lines")
    parsed = [LINE.match(line) for line in lines()]
    assert all(parsed), lines()
    fast, missing, cut = (m.groupdict() for m in parsed if m is not None)
    assert fast["request"] == "GET /fast HTTP/1.1" and "s3cret" not in path.read_text()
    assert (fast["status"], int(fast["bytes"]), fast["cut"]) == ("200", len(body), "-")
    assert fast["agent"] == "bench \\x221\\x22" and fast["upstream"] == replica.url
    assert fast["addr"] == "127.0.0.1"
    assert (missing["status"], missing["cut"]) == ("404", "-")
    assert cut["status"] == "200" and cut["cut"] in ("upstream_eof", "upstream_reset")


async def test_off_by_default(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    (replica,) = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[replica])
    async with aiohttp.ClientSession() as session, session.get(f"{proxy.url}/fast") as resp:
        assert resp.status == 200
    assert '"GET /fast' not in proxy.stderr_text()
