"""Run an ASGI app on a free loopback port in a background thread.

Test doubles (the local backend, the Kubernetes fault proxy, receivers) are
served this way so that both async tests and blocking subprocess calls
(`kubectl`, the manager process) can talk to them over real HTTP.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


class ThreadedServer:
    """A uvicorn server bound to 127.0.0.1 on a port chosen by the kernel."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by accepted connections: without it, keep-alive requests stall ~40 ms
        # on delayed ACKs (uvicorn only sets it on sockets it creates itself).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"server-{self.port}", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        finally:
            self.loop.close()

    def start(self) -> ThreadedServer:
        self._thread.start()
        deadline = 10.0
        step = 0.01
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("server thread died during start-up")
            if waited > deadline:
                raise TimeoutError("server did not start within 10 s")
            threading.Event().wait(step)
            waited += step
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@contextmanager
def serve(app: Any) -> Iterator[ThreadedServer]:
    server = ThreadedServer(app).start()
    try:
        yield server
    finally:
        server.stop()
