"""NATS_URL parsed into `NatsServers`, table-driven: the servers in order, and every
refusal with its exact words (a server's password never in them)."""

from __future__ import annotations

import pytest

from app.domain.nats_servers import NATS_SCHEMES, NatsServers

FORM = "nats|tls|ws|wss://host:port, comma-separated for several"


@pytest.mark.parametrize(
    ("text", "urls"),
    [
        ("nats://a:4222", ("nats://a:4222",)),
        ("nats://a:4222, tls://b:4222,nats://c", ("nats://a:4222", "tls://b:4222", "nats://c")),
        (" ws://a:80 ,, wss://b ", ("ws://a:80", "wss://b")),
        ("nats://u:pw@a:4222", ("nats://u:pw@a:4222",)),
        ("nats://t0k3n@a", ("nats://t0k3n@a",)),
    ],
)
def test_servers_are_taken_in_order(text: str, urls: tuple[str, ...]) -> None:
    assert NatsServers.parse(text) == NatsServers(urls)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "no server given (nats://host:port, comma-separated for several)"),
        (" , ", "no server given (nats://host:port, comma-separated for several)"),
        ("nats://a:4222,http://b:4222", f"'http://b:4222' is not a NATS server URL ({FORM})"),
        ("nats://a:port", f"'nats://a:port' is not a NATS server URL ({FORM})"),
        ("a:4222", f"'a:4222' is not a NATS server URL ({FORM})"),
        ("nats://", f"'nats://' is not a NATS server URL ({FORM})"),
        ("nats://u:pw@a:4222,ftp://u:pw@b", f"'ftp://u:***@b' is not a NATS server URL ({FORM})"),
        ("nats://tok@a:x", f"'nats://***@a:x' is not a NATS server URL ({FORM})"),
    ],
)
def test_other_values_are_refused_naming_the_server_redacted(text: str, error: str) -> None:
    with pytest.raises(ValueError) as caught:
        NatsServers.parse(text)
    assert str(caught.value) == error


def test_the_schemes() -> None:
    assert NATS_SCHEMES == ("nats", "tls", "ws", "wss")


def test_shown_redacted() -> None:
    servers = NatsServers.parse("nats://t@a:4222, nats://u:p@b:4222")
    assert str(servers) == "nats://***@a:4222,nats://u:***@b:4222"
    assert repr(servers) == "NatsServers('nats://***@a:4222,nats://u:***@b:4222')"
