"""A TCP listener for a test that owns every connection it accepts: on leaving, the
handlers still running are cancelled and waited for, and each connection's writer (and
any writer a handler opened and handed to `own`) is closed.

asyncio's `Server.close()` (Python 3.11) stops accepting but leaves the accepted
connections and their handlers running; one cut mid-way then outlives the test's event
loop and is reported, at some later garbage collection, against whichever test is
running then ("Exception ignored in StreamWriter.__del__: loop is closed")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Listener"], Awaitable[None]]


class Listener:
    def __init__(self) -> None:
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    def own(self, writer: asyncio.StreamWriter) -> asyncio.StreamWriter:
        """Close `writer` too when the listener ends (one a handler opened itself)."""
        self._writers.append(writer)
        return writer

    async def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        for writer in self._writers:
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    @property
    def handlers(self) -> int:
        """Handlers still running."""
        return sum(not task.done() for task in self._tasks)


@contextlib.asynccontextmanager
async def listening(handler: Handler, port: int = 0) -> AsyncIterator[Listener]:
    """Listen on 127.0.0.1:`port` (0: any free one, then in `.port`), each connection
    handled by `handler(reader, writer, listener)`."""
    listener = Listener()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        listener._tasks.add(task)
        listener.own(writer)
        await handler(reader, writer, listener)

    server = await asyncio.start_server(accepted, "127.0.0.1", port)
    listener.port = server.sockets[0].getsockname()[1]
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()
        await listener._close()
