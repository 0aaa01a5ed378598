"""A small aiohttp replica: the instrument the proxy tests measure with.

Run as ``python -m tests.support.replica_app --port P [--id ID] [--ready-delay S]``.
Every response carries ``X-Replica-Id``. ``/stats`` reports what this replica
saw: requests by path, ``total`` (all but ``/health``, which the fixtures and
probes poll), handlers cancelled because the client went away, and requests in
flight (``/stats`` itself is never counted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import signal
import time
from collections import Counter

from aiohttp import web

STATS = web.AppKey("stats", dict)
FAST_BODY = b"x" * 99 + b"\n"  # 100 bytes


@web.middleware
async def count(request: web.Request, handler):  # type: ignore[no-untyped-def]
    stats = request.app[STATS]
    if request.path == "/stats":
        return await handler(request)
    stats["by_path"][request.path] += 1
    stats["in_flight"] += 1
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if request.get("self_closed"):  # we dropped the connection ourselves
            raise
        stats["cancelled"] += 1
        stats["cancelled_by_path"][request.path] += 1
        raise
    finally:
        stats["in_flight"] -= 1


async def fast(request: web.Request) -> web.Response:
    return web.Response(body=FAST_BODY, content_type="text/plain")


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.path,
            "raw_path": request.raw_path,
            "query_string": request.query_string,
            "version": f"{request.version.major}.{request.version.minor}",
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers],
            "peer": request.remote,
            "body_length": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
        }
    )


async def echo_raw(request: web.Request) -> web.Response:
    ctype = request.headers.get("Content-Type", "application/octet-stream")
    return web.Response(body=await request.read(), headers={"Content-Type": ctype})


async def sse(request: web.Request) -> web.StreamResponse:
    n = int(request.query.get("n", "5"))
    interval = float(request.query.get("interval", "0.1"))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(n):
        if i:
            await asyncio.sleep(interval)
        await resp.write(f"data: {json.dumps({'i': i, 't': time.time()})}\n\n".encode())
    if "done_then_hang" in request.query:
        # An OpenAI-style end, then the response's last chunk held back until cancelled.
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.Event().wait()
    await resp.write_eof()
    return resp


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(float(request.query.get("delay", "1")))
    return web.Response(text="slow\n")


async def hang(request: web.Request) -> web.Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _abort(request: web.Request) -> None:
    request["self_closed"] = True
    if request.transport is not None:
        request.transport.abort()


async def reset(request: web.Request) -> web.Response:
    _abort(request)
    # The handler is cancelled when the connection drops; never reached otherwise.
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def status(request: web.Request) -> web.Response:
    code = int(request.match_info["code"])
    if code in (204, 304) or code < 200:
        return web.Response(status=code)
    return web.Response(status=code, text=f"status {code}\n")


async def stream_then_die(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    await resp.write(b"first chunk\n")
    await asyncio.sleep(0.05)  # let the chunk leave before the connection dies
    _abort(request)
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def health(request: web.Request) -> web.Response:
    if time.monotonic() < request.app[STATS]["ready_at"]:
        return web.Response(status=503, text="starting\n")
    return web.Response(text="ok\n")


async def stats(request: web.Request) -> web.Response:
    s = request.app[STATS]
    return web.json_response(
        {
            "id": s["id"],
            "by_path": dict(s["by_path"]),
            # Probes and stats reads are not traffic: the fixtures poll /health.
            "total": sum(n for path, n in s["by_path"].items() if path != "/health"),
            "cancelled": s["cancelled"],
            "cancelled_by_path": dict(s["cancelled_by_path"]),
            "in_flight": s["in_flight"],
        }
    )


async def upload(request: web.Request) -> web.Response:
    digest, total = hashlib.sha256(), 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        digest.update(chunk)
        total += len(chunk)
    return web.json_response({"bytes": total, "sha256": digest.hexdigest()})


async def chunked(request: web.Request) -> web.StreamResponse:
    n = int(request.query.get("n", "5"))
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(n):
        await resp.write(f"chunk {i}\n".encode())
        await asyncio.sleep(0.01)
    await resp.write_eof()
    return resp


async def close(request: web.Request) -> web.Response:
    resp = web.Response(text="closing\n", headers={"Connection": "close"})
    resp.force_close()
    return resp


async def nolength(request: web.Request) -> web.Response:
    # aiohttp always frames HTTP/1.1 bodies, so write a close-delimited reply by hand.
    n = int(request.query.get("n", "1000"))
    head = (
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        f"X-Replica-Id: {request.app[STATS]['id']}\r\n\r\n"
    )
    assert request.transport is not None
    request["self_closed"] = True
    request.transport.write(head.encode() + b"n" * n)
    request.transport.close()
    await asyncio.Event().wait()  # cancelled by the close; aiohttp writes nothing more
    raise AssertionError("unreachable")


async def add_replica_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Replica-Id"] = request.app[STATS]["id"]


def make_app(replica_id: str, ready_delay: float = 0.0) -> web.Application:
    app = web.Application(middlewares=[count], client_max_size=1 << 30)
    app[STATS] = {
        "id": replica_id,
        "ready_at": time.monotonic() + ready_delay,
        "by_path": Counter(),
        "cancelled_by_path": Counter(),
        "cancelled": 0,
        "in_flight": 0,
    }
    app.on_response_prepare.append(add_replica_id)
    r = app.router
    for path, handler in [
        ("/fast", fast), ("/sse", sse), ("/slow", slow), ("/hang", hang), ("/reset", reset),
        ("/status/{code:\\d+}", status), ("/stream_then_die", stream_then_die),
        ("/health", health), ("/stats", stats), ("/chunked", chunked), ("/close", close),
        ("/nolength", nolength),
    ]:  # fmt: skip
        r.add_get(path, handler)
    r.add_route("*", "/echo/raw", echo_raw)
    r.add_route("*", "/echo{tail:.*}", echo)
    r.add_route("*", "/upload", upload)
    return app


async def serve(port: int, replica_id: str, ready_delay: float, host: str) -> None:
    await serve_app(make_app(replica_id, ready_delay), host, port)


async def serve_app(app: web.Application, host: str, port: int) -> None:
    """Serve `app` on host:port until SIGTERM or SIGINT (the test replicas' main loop)."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--id", default=None, help="replica id (default: the port)")
    p.add_argument("--ready-delay", type=float, default=0.0, help="/health is 503 until then")
    args = p.parse_args()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as r:
        r.run(serve(args.port, args.id or str(args.port), args.ready_delay, args.host))


if __name__ == "__main__":
    main()
