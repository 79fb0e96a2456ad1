"""HTTP client for the node-system backend: signed requests, a deadline, bounded answers,
retries with jitter.

Every request is signed by `_SigningAuth` at the last moment, over the exact bytes
httpx sends, so what the backend verifies is what went on the wire.

A backend is not trusted to be quick or small: each call (all its attempts and the waits
between them) ends within `deadline` seconds, each attempt's timeout is the lesser of
`timeout` and what is left, and an answer is read streaming and refused past
`max_response_bytes` (a declared Content-Length past it is refused unread). Retries cover
transport errors, 5xx and 429 only, honouring `Retry-After` (RFC 9110 10.2.3) as a floor:
a wait longer than the longest wait, or than what is left of the deadline, ends the call
at once with that reason. A 3xx is an error (redirects are never followed: the signature
and the trust are for this backend only), and so is any other status outside 2xx, except
the 304 of a conditional GET; a 4xx is the caller's bug and is raised at once.

A Retry-After the call does not wait out holds that kind of call (the report, the desired
state, manifests, version reports): until it passes (capped at `retry_after_max`, plus a
small jitter) such a call is not sent, and fails at once with the seconds left, which the
loop that made it takes as the time of its next run. The interval an answer asks for
(`X-Report-Interval-Seconds`, `X-Sync-Interval-Seconds`) is kept for its caller
(`interval_asked`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import stamina

from app import __version__
from app.adapters.bounded_http import (
    Holds,
    TooLarge,
    attempt_timeout,
    decide_wait,
    read_bounded,
)
from app.adapters.signing import NodeSigner
from app.domain.desired_trust import SIGNATURE_HEADER
from app.domain.retrying import GiveUp, parse_retry_after
from app.domain.steering import REPORT_INTERVAL_HEADER, SYNC_INTERVAL_HEADER, parse_interval

DEFAULT_DEADLINE_SECONDS = 30.0
DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
# how much of an error answer is read, to quote in the error
_EXCERPT_BYTES = 1024
# the statuses whose Retry-After is honoured (RFC 9110 10.2.3, RFC 6585 4)
_RETRY_AFTER_STATUSES = (429, 503)
DEFAULT_RETRY_AFTER_MAX_SECONDS = 3600.0
# the kinds of call, each held on its own by a Retry-After
REPORT, DESIRED, MANIFEST, VERSION = "report", "desired", "manifest", "version"
# the header with the interval the backend asks for, per kind of call that may carry one
_INTERVAL_HEADERS = {REPORT: REPORT_INTERVAL_HEADER, DESIRED: SYNC_INTERVAL_HEADER}


class BackendError(RuntimeError):
    """The backend could not be reached or answered with an error (message is loggable).

    `retry_after`: the seconds before such a call may be made again, from the backend's
    Retry-After (a 429 or 503 the call could not outwait; capped, jittered), which the
    caller's next run honours; None without one.
    `unreachable`: the backend failed rather than answered (a transport error, a 5xx, the
    deadline): the sync may then go on from the last good state stored on the node. A
    4xx, a redirect, an answer too large or not JSON is an answer, and is not that."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        unreachable: bool = False,
        until: datetime | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.unreachable = unreachable
        self.until = until  # when such a call may be sent again (with `retry_after`)


class BackendHeld(BackendError):
    """A call not sent: a Retry-After the backend gave that kind of call has not passed."""


class BackendDeadlineError(BackendError):
    """A call ran out its deadline (BACKEND_DEADLINE_SECONDS) without a whole answer."""

    def __init__(self, message: str) -> None:
        super().__init__(message, unreachable=True)


class _RetryableStatus(Exception):
    """A 5xx or 429: tried again unless the deadline or its Retry-After says otherwise."""

    def __init__(self, status: int, excerpt: str, retry_after: str | None) -> None:
        super().__init__(f"HTTP {status} {excerpt}".rstrip())
        self.status = status
        self.retry_after = retry_after if status in _RETRY_AFTER_STATUSES else None


@dataclass
class _Progress:
    """Where one call is, for the reason given when its deadline passes."""

    doing: str = "asking"  # asking | reading | waiting (to try again)
    received: int = 0
    last_error: str | None = None
    gave_up: str | None = None
    asked: float | None = None  # the last Retry-After, in seconds

    def at_deadline(self) -> str:
        if self.doing == "reading":
            return f"with the answer still arriving ({self.received} bytes in)"
        if self.doing == "waiting":
            return f"waiting to try again after {self.last_error}"
        before = f" (the attempt before: {self.last_error})" if self.last_error else ""
        return f"waiting for an answer{before}"


@dataclass(frozen=True)
class Answer:
    """A whole answer of the backend, its body read within the bound."""

    status_code: int
    headers: httpx.Headers
    content: bytes
    method: str
    path: str


class _SigningAuth(httpx.Auth):
    def __init__(self, signer: NodeSigner, clock: Callable[[], float]) -> None:
        self._signer = signer
        self._clock = clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = request.url.raw_path.decode("ascii")
        request.headers.update(
            self._signer.headers(
                method=request.method,
                target=target,
                body=request.content,
                timestamp=int(self._clock()),
            )
        )
        yield request


class BackendClient:
    """The calls the manager makes to the backend (CONTRACTS §2)."""

    def __init__(
        self,
        *,
        base_url: str,
        signer: NodeSigner,
        timeout: float,
        attempts: int,
        max_wait: float,
        deadline: float = DEFAULT_DEADLINE_SECONDS,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retry_after_max: float = DEFAULT_RETRY_AFTER_MAX_SECONDS,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._signer = signer
        self.holds = Holds(longest=retry_after_max, clock=clock)
        self._intervals: dict[str, float | None] = {}
        self._timeout = timeout
        self._attempts = attempts
        self._max_wait = max_wait
        self._deadline = deadline
        self._max_bytes = max_response_bytes
        self._clock = clock
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout),
            auth=_SigningAuth(signer, clock),
            headers={"User-Agent": f"workload-manager/{__version__}"},
            transport=transport,
            follow_redirects=False,
        )

    @property
    def node_id(self) -> str:
        return self._signer.node_id

    def _node_path(self, suffix: str) -> str:
        return f"/v1/nodes/{self._signer.node_id}{suffix}"

    async def aclose(self) -> None:
        await self._client.aclose()

    def interval_asked(self, kind: str) -> float | None:
        """The interval the last answer to a call of `kind` asked for (its header; None
        when it carried none or a malformed one)."""
        return self._intervals.get(kind)

    async def _send(
        self, kind: str, method: str, path: str, *, conditional: bool = False, **kwargs: Any
    ) -> Answer:
        held = self.holds.held(kind)
        if held is not None:
            raise BackendHeld(
                f"{method} {path}: {held.text()}",
                retry_after=held.left,
                unreachable=held.unreachable,
                until=held.until,
            )
        answer = await self._call(kind, method, path, conditional=conditional, **kwargs)
        header = _INTERVAL_HEADERS.get(kind)
        if header is not None:
            self._intervals[kind] = parse_interval(answer.headers.get(header))
        return answer

    async def _call(
        self, kind: str, method: str, path: str, *, conditional: bool, **kwargs: Any
    ) -> Answer:
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self._deadline
        progress = _Progress()

        def retry_or_not(exc: Exception) -> bool | float:
            return self._retry_or_not(exc, ends_at - loop.time(), progress)

        deadline = asyncio.timeout_at(ends_at)
        try:
            async with deadline:
                async for attempt in stamina.retry_context(
                    on=retry_or_not,
                    attempts=self._attempts,
                    wait_initial=min(0.2, self._max_wait),
                    wait_max=self._max_wait,
                    wait_jitter=min(1.0, self._max_wait),
                    timeout=None,  # the deadline above bounds the whole call
                ):
                    with attempt:
                        left = ends_at - loop.time()
                        return await self._attempt(
                            method, path, conditional, left, progress, kwargs
                        )
        except TimeoutError:
            if not deadline.expired():
                raise
            raise BackendDeadlineError(
                f"{method} {path}: deadline of {self._deadline:g} s "
                f"(BACKEND_DEADLINE_SECONDS) passed {progress.at_deadline()}"
            ) from None
        except _RetryableStatus as exc:
            reason = f"; not tried again: {progress.gave_up}" if progress.gave_up else ""
            unreachable, wait, until = exc.status >= 500, None, None
            if progress.asked is not None:
                wait = self.holds.hold(kind, progress.asked, unreachable=unreachable)
                held = self.holds.held(kind)
                if held is not None:
                    reason += f"; {held.text().removeprefix('not sent: ')}"
                    until = held.until
            raise BackendError(
                f"{method} {path}: {exc}{reason}",
                retry_after=wait,
                unreachable=unreachable,
                until=until,
            ) from None
        except httpx.HTTPError as exc:
            raise BackendError(f"{method} {path}: {_describe(exc)}", unreachable=True) from None
        raise AssertionError("unreachable: stamina either returns or raises")

    def _retry_or_not(self, exc: Exception, left: float, progress: _Progress) -> bool | float:
        """The backoff hook: False (raise now), True (stamina's backoff) or the seconds to
        wait before the next attempt."""
        if isinstance(exc, httpx.TransportError):
            progress.doing, progress.last_error = "waiting", _describe(exc)
            return True
        if not isinstance(exc, _RetryableStatus):
            return False
        progress.doing, progress.last_error = "waiting", f"HTTP {exc.status}"
        asked = parse_retry_after(exc.retry_after, datetime.fromtimestamp(self._clock(), UTC))
        progress.asked = asked  # the last answer's: an earlier one's is no longer said
        if asked is None:
            return True
        decision = decide_wait(asked, left=left, longest=self._max_wait)
        if isinstance(decision, GiveUp):
            progress.gave_up = decision.reason
            return False
        return decision

    async def _attempt(
        self,
        method: str,
        path: str,
        conditional: bool,
        left: float,
        progress: _Progress,
        kwargs: dict[str, Any],
    ) -> Answer:
        progress.doing, progress.received = "asking", 0
        timeout = attempt_timeout(self._timeout, left)
        async with self._client.stream(method, path, timeout=timeout, **kwargs) as response:
            status = response.status_code
            if 200 <= status < 300 or (status == 304 and conditional):
                content = await self._read_bounded(method, path, response, progress)
                return Answer(status, response.headers, content, method, path)
            excerpt = await _read_excerpt(response)
        if status >= 500 or status == 429:
            raise _RetryableStatus(status, excerpt, response.headers.get("retry-after"))
        if 300 <= status < 400 and status != 304:
            raise BackendError(
                f"{method} {path}: HTTP {status}: redirects are refused, never followed"
            )
        raise BackendError(f"{method} {path}: HTTP {status} {excerpt}".rstrip())

    async def _read_bounded(
        self, method: str, path: str, response: httpx.Response, progress: _Progress
    ) -> bytes:
        progress.doing = "reading"

        def received(size: int) -> None:
            progress.received = size

        try:
            return await read_bounded(response, self._max_bytes, received=received)
        except TooLarge as exc:
            if exc.declared is not None:
                raise BackendError(
                    f"{method} {path}: answer of Content-Length {exc.declared} is larger than "
                    f"{exc.bound} bytes (BACKEND_MAX_RESPONSE_BYTES), refused unread"
                ) from None
            raise BackendError(
                f"{method} {path}: answer larger than {exc.bound} bytes "
                "(BACKEND_MAX_RESPONSE_BYTES), refused"
            ) from None

    async def post_health(self, report: dict[str, Any]) -> None:
        await self._send(REPORT, "POST", self._node_path("/health"), json=report)

    async def get_desired(self, etag: str | None) -> tuple[str | None, Any]:
        """(ETag, decoded body); the body is NOT_MODIFIED when the backend answered 304."""
        headers = {"If-None-Match": etag} if etag else {}
        answer = await self._send(
            DESIRED, "GET", self._node_path("/workloads"), conditional=bool(etag),
            headers=headers,
        )  # fmt: skip
        if answer.status_code == 304:
            return etag, NOT_MODIFIED
        return answer.headers.get("etag"), _json(answer)

    async def get_desired_signed(self, etag: str | None) -> tuple[str | None, Any]:
        """(ETag, the `Signed` answer) for a verifier to check before anything parses it;
        NOT_MODIFIED in place of the answer when the backend answered 304."""
        headers = {"If-None-Match": etag} if etag else {}
        answer = await self._send(
            DESIRED, "GET", self._node_path("/workloads"), conditional=bool(etag),
            headers=headers,
        )  # fmt: skip
        if answer.status_code == 304:
            return etag, NOT_MODIFIED
        return answer.headers.get("etag"), Signed(
            answer.content, answer.headers.get(SIGNATURE_HEADER)
        )

    async def get_manifest(self, name: str, version: str) -> Any:
        return _json(await self._manifest_answer(name, version))

    async def get_manifest_bytes(self, name: str, version: str) -> bytes:
        """The manifest's exact bytes, for its digest to be checked before it is parsed."""
        return (await self._manifest_answer(name, version)).content

    async def _manifest_answer(self, name: str, version: str) -> Answer:
        return await self._send(
            MANIFEST, "GET", self._node_path(f"/workloads/{name}/manifest"),
            params={"version": version},
        )  # fmt: skip

    async def put_version(self, name: str, body: dict[str, Any]) -> None:
        await self._send(VERSION, "PUT", self._node_path(f"/workloads/{name}/version"), json=body)


NOT_MODIFIED = object()


@dataclass(frozen=True, slots=True)
class Signed:
    """A desired-state answer as it came: its exact bytes and its signature header."""

    body: bytes
    signature: str | None


def parse_json(content: bytes, what: str) -> Any:
    """JSON of bytes already checked (a signed state, a manifest with its digest)."""
    return _json(Answer(200, httpx.Headers(), content, "GET", what))


def _json(answer: Answer) -> Any:
    try:
        return json.loads(answer.content)
    except ValueError:  # UnicodeDecodeError is one
        raise BackendError(
            f"{answer.method} {answer.path}: answer is not JSON: {_excerpt(answer.content)}"
        ) from None
    except RecursionError:
        raise BackendError(f"{answer.method} {answer.path}: answer nested too deeply") from None


async def _read_excerpt(response: httpx.Response) -> str:
    """The start of an error answer, to quote; the rest is left unread."""
    head = b""
    try:
        async for chunk in response.aiter_bytes():
            head += chunk
            if len(head) >= _EXCERPT_BYTES:
                break
    except httpx.HTTPError:
        pass  # the status says enough
    return _excerpt(head)


def _excerpt(content: bytes) -> str:
    text = content[:_EXCERPT_BYTES].decode("utf-8", errors="replace")
    return text.strip().replace("\n", " ")[:200]


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")
