"""The baseline: a plain aiohttp proxy written the obvious way.

One Application with one catch-all handler, one ClientSession per replica
(round-robin), bodies streamed both ways, hop-by-hop headers stripped.

    python bench/aiohttp_baseline.py --port P --replicas http://127.0.0.1:A,http://127.0.0.1:B
"""

from __future__ import annotations

import argparse
import itertools

from aiohttp import ClientSession, ClientTimeout, web

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade", "proxy-connection",
}  # fmt: skip
SESSIONS = web.AppKey("sessions", itertools.cycle)


def strip(headers, drop=()):  # type: ignore[no-untyped-def]
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP | named | set(drop)]


async def handle(request: web.Request) -> web.StreamResponse:
    session = next(request.app[SESSIONS])
    async with session.request(
        request.method,
        request.rel_url,
        headers=strip(request.headers, drop=("host",)),
        data=request.content if request.body_exists else None,
        allow_redirects=False,
    ) as upstream:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        resp.headers.extend(strip(upstream.headers))
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


def make_app(replicas: list[str]) -> web.Application:
    app = web.Application()

    async def sessions(app: web.Application):  # type: ignore[no-untyped-def]
        timeout = ClientTimeout(total=None, sock_connect=5, sock_read=120)
        made = [ClientSession(r, timeout=timeout, auto_decompress=False) for r in replicas]
        app[SESSIONS] = itertools.cycle(made)
        yield
        for s in made:
            await s.close()

    app.cleanup_ctx.append(sessions)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="plain aiohttp proxy (benchmark baseline)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replicas", required=True, help="comma-separated replica URLs")
    args = p.parse_args()
    web.run_app(make_app(args.replicas.split(",")), host=args.host, port=args.port, print=None)
