"""proxy/resume.py's boundaries, byte for byte, against scripted replicas
(tests/support/harness.py ScriptedUpstream): the first replica is held and the test
writes its stream, then breaks it in one of the ways a replica fails; a second
replica answers the continuation (or refuses it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tests.proxy.test_continuation import CHAT, FIRST, chat_event
from tests.support.harness import HOLD, ManualSource, ScriptedUpstream, inprocess_proxy
from tests.support.rawhttp import RawConnection, connect, get, read_chunks, read_head

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
REST = chat_event("ld", ident="b", created=7) + chat_event(finish="stop", ident="b") \
    + b"data: [DONE]\n\n"


def chunked(*chunks: bytes, last: bool = True) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return body + (b"0\r\n\r\n" if last else b"")


ANSWER = SSE_HEAD + chunked(REST)


@asynccontextmanager
async def resuming(second_reply: bytes, **options: Any) -> AsyncIterator[
        tuple[RawConnection, Any, ScriptedUpstream, Any]]:
    """A proxy that resumes, a held first replica, a second one answering `second_reply`;
    yields (client connection, held first connection, second replica, proxy app). Once
    the first replica has the request, the ready set is the second replica only."""
    async with ScriptedUpstream({"/v1/chat/completions": HOLD}) as first, \
            ScriptedUpstream({"/v1/chat/completions": second_reply}) as second:
        source = ManualSource()
        async with inprocess_proxy(source, resume_streams=True, **options) as app:
            source.publish(first.url)
            async with connect(app.port) as conn:
                conn.send(get("/v1/chat/completions", method="POST", body=CHAT))
                held = await asyncio.wait_for(first.held.get(), 10)
                source.publish(second.url)
                yield conn, held, second, app


def events_of(received: bytes) -> list[bytes]:
    return [e for e in received.split(b"\n\n") if e]


async def read_to_end(conn: RawConnection) -> tuple[bytes, bool]:
    """The body's bytes and whether it ended with the last chunk (False: cut)."""
    status, _ = await read_head(conn.reader)
    assert status == 200
    out = []
    try:
        async for chunk in read_chunks(conn.reader):
            out.append(chunk)
    except (asyncio.IncompleteReadError, ConnectionError):
        return b"".join(out), False
    return b"".join(out), True


async def test_a_half_event_never_reaches_the_client_and_the_continuation_is_framed_anew(
) -> None:
    async with resuming(ANSWER) as (conn, held, second, _):
        part = FIRST + b'data: {"id": "chatcmpl-1", "choi'
        held.answer(SSE_HEAD + chunked(part, last=False))
        status, _ = await read_head(conn.reader)
        assert status == 200
        chunks = read_chunks(conn.reader)
        assert await anext(chunks) == FIRST  # the half event stayed behind
        held.transport.abort()
        received = b"".join([c async for c in chunks])  # up to the last chunk
    assert b'"chatcmpl-1", "choi' not in received  # the half event was never sent
    events = events_of(received)
    assert events[-1] == b"data: [DONE]"
    assert [json.loads(e[6:])["id"] for e in events[:-1]] == ["chatcmpl-1"] * 2
    (continuation,) = second.requests
    assert continuation.all("Content-Length") == [str(len(continuation.body))]
    assert continuation.all("Transfer-Encoding") == []
    assert json.loads(continuation.body)["messages"][-1] == {"role": "assistant",
                                                             "content": "Hello wor"}


async def test_a_stalled_stream_is_resumed_at_the_idle_timeout() -> None:
    async with resuming(ANSWER, stream_idle_timeout=0.5) as (conn, held, second, app):
        held.answer(SSE_HEAD + chunked(FIRST, last=False))  # then nothing: stalled
        received, whole = await read_to_end(conn)
    assert whole and events_of(received)[-1] == b"data: [DONE]"
    assert len(second.requests) == 1
    assert [k[1:] for k in app.stats.resumes] == [("idle_timeout", "attempted"),
                                                  ("idle_timeout", "succeeded")]


async def test_a_body_that_ends_before_done_is_resumed() -> None:
    async with resuming(ANSWER) as (conn, held, second, app):
        held.answer(SSE_HEAD + chunked(FIRST))  # framed, complete, but no [DONE]
        received, whole = await read_to_end(conn)
    assert whole and received.startswith(FIRST) and received.endswith(b"data: [DONE]\n\n")
    assert len(second.requests) == 1
    assert ("eof", "succeeded") in [k[1:] for k in app.stats.resumes]


async def test_a_finished_answer_that_lost_its_done_is_ended_without_a_replica() -> None:
    async with resuming(ANSWER) as (conn, held, second, _):
        held.answer(SSE_HEAD + chunked(FIRST + chat_event(finish="stop"), last=False))
        assert (await read_head(conn.reader))[0] == 200
        chunks = read_chunks(conn.reader)
        await anext(chunks)
        held.transport.abort()
        received = b"".join([c async for c in chunks])
    assert received == b"data: [DONE]\n\n"
    assert second.requests == []  # nothing to generate: no continuation sent


async def test_a_refused_continuation_cuts_the_stream_and_counts_it() -> None:
    refusal = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
               b"Content-Length: 2\r\n\r\n{}")
    async with resuming(refusal, max_attempts=1) as (conn, held, second, app):
        held.answer(SSE_HEAD + chunked(FIRST, last=False))
        assert (await read_head(conn.reader))[0] == 200
        chunks = read_chunks(conn.reader)
        assert await anext(chunks) == FIRST
        held.transport.abort()
        cut = False
        try:
            rest = [c async for c in chunks]
        except (asyncio.IncompleteReadError, ConnectionError):
            cut = True
        assert cut, f"the stream ended cleanly: {rest!r}"  # as without resuming: no end
    assert len(second.requests) == 1
    outcomes = {k[2]: v for k, v in app.stats.resumes.items()}
    assert outcomes == {"attempted": 1, "failed": 1}
    # Counted as a cut by the cause of the first replica's end, never as a plain 200.
    assert app.stats.responses == {}
    assert list(app.stats.cuts.values()) == [1]
    assert set(app.stats.cuts) <= {"upstream_reset", "upstream_eof"}


async def test_resume_attempts_bound_a_stream_whose_replicas_keep_failing() -> None:
    # The second replica answers the continuation with one event, then closes early.
    flaky = SSE_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + chunked(
        chat_event("ld", ident="b"), last=False)
    async with resuming(flaky, resume_attempts=2) as (conn, held, _, app):
        held.answer(SSE_HEAD + chunked(FIRST, last=False))
        held.transport.abort()
        received, whole = await read_to_end(conn)
    assert not whole  # cut once the attempts are used up
    assert len(received) > len(FIRST)  # each continuation's event reached the client
    outcomes: dict[str, int] = {}
    for (_, _, outcome), n in app.stats.resumes.items():
        outcomes[outcome] = outcomes.get(outcome, 0) + n
    assert outcomes == {"attempted": 3, "succeeded": 2, "failed": 1}


async def test_a_stream_cut_after_its_done_just_ends() -> None:
    async with resuming(ANSWER) as (conn, held, second, app):
        held.answer(SSE_HEAD + chunked(FIRST + b"data: [DONE]\n\n", last=False))
        assert (await read_head(conn.reader))[0] == 200
        chunks = read_chunks(conn.reader)
        assert await anext(chunks) == FIRST + b"data: [DONE]\n\n"
        held.transport.abort()  # before the last chunk
        rest = [c async for c in chunks]  # the proxy ends the body: no error
    assert rest == []  # no second [DONE]
    assert second.requests == [] and app.stats.resumes == {}


async def test_a_continuation_waits_for_a_replica_with_heartbeats_in_the_stream() -> None:
    """The cut comes while no other replica is ready (a spot replacement still
    starting): the continuation is held (--empty-wait), the client's stream carries SSE
    heartbeats meanwhile, and it goes on once a replica appears."""
    async with ScriptedUpstream({"/v1/chat/completions": HOLD}) as first, \
            ScriptedUpstream({"/v1/chat/completions": ANSWER}) as second:
        source = ManualSource()
        async with inprocess_proxy(source, resume_streams=True, empty_wait=20.0,
                                   hold_heartbeat=0.2) as app:
            source.publish(first.url)
            async with connect(app.port) as conn:
                conn.send(get("/v1/chat/completions", method="POST", body=CHAT))
                held = await asyncio.wait_for(first.held.get(), 10)
                source.publish()  # nobody else is ready
                held.answer(SSE_HEAD + chunked(FIRST, last=False))
                assert (await read_head(conn.reader))[0] == 200
                chunks = read_chunks(conn.reader)
                assert await anext(chunks) == FIRST
                held.transport.abort()
                assert (await anext(chunks)).startswith(b": sluice: waiting")
                source.publish(second.url)
                rest = [c async for c in chunks if not c.startswith(b": sluice")]
    assert events_of(b"".join(rest))[-1] == b"data: [DONE]"
    assert len(second.requests) == 1
    assert ("reset", "succeeded") in [k[1:] for k in app.stats.resumes]
