"""Alerts to a Matrix room through the Client-Server API, with httpx.

`PUT /_matrix/client/v3/rooms/{room}/send/m.room.message/{txnId}` with a bearer token.
The transaction id is chosen by the caller and deterministic, so a retried send is
recognised by the homeserver and never posted twice.

The homeserver is not trusted to be quick or small: a send (all its attempts and waits)
ends within `deadline` seconds, the answer is read up to `max_response_bytes`, a redirect
is an error (the bearer token goes to this homeserver only), and a 429 is tried again no
sooner than it asks (`Retry-After`, else `retry_after_ms` in its M_LIMIT_EXCEEDED body),
or not at all when that is longer than `max_wait` or than what is left of the deadline.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from urllib.parse import quote

import httpx
import stamina

from app.adapters.bounded_http import TooLarge, attempt_timeout, decide_wait, read_bounded
from app.domain.retrying import GiveUp, parse_retry_after, parse_retry_after_ms

DEFAULT_DEADLINE_SECONDS = 30.0
DEFAULT_MAX_WAIT_SECONDS = 10.0
# the answer to a send is `{"event_id": ...}`, an error a small JSON object
DEFAULT_MAX_RESPONSE_BYTES = 65536


class MatrixError(RuntimeError):
    pass


class _Retryable(Exception):
    """A 5xx or 429, with the wait the homeserver asked for (seconds), if it did."""

    def __init__(self, status: int, asked: float | None) -> None:
        super().__init__(f"Matrix answered HTTP {status}")
        self.status = status
        self.asked = asked


class MatrixRoom:
    def __init__(
        self,
        *,
        homeserver: str,
        room_id: str,
        token: str,
        timeout: float,
        deadline: float = DEFAULT_DEADLINE_SECONDS,
        max_wait: float = DEFAULT_MAX_WAIT_SECONDS,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self._path = f"/_matrix/client/v3/rooms/{quote(room_id, safe='')}/send/m.room.message"
        self._timeout = timeout
        self._deadline = deadline
        self._max_wait = max_wait
        self._max_bytes = max_response_bytes
        self._client = httpx.AsyncClient(
            base_url=homeserver,
            timeout=httpx.Timeout(timeout),
            headers={"Authorization": f"Bearer {token}"},
            follow_redirects=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(self, text: str, *, txn_id: str) -> None:
        body = {"msgtype": "m.text", "body": text}
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self._deadline
        gave_up: list[str] = []

        def retry_or_not(exc: Exception) -> bool | float:
            if isinstance(exc, httpx.TransportError):
                return True
            if not isinstance(exc, _Retryable):
                return False
            if exc.asked is None:
                return True
            decision = decide_wait(exc.asked, left=ends_at - loop.time(), longest=self._max_wait)
            if isinstance(decision, GiveUp):
                gave_up.append(decision.reason)
                return False
            return decision

        deadline = asyncio.timeout_at(ends_at)
        try:
            async with deadline:
                async for attempt in stamina.retry_context(
                    on=retry_or_not, attempts=3, wait_initial=0.2, wait_max=2.0, timeout=None
                ):
                    with attempt:
                        left = ends_at - loop.time()
                        await self._put(f"{self._path}/{txn_id}", body, left)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise MatrixError(
                f"Matrix gave no complete answer within the deadline of {self._deadline:g} s"
            ) from None
        except _Retryable as exc:
            reason = f"; not tried again: {gave_up[0]}" if gave_up else ""
            raise MatrixError(f"{exc}{reason}") from None
        except httpx.HTTPError as exc:
            raise MatrixError(f"Matrix unreachable: {type(exc).__name__}: {exc}") from None

    async def _put(self, path: str, body: dict[str, str], left: float) -> None:
        timeout = attempt_timeout(self._timeout, left)
        async with self._client.stream("PUT", path, json=body, timeout=timeout) as response:
            status = response.status_code
            content = await self._read_bounded(response)
        if 200 <= status < 300:
            return
        if status >= 500 or status == 429:
            raise _Retryable(status, _asked_wait(status, response.headers, content))
        if 300 <= status < 400:
            raise MatrixError(
                f"Matrix answered HTTP {status}: redirects are refused, never followed"
            )
        raise MatrixError(f"Matrix answered HTTP {status}")

    async def _read_bounded(self, response: httpx.Response) -> bytes:
        try:
            return await read_bounded(response, self._max_bytes)
        except TooLarge as exc:
            if exc.declared is not None:
                raise MatrixError(
                    f"Matrix answer of Content-Length {exc.declared} is larger than "
                    f"{exc.bound} bytes"
                ) from None
            raise MatrixError(f"Matrix answer larger than {exc.bound} bytes, refused") from None


def _asked_wait(status: int, headers: httpx.Headers, content: bytes) -> float | None:
    """The wait a 429 or 503 asks for: `Retry-After` (Client-Server API v1.10 and HTTP),
    else the older `retry_after_ms` of a 429's body."""
    if status not in (429, 503):
        return None
    asked = parse_retry_after(headers.get("retry-after"), datetime.now(UTC))
    if asked is not None or status != 429:
        return asked
    try:
        error = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return parse_retry_after_ms(error.get("retry_after_ms")) if isinstance(error, dict) else None
