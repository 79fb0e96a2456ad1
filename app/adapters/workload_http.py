"""HTTP calls from jobs to the node's workloads (the `http` job handler), through httpx.

A job says where to POST, so the URL is checked before anything is sent: only the
Services of the allowed namespaces, or the Services allowed one by one, may be called
(`AllowedTargets`, parsed once by the settings; the managed namespace by default), named
as Kubernetes names them — `<service>.<namespace>`, `<service>.<namespace>.svc` or
`<service>.<namespace>.svc.cluster.local`. A job must not make the node call the cluster's
own Services (kube-dns, NATS, the manager) or anything outside. A URL that could never be
sent (whitespace or control characters, userinfo, a bad port) is a permanent failure, as
is every error httpx raises for a request it cannot make: no retry would send it.

Answers are read streamed and at most `MAX_RESPONSE_BYTES` of a body is kept: what a job
returns goes to the ledger and into the `job.completed` event, and a workload must not be
able to fill the node's memory with an endless answer.

httpx and the client (its connection pool and TLS context) are made on the first call:
a worker that never runs an `http` job does not pay for them (some 3 MiB of RSS; 6 in a
development environment, where httpx also imports its command-line client's rich and
pygments).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from app.domain.http_targets import DNS_LABEL, AllowedTargets
from app.domain.redaction import redact_url

if TYPE_CHECKING:
    import httpx

MAX_RESPONSE_BYTES = 64 * 1024
_ERROR_EXCERPT_BYTES = 200


class WorkloadHttpError(RuntimeError):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class Target:
    """An allowed URL's Service. `connect_host` is the name looked up: the short
    `<service>.<namespace>` is looked up as `<service>.<namespace>.svc`, so that a
    missing Service never falls through the resolver's search list to a public name
    (`api.dev` of a namespace `dev` is also a name under a public top-level domain)."""

    host: str  # as the URL writes it, lowercased
    service: str
    namespace: str
    connect_host: str


def cluster_service(host: str) -> tuple[str, str] | None:
    """(service, namespace) when `host` is exactly `<service>.<namespace>`,
    `<service>.<namespace>.svc` or `<service>.<namespace>.svc.cluster.local` (any case;
    the last one may end in the root's dot); None for any other host."""
    name = host.lower()
    if name.endswith(".svc.cluster.local."):
        # a fully qualified cluster name; on the shorter forms a trailing dot would
        # skip the cluster's search domains and ask the internet's DNS instead
        name = name[:-1]
    labels = name.split(".")
    if labels[2:] in ([], ["svc"], ["svc", "cluster", "local"]) and len(labels) >= 2:
        service, namespace = labels[:2]
        if DNS_LABEL.fullmatch(service) and DNS_LABEL.fullmatch(namespace):
            if not _is_ip_literal(name) and "localhost" not in (service, namespace):
                return service, namespace
    return None


def _is_ip_literal(host: str) -> bool:
    """Whether a resolver would take `host` as an address, not a name: besides the
    dotted quad and IPv6, the shorter forms inet_aton reads (`127.1`, `0x7f.1`)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return True
    try:
        socket.inet_aton(host)  # parses only; no lookup
    except OSError:
        return False
    return True


def _unsendable(url: str) -> str | None:
    """Why `url` cannot be sent as it stands (None: it can). httpx refuses control
    characters itself, but only once the request is made; urlsplit silently drops a tab
    or a newline, so the host checked would not be the URL's."""
    for position, char in enumerate(url):
        if char.isspace() or ord(char) < 0x20 or 0x7F <= ord(char) < 0xA0:
            return f"{char!r} at position {position} (whitespace or a control character)"
    return None


@dataclass(frozen=True, slots=True)
class WorkloadResponse:
    """A workload's answer, cut to the limit the request was made with."""

    status: int
    body: Any  # the JSON document; or the text, when not JSON or cut short
    kept_bytes: int  # bytes of the body read and kept
    truncated: bool  # the body went on past the limit; the rest was never read


class WorkloadHttp:
    def __init__(
        self,
        *,
        timeout: float,
        allowed_targets: AllowedTargets,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`allowed_targets`: what HTTP_JOB_ALLOWED_TARGETS allows, as the settings parsed
        it. `transport` is httpx's, for tests that route the cluster's names to a local
        server."""
        self._allowed = allowed_targets
        self._timeout = timeout
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._closed = False

    def _http(self) -> httpx.AsyncClient:
        """The client, made on first use (no await in between: one client per instance)."""
        if self._closed:
            raise RuntimeError("WorkloadHttp is closed")
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout),
                follow_redirects=False,
                transport=self._transport,
            )
        return self._client

    async def aclose(self) -> None:
        self._closed = True
        if self._client is not None:
            await self._client.aclose()

    def check_url(self, url: str) -> Target:
        """The URL's Service, when the URL may be sent; else a permanent WorkloadHttpError
        saying why (and, for a host, what is allowed)."""

        def refused(why: str) -> WorkloadHttpError:
            return WorkloadHttpError(f"{redact_url(url)!r}: {why}", retryable=False)

        bad_char = _unsendable(url)
        if bad_char is not None:
            raise refused(f"not a URL that can be sent: {bad_char}")
        try:
            parts = urlsplit(url)
        except ValueError:  # brackets around something other than an IPv6 address
            raise refused("not an http(s) URL") from None
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise refused("not an http(s) URL")
        if "@" in parts.netloc:
            raise refused("userinfo (user:password@) is not allowed in the URL")
        try:
            port = parts.port
        except ValueError:
            raise refused("not a valid port (1-65535)") from None
        if port == 0:
            raise refused("not a valid port (1-65535)")
        host = (parts.hostname or "").lower()
        service = cluster_service(host)
        if service is None or not self._allowed.allows(*service):
            kind = "an IP address" if _is_ip_literal(host.rstrip(".")) else "not allowed"
            raise refused(
                f"host {host!r} is {kind}: the http job may call "
                f"{self._allowed.describe()}, as <service>.<namespace>[.svc[.cluster.local]] "
                "(HTTP_JOB_ALLOWED_TARGETS allows more)"
            )
        svc, namespace = service
        short = host == f"{svc}.{namespace}"
        return Target(host, svc, namespace, f"{host}.svc" if short else host)

    async def post(self, url: str, body: Any, *, headers: dict[str, str]) -> tuple[int, Any]:
        """(status, body) of a POST; the body cut to `MAX_RESPONSE_BYTES` (see post_capped
        for whether it was)."""
        response = await self.post_capped(url, body, headers=headers)
        return response.status, response.body

    async def post_capped(
        self, url: str, body: Any, *, headers: dict[str, str], limit: int = MAX_RESPONSE_BYTES
    ) -> WorkloadResponse:
        """POST `body` as JSON; read at most `limit` bytes of the answer, streamed.

        5xx, timeouts and connection errors raise a retryable WorkloadHttpError; 4xx (with
        the first bytes of the answer), a URL refused by `check_url` and a request httpx
        cannot make raise a permanent one.
        """
        if self._closed:
            raise RuntimeError("WorkloadHttp is closed")
        target = self.check_url(url)
        client = self._http()
        import httpx  # imported by _http already

        shown = redact_url(url)
        try:
            request_url = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise WorkloadHttpError(f"POST {shown}: {exc}", retryable=False) from None
        if request_url.host != target.host or request_url.userinfo:
            # the host checked must be the host connected to, whatever parser reads it
            raise WorkloadHttpError(
                f"POST {shown}: host read as {request_url.host!r}, not {target.host!r}",
                retryable=False,
            )
        # Uncompressed, so that the limit counts what crosses the wire; a workload that
        # compresses anyway is still cut at `limit` bytes once decoded.
        headers = {"Accept-Encoding": "identity", **headers}
        extensions: dict[str, Any] = {}
        if target.connect_host != target.host:
            # looked up by its .svc name; the Host header and the TLS name stay the URL's
            headers["Host"] = request_url.netloc.decode("ascii")
            extensions["sni_hostname"] = target.host
            request_url = request_url.copy_with(host=target.connect_host)
        try:
            async with client.stream(
                "POST", request_url, json=body, headers=headers, extensions=extensions
            ) as response:
                status = response.status_code
                if status >= 500:
                    raise WorkloadHttpError(f"POST {shown}: HTTP {status}", retryable=True)
                if status >= 400:
                    excerpt, _ = await _read_at_most(response, _ERROR_EXCERPT_BYTES)
                    raise WorkloadHttpError(
                        f"POST {shown}: HTTP {status}: {_text(excerpt, response)}",
                        retryable=False,
                    )
                content, truncated = await _read_at_most(response, limit)
                text = _text(content, response)
        except httpx.HTTPError as exc:
            raise WorkloadHttpError(
                f"POST {shown}: {type(exc).__name__}: {exc}", retryable=retryable(exc)
            ) from None
        except httpx.InvalidURL as exc:  # not an HTTPError: raised before any request
            raise WorkloadHttpError(f"POST {shown}: {exc}", retryable=False) from None
        return WorkloadResponse(
            status=status,
            body=text if truncated else _json_or_text(text),
            kept_bytes=len(content),
            truncated=truncated,
        )


def retryable(exc: httpx.HTTPError) -> bool:
    """Whether an attempt that failed with `exc` may succeed when made again. A request
    httpx cannot make never will: a scheme it has no transport for, a header or URL h11
    refuses to send (an idempotency key with a newline). Timeouts, the network's errors
    and a workload's broken answer may."""
    import httpx

    return not isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError)


async def _read_at_most(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """The first `limit` bytes of the body, and whether there was more. Reading stops
    there: leaving the `stream` block closes the connection on the rest."""
    kept = bytearray()
    async for chunk in response.aiter_bytes():
        room = limit - len(kept)
        if len(chunk) > room:
            kept += chunk[:room]
            return bytes(kept), True
        kept += chunk
    return bytes(kept), False


def _text(content: bytes, response: httpx.Response) -> str:
    # a character cut in two at the limit becomes U+FFFD
    return content.decode(response.encoding or "utf-8", errors="replace")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_or_text(text: str) -> Any:
    """The JSON document, or the text when it is none (or one the ledger's JSONB and the
    events could not carry: NaN, Infinity, nesting deeper than the interpreter takes)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return text
