"""The NATS servers to connect to (NATS_URL), parsed once.

NATS_URL is one server URL, or several comma-separated (as the nats CLI takes them), so
that the first connection survives one server being down. The settings parse it into
`NatsServers`; the bus (app/adapters/bus.py) takes that value as it is. A URL may carry a
user and password or a token: `str()` and `repr()` show the servers redacted, so the
value can be logged and shown as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from app.domain.redaction import redact_url

NATS_SCHEMES = ("nats", "tls", "ws", "wss")
_FORM = f"{'|'.join(NATS_SCHEMES)}://host:port, comma-separated for several"


@dataclass(frozen=True, slots=True, repr=False)
class NatsServers:
    """The servers' URLs, in NATS_URL's order."""

    urls: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> NatsServers:
        """From NATS_URL. Raises ValueError when there is no server, or naming the first
        server (redacted) that is not a NATS server URL."""
        urls = tuple(part.strip() for part in text.split(",") if part.strip())
        if not urls:
            raise ValueError("no server given (nats://host:port, comma-separated for several)")
        for server in urls:
            parts = urlsplit(server)
            try:
                parts.port  # noqa: B018 - parsing it is the check
            except ValueError:
                parts = parts._replace(netloc="")
            if parts.scheme not in NATS_SCHEMES or not parts.hostname:
                raise ValueError(f"{redact_url(server)!r} is not a NATS server URL ({_FORM})")
        return cls(urls)

    def __str__(self) -> str:
        """The servers, comma-separated, each redacted."""
        return ",".join(redact_url(url) for url in self.urls)

    def __repr__(self) -> str:
        return f"NatsServers({str(self)!r})"
