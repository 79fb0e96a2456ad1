"""The floor: a bare ASGI app serving `POST /v1/workloads/{name}/health` with no validation.

It reads the whole body and answers 204, as the manager does, without a framework,
middleware, auth or parsing, so the gap to it is what the manager's stack costs. Run as
`python -m bench.floor_app --port N`, under uvicorn with the same options as `app serve`.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_NO_CONTENT: Message = {"type": "http.response.start", "status": 204, "headers": []}
_NOT_FOUND: Message = {"type": "http.response.start", "status": 404, "headers": []}
_EMPTY: Message = {"type": "http.response.body", "body": b""}


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    path: str = scope["path"]
    if scope["method"] == "POST" and path.startswith("/v1/workloads/") and path.endswith("/health"):
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send(_NO_CONTENT)
    else:
        await send(_NOT_FOUND)
    await send(_EMPTY)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # The same options as `app.cli._serve` passes (loop and http left on "auto" there too).
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=20,
    )


if __name__ == "__main__":
    main()
