"""End-to-end routing through a real sluice-proxy process: what goes in comes out unchanged,
except for exactly the headers a proxy must own (hop-by-hop, X-Forwarded-*, Host)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import rawhttp
from tests.support.harness import BASE_ARGS, ScriptedUpstream
from tests.support.processes import Proxy, ProxyFactory, Replica, ReplicaFactory
from tests.support.rawhttp import get

REQUEST_HOP = {"keep-alive", "te", "trailer", "proxy-authorization", "proxy-connection",
               "x-secret-hop", "upgrade"}


@dataclass
class Fleet:
    proxy: Proxy
    replicas: list[Replica]

    def replica(self, replica_id: str | None) -> Replica:
        [r] = [r for r in self.replicas if r.id == replica_id]
        return r


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two replicas behind one proxy, shared by the tests here that only read."""
    replicas = ReplicaFactory(tmp_path_factory.mktemp("replicas"))
    proxies = ProxyFactory(tmp_path_factory.mktemp("proxy"))
    try:
        reps = replicas(2, ids=["r1", "r2"])
        yield Fleet(proxies(*BASE_ARGS, replicas=reps), reps)
    finally:
        proxies.close()
        replicas.close()


def echoed(resp: rawhttp.Response) -> dict[str, Any]:
    assert resp.status == 200, (resp.status, resp.body[:200])
    result: dict[str, Any] = json.loads(resp.body)
    return result


def header_values(echo: dict[str, Any], name: str) -> list[str]:
    return [v for k, v in echo["headers"] if k.lower() == name.lower()]


async def test_methods_paths_and_query_strings_pass_through(fleet: Fleet) -> None:
    path = "/echo/a%20b/%E2%9C%93;p=1/../x?x=1&x=2&empty=&flag&enc=%2F%3F%26"
    async with rawhttp.connect(fleet.proxy.port) as conn:
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            body = f"payload of {method}".encode() if method not in ("GET", "OPTIONS") else b""
            echo = echoed(await conn.request(get(path, method=method, body=body)))
            assert echo["method"] == method
            assert echo["raw_path"] == path
            assert echo["version"] == "1.1"
            assert echo["body_sha256"] == hashlib.sha256(body).hexdigest()


async def test_repeated_headers_keep_their_values_and_order(fleet: Fleet) -> None:
    sent = [("X-Multi", "one"), ("X-Other", "a"), ("X-Multi", "two, three"),
            ("Cookie", "a=1"), ("Cookie", "b=2"), ("Accept-Encoding", "gzip, br"),
            ("X-Multi", "four")]
    resp = await rawhttp.fetch(fleet.proxy.port, get("/echo", *(f"{k}: {v}" for k, v in sent)))
    echo = echoed(resp)
    names = {k.lower() for k, _ in sent}
    assert [(k, v) for k, v in echo["headers"] if k.lower() in names] == sent


async def test_binary_bodies_pass_unchanged_both_ways(fleet: Fleet) -> None:
    body = bytes(range(256)) * 512 + b"\r\n\r\n0\r\n\r\n" + os.urandom(200_000)
    resp = await rawhttp.fetch(fleet.proxy.port, get(
        "/echo/raw", "Content-Type: application/octet-stream", method="POST", body=body))
    assert resp.status == 200
    assert resp.body == body
    # A chunked request body arrives de-chunked at the replica, byte for byte.
    pieces = [os.urandom(n) for n in (1, 4096, 70_000, 3)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    resp = await rawhttp.fetch(fleet.proxy.port, get(
        "/echo", "Transfer-Encoding: chunked", method="PUT") + chunked)
    echo = echoed(resp)
    assert echo["body_length"] == sum(map(len, pieces))
    assert echo["body_sha256"] == hashlib.sha256(b"".join(pieces)).hexdigest()


async def test_client_keepalive_serves_many_requests_on_one_connection(fleet: Fleet) -> None:
    async with rawhttp.connect(fleet.proxy.port) as conn:
        for _ in range(5):
            resp = await conn.request(get("/fast"))
            assert resp.status == 200
            assert len(resp.body) == 100
            assert resp.header("Connection") != "close"
        resp = await conn.request(get("/fast", "Connection: close"))  # the client's last one
        assert resp.status == 200
        assert resp.header("Connection") == "close"
        assert await conn.closed_by_peer(within=5)


async def test_pipelined_requests_are_answered_in_order(fleet: Fleet) -> None:
    async with rawhttp.connect(fleet.proxy.port) as conn:
        # One send: the slow one first, so answering in completion order would be visible.
        conn.send(get("/slow?delay=0.3") + get("/fast") + get("/echo/third", method="POST",
                                                              body=b"3rd"))
        first = await conn.response()
        second = await conn.response()
        third = await conn.response()
    assert (first.status, first.body) == (200, b"slow\n")
    assert (second.status, len(second.body)) == (200, 100)
    echo = echoed(third)
    assert (echo["path"], echo["body_length"]) == ("/echo/third", 3)


async def test_hop_by_hop_request_headers_are_stripped(fleet: Fleet) -> None:
    resp = await rawhttp.fetch(fleet.proxy.port, get(
        "/echo",
        "Connection: keep-alive, X-Secret-Hop",
        "X-Secret-Hop: must not reach the replica",
        "Keep-Alive: timeout=5",
        "TE: trailers",
        "Trailer: X-Checksum",
        "Proxy-Authorization: Basic Zm9vOmJhcg==",
        "Proxy-Connection: keep-alive",
        "X-End-To-End: kept",
    ))
    echo = echoed(resp)
    names = {k.lower() for k, _ in echo["headers"]}
    assert names & REQUEST_HOP == set()
    assert all("secret" not in v.lower() for v in header_values(echo, "Connection"))
    assert header_values(echo, "X-End-To-End") == ["kept"]


async def test_every_connection_header_names_hop_headers_but_never_framing(
    fleet: Fleet,
) -> None:
    """Two `Connection:` lines: the names of both are removed; one naming Content-Length
    does not unframe the body."""
    resp = await rawhttp.fetch(fleet.proxy.port, get(
        "/echo",
        "Connection: X-Hop-A",
        "X-Hop-A: a",
        "Connection: x-hop-b , content-length",
        "X-Hop-B: b",
        "X-End-To-End: kept",
        method="POST", body=b"abc",
    ))
    echo = echoed(resp)
    names = {k.lower() for k, _ in echo["headers"]}
    assert names & {"x-hop-a", "x-hop-b", "connection"} == set()
    assert header_values(echo, "X-End-To-End") == ["kept"]
    assert echo["body_length"] == 3


async def test_forwarded_headers_added_and_host_is_the_replicas(fleet: Fleet) -> None:
    resp = await rawhttp.fetch(fleet.proxy.port, get(
        "/echo", "X-Forwarded-For: 203.0.113.7", "X-Forwarded-Proto: https",
        "X-Forwarded-Host: spoofed.example", host="api.example.com:8443"))
    echo = echoed(resp)
    replica = fleet.replica(resp.header("X-Replica-Id"))
    assert header_values(echo, "Host") == [f"127.0.0.1:{replica.port}"]
    assert header_values(echo, "X-Forwarded-For") == ["203.0.113.7, 127.0.0.1"]
    assert header_values(echo, "X-Forwarded-Proto") == ["http"]
    assert header_values(echo, "X-Forwarded-Host") == ["api.example.com:8443"]
    echo = echoed(await rawhttp.fetch(fleet.proxy.port, get("/echo")))
    assert header_values(echo, "X-Forwarded-For") == ["127.0.0.1"]


async def test_head_responses_end_at_the_headers(fleet: Fleet) -> None:
    async with rawhttp.connect(fleet.proxy.port) as conn:
        head = await conn.request(get("/fast", method="HEAD"), head=True)
        assert head.status == 200
        assert head.header("Content-Length") == "100"
        # Had the proxy waited for (or sent) a body, this would hang or misparse.
        after = await conn.request(get("/fast"))
        assert (after.status, len(after.body)) == (200, 100)
        head = await conn.request(get("/chunked", method="HEAD"), head=True)
        assert head.status == 200
        after = await conn.request(get("/echo/after-head"))
        assert echoed(after)["path"] == "/echo/after-head"


async def test_chunked_response_is_relayed_chunked(fleet: Fleet) -> None:
    async with rawhttp.connect(fleet.proxy.port) as conn:
        resp = await conn.request(get("/chunked?n=5"))
        assert resp.status == 200
        assert resp.framing == "chunked"
        assert resp.body == b"".join(f"chunk {i}\n".encode() for i in range(5))
        after = await conn.request(get("/fast"))
        assert (after.status, len(after.body)) == (200, 100)


async def test_close_delimited_response_is_relayed_whole(fleet: Fleet) -> None:
    async with rawhttp.connect(fleet.proxy.port) as conn:
        resp = await conn.request(get("/nolength?n=5000"))
        assert resp.status == 200
        assert resp.body == b"n" * 5000
        assert resp.framing in ("chunked", "close")
        if resp.framing == "chunked":  # re-chunked: the client connection stays usable
            after = await conn.request(get("/fast"))
            assert (after.status, len(after.body)) == (200, 100)
    # An HTTP/1.0 client cannot take chunked: the body is delimited by closing.
    resp = await rawhttp.fetch(fleet.proxy.port, b"GET /nolength?n=3000 HTTP/1.0\r\n\r\n")
    assert resp.status == 200
    assert resp.header("Transfer-Encoding") is None
    assert resp.body == b"n" * 3000


async def test_status_codes_pass_through_and_5xx_is_not_retried(fleet: Fleet) -> None:
    async with rawhttp.connect(fleet.proxy.port) as conn:
        for code in (201, 204, 404, 503):
            resp = await conn.request(get(f"/status/{code}"))
            assert resp.status == code
            assert resp.body == (b"" if code == 204 else f"status {code}\n".encode())
    seen = sum(r.stats()["by_path"].get("/status/503", 0) for r in fleet.replicas)
    assert seen == 1


async def test_expect_100_continue(fleet: Fleet) -> None:
    async with rawhttp.connect(fleet.proxy.port) as conn:
        conn.send(get("/echo", "Expect: 100-continue", "Content-Length: 5",
                      method="POST"))
        interim = await conn.response(skip_1xx=False)
        assert interim.status == 100
        conn.send(b"hello")
        echo = echoed(await conn.response())
    assert echo["body_sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert header_values(echo, "Expect") == []


# -- against a scripted upstream: exact bytes and connection counts -------------------


async def test_upstream_connections_are_pooled_and_reused(
    proxy_factory: ProxyFactory,
) -> None:
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with ScriptedUpstream({"/ok": reply}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        for _ in range(20):  # a new client connection each time
            resp = await rawhttp.fetch(proxy.port, get("/ok"))
            assert (resp.status, resp.body) == (200, b"ok")
        assert len(upstream.requests) == 20
        assert upstream.connections == 1


async def test_hop_by_hop_response_headers_are_stripped(proxy_factory: ProxyFactory) -> None:
    """Including every header each of two `Connection:` lines names, but never the
    framing (a Connection naming Content-Length does not unframe the body)."""
    reply = (b"HTTP/1.1 200 OK\r\n"
             b"Content-Length: 2\r\n"
             b"Connection: X-Upstream-Hop\r\n"
             b"X-Upstream-Hop: secret\r\n"
             b"Connection: x-hop-b, Content-Length\r\n"
             b"X-Hop-B: b\r\n"
             b"Keep-Alive: timeout=5, max=100\r\n"
             b"Proxy-Authenticate: Basic realm=\"r\"\r\n"
             b"Trailer: X-Checksum\r\n"
             b"Upgrade: h2c\r\n"
             b"X-End-To-End: kept\r\n"
             b"\r\nok")
    async with ScriptedUpstream({"/hop": reply}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            resp = await conn.request(get("/hop"))
            assert (resp.status, resp.body) == (200, b"ok")
            assert resp.names & {"x-upstream-hop", "x-hop-b", "keep-alive",
                                 "proxy-authenticate", "trailer", "upgrade"} == set()
            assert resp.header("Content-Length") == "2"
            assert all("hop" not in v.lower() for v in resp.all("Connection"))
            assert resp.all("X-End-To-End") == ["kept"]
            again = await conn.request(get("/hop"))  # the client connection survived
            assert again.status == 200


async def test_content_encoding_passes_through_untouched(proxy_factory: ProxyFactory) -> None:
    payload = b"the quick brown fox " * 500
    gz = gzip.compress(payload, mtime=0)
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: gzip\r\n"
             b"Vary: Accept-Encoding\r\nContent-Length: %d\r\n\r\n%s" % (len(gz), gz))
    ack = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nack"
    async with ScriptedUpstream({"/gz": reply, "/up": ack}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            resp = await conn.request(get("/gz", "Accept-Encoding: gzip"))
            assert resp.status == 200
            assert resp.header("Content-Encoding") == "gzip"
            assert resp.header("Content-Length") == str(len(gz))
            assert resp.body == gz
            resp = await conn.request(get("/up", "Content-Encoding: gzip", method="POST",
                                          body=gz))
            assert (resp.status, resp.body) == (200, b"ack")
        fetched, posted = upstream.requests
        assert fetched.all("Accept-Encoding") == ["gzip"]
        assert posted.all("Content-Encoding") == ["gzip"]
        assert posted.body == gz


async def test_interim_1xx_responses_do_not_end_the_exchange(proxy_factory: ProxyFactory) -> None:
    reply = (b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
             b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Final: yes\r\n\r\nfinal")
    async with ScriptedUpstream({"/hints": reply}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            for _ in range(2):  # and the connections on both sides stay in step
                resp = await conn.request(get("/hints"))
                assert (resp.status, resp.header("X-Final"), resp.body) == (200, "yes", b"final")
