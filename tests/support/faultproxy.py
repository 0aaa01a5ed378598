"""A fault-injecting TCP proxy for Redis connections (tests only, 127.0.0.1 only).

Forwards bytes both ways between its clients and a real redis-server. Armed with
`cut_after_exec(n)`, it forwards the next `n` EXEC commands to the server, then
closes the client's connection before the server's reply can reach it: the
transaction is applied, but the client sees its connection drop (what a network
blip right after EXEC looks like). It waits for the server's reply before closing
the server side, so the EXEC has run by the time the client notices.

It runs its own event loop in a thread, so sync code (click's CliRunner, which runs
its own loop) can talk through it too:

    with FaultProxy(redis_port) as proxy:
        proxy.cut_after_exec(1)
        ... connect to proxy.url ...
        assert proxy.cut == 1
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

# redis-py sends every command as a RESP array of bulk strings: EXEC is exactly this.
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()
        self._armed = 0
        self._containing = b""
        self._dropping = b""
        self.cut = 0  # connections cut after an EXEC
        self.dropped = 0  # writes dropped by drop_commands
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut_after_exec(self, count: int = 1, *, containing: bytes = b"") -> None:
        """Cut the connection right after forwarding each of the next `count` EXECs
        (only those sent in one write with `containing`, when given)."""
        with self._lock:
            self._armed = count
            self._containing = containing

    def drop_commands(self, containing: bytes) -> None:
        """From now on, never forward a write that contains `containing` (its sender waits
        for a reply that never comes, as behind a partition); b"" stops dropping."""
        with self._lock:
            self._dropping = containing
            self.dropped = 0

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        await self._server.wait_closed()

    def _drop(self, chunk: bytes) -> bool:
        with self._lock:
            if not self._dropping or self._dropping not in chunk:
                return False
            self.dropped += 1
            return True

    def _take_exec(self, chunk: bytes) -> bool:
        if _EXEC not in chunk or self._containing not in chunk:
            return False
        with self._lock:
            if self._armed <= 0:
                return False
            self._armed -= 1
            self.cut += 1
            return True

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        to_client = asyncio.create_task(self._pump(server_r, client_w))
        try:
            while chunk := await client_r.read(65536):
                if self._drop(chunk):
                    continue
                if self._take_exec(chunk):
                    # The client never gets the reply: stop relaying, drop its connection,
                    # forward the EXEC, and keep the server side open until the server
                    # has answered it (the transaction ran).
                    to_client.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await to_client
                    client_w.transport.abort()
                    server_w.write(chunk)
                    await server_w.drain()
                    await _exec_answered(server_r)
                    break
                server_w.write(chunk)
                await server_w.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            to_client.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await to_client
            server_w.close()
            client_w.close()
            self._tasks.discard(task)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        writer.close()


async def _exec_answered(reader: asyncio.StreamReader) -> None:
    """Read until the reply to EXEC arrives: the replies before it (MULTI's and each
    queued command's) are simple +OK / +QUEUED lines."""
    data = b""
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(5):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                data += chunk
                rest = data
                while rest.startswith((b"+OK\r\n", b"+QUEUED\r\n")):
                    rest = rest[rest.index(b"\n") + 1 :]
                if rest:
                    return
