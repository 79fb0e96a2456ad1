"""Alerts to a Matrix room through the Client-Server API, with httpx.

`PUT /_matrix/client/v3/rooms/{room}/send/m.room.message/{txnId}` with a bearer token.
The transaction id is chosen by the caller and deterministic, so a retried send is
recognised by the homeserver and never posted twice.
"""

from __future__ import annotations

from urllib.parse import quote

import httpx
import stamina


class MatrixError(RuntimeError):
    pass


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return False


class MatrixRoom:
    def __init__(self, *, homeserver: str, room_id: str, token: str, timeout: float) -> None:
        self._path = f"/_matrix/client/v3/rooms/{quote(room_id, safe='')}/send/m.room.message"
        self._client = httpx.AsyncClient(
            base_url=homeserver,
            timeout=httpx.Timeout(timeout),
            headers={"Authorization": f"Bearer {token}"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(self, text: str, *, txn_id: str) -> None:
        body = {"msgtype": "m.text", "body": text}
        try:
            async for attempt in stamina.retry_context(
                on=_retryable, attempts=3, wait_initial=0.2, wait_max=2.0, timeout=None
            ):
                with attempt:
                    response = await self._client.put(f"{self._path}/{txn_id}", json=body)
                    response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise MatrixError(f"Matrix answered HTTP {exc.response.status_code}") from None
        except httpx.TransportError as exc:
            raise MatrixError(f"Matrix unreachable: {type(exc).__name__}: {exc}") from None
