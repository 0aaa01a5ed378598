"""--hold-heartbeat: a held `"stream": true` request gets a 200 event stream with SSE
comments until a replica appears, then the replica's body; or an error event."""

from __future__ import annotations

import asyncio

from tests.support.harness import ManualSource, inprocess_proxy
from tests.support.rawhttp import connect, get, read_chunks, read_head

STREAM_BODY = b'{"model": "m", "stream": true, "messages": []}'


async def test_held_stream_gets_heartbeats_then_the_replica_body(replica_factory) -> None:
    (replica,) = await replica_factory.astart(1)
    source = ManualSource()
    async with inprocess_proxy(source, empty_wait=20.0, hold_heartbeat=0.2) as app:
        source.publish()  # an empty set: the request is held
        async with connect(app.port) as conn:
            conn.send(get("/echo/raw", method="POST", body=STREAM_BODY))
            status, headers = await read_head(conn.reader)
            # The head came from the proxy while no replica existed.
            assert status == 200
            assert ("Content-Type", "text/event-stream") in headers
            chunks = read_chunks(conn.reader)
            first = await anext(chunks)
            assert first.startswith(b": sluice: waiting")
            await anext(chunks)  # a second heartbeat: the hold goes on
            source.publish(replica.url)
            rest = b"".join([c async for c in chunks if not c.startswith(b": sluice")])
    assert rest == STREAM_BODY  # the replica's /echo/raw body, relayed in the stream


async def test_held_stream_that_times_out_ends_with_an_error_event() -> None:
    source = ManualSource()
    async with inprocess_proxy(source, empty_wait=0.6, hold_heartbeat=0.2) as app:
        source.publish()
        async with connect(app.port) as conn:
            conn.send(get("/v1/chat/completions", method="POST", body=STREAM_BODY))
            status, _ = await read_head(conn.reader)
            assert status == 200
            chunks = [c async for c in read_chunks(conn.reader)]  # ends: no hang
    assert chunks[0].startswith(b": sluice")
    assert chunks[-1].startswith(b"event: error")
    assert b'"status":503' in chunks[-1]


async def test_non_streaming_held_requests_are_not_answered_early() -> None:
    source = ManualSource()
    async with inprocess_proxy(source, empty_wait=0.6, hold_heartbeat=0.1) as app:
        source.publish()
        async with connect(app.port) as conn:
            conn.send(get("/x", method="POST", body=b'{"stream": false}'))
            resp = await conn.response()
    assert resp.status == 503  # held, then the plain 503: no event stream was started


async def test_heartbeat_is_off_by_default() -> None:
    source = ManualSource()
    async with inprocess_proxy(source, empty_wait=0.6) as app:
        source.publish()
        async with connect(app.port) as conn:
            conn.send(get("/x", method="POST", body=STREAM_BODY))
            resp = await asyncio.wait_for(conn.response(), 5)
    assert resp.status == 503
