"""The floor: a bare ASGI app serving `POST /v1/workloads/{name}/health` with no validation.

It reads the whole body and answers 204, as the manager does, without a framework,
middleware, auth or parsing, so the gap to it is what the manager's stack costs. Run as
`python -m bench.floor_app --port N` (default: $PORT), under uvicorn with the options
`app serve` passes (loop and http left on "auto" there too).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]


async def app(
    scope: Message,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path: str = scope["path"]
    found = (
        scope["method"] == "POST" and path.startswith("/v1/workloads/") and path.endswith("/health")
    )
    while found and (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 204 if found else 404, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                server_header=False, timeout_graceful_shutdown=20)  # fmt: skip


if __name__ == "__main__":
    main()
