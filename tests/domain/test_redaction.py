"""The one redaction of everything shown, table-driven: URLs, connection strings, text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain import redaction
from app.domain.redaction import MASK, is_secret_name, redact_text, scrub

PRESIGNED = (
    "https://versions.s3.eu-west-1.amazonaws.com/manager/version"
    "?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=ASIAEXAMPLE%2F20260101%2Feu-west-1%2Fs3%2Faws4_request"
    "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=900"
    "&X-Amz-Security-Token=FwoGZXIvYXdzEXAMPLE&X-Amz-SignedHeaders=host"
    "&X-Amz-Signature=0f1e2d3c4b5a69788796a5b4c3d2e1f0"
)
PRESIGNED_SHOWN = (
    "https://versions.s3.eu-west-1.amazonaws.com/manager/version"
    "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
    "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=900"
    "&X-Amz-Security-Token=***&X-Amz-SignedHeaders=host&X-Amz-Signature=***"
)

URLS = [
    # userinfo: the password goes, a user name given alone goes too (NATS reads it as a token)
    ("postgresql://u:pw@db:5432/x", "postgresql://u:***@db:5432/x"),
    ("postgresql://u@db/x", "postgresql://***@db/x"),
    ("postgresql://:pw@db/x", "postgresql://***@db/x"),
    ("nats://t0k3n@nats:4222", "nats://***@nats:4222"),
    ("nats://tok:en@nats:4222", "nats://tok:***@nats:4222"),
    ("nats://t@a:4222,nats://u:p@b:4222", "nats://***@a:4222,nats://u:***@b:4222"),
    ("tls://a:4222, nats://k@b:4222", "tls://a:4222, nats://***@b:4222"),
    # an authority with no `:` and no `@` has no userinfo: an @ in its path, query or
    # fragment is none
    ("https://host/p/user@example.com", "https://host/p/user@example.com"),
    ("https://host?mail=a@b.example", "https://host?mail=a@b.example"),
    ("https://host#a@b", "https://host#a@b"),
    # otherwise it fails closed: the userinfo reaches the last @ before the query, as a
    # password may hold an unescaped /, # or @ (not a valid URL, but what a setting may
    # hold), and an @ of the path is hidden with it rather than a password shown
    ("postgresql://u:p@ss@db/x", "postgresql://u:***@db/x"),
    ("postgresql://u:pa/ss@db/x", "postgresql://u:***@db/x"),
    ("postgresql://u:pa#ss@db/x", "postgresql://u:***@db/x"),
    ("postgresql://app:1234/abcd@db:5432/wm", "postgresql://app:***@db:5432/wm"),
    ("nats://tok:99#x@h:4222", "nats://tok:***@h:4222"),
    ("https://u:/secret@host/x", "https://u:***@host/x"),
    ("redis://:p@ss/w0rd@h", "redis://***@h"),
    ("https://u:pw@host/p/a@b", "https://u:***@b"),
    ("https://host:8443/p/user@example.com", "https://host:***@example.com"),
    ("https://[::1]:5432/p@q", "https://[:***@q"),
    # a port that does not parse is no reason to show the rest
    ("postgresql://u:pw@db:port/x", "postgresql://u:***@db:port/x"),
    # the Sentry DSN's key is its user name
    ("https://0123abcd@o1.ingest.sentry.io/42", "https://***@o1.ingest.sentry.io/42"),
    # query parameters, libpq's included
    ("postgresql://u@db/x?password=s3", "postgresql://***@db/x?password=***"),
    ("postgresql://db/x?sslmode=require&sslpassword=k", "postgresql://db/x?sslmode=require&sslpassword=***"),
    ("postgresql://db/x?PassWord=s3&application_name=wm", "postgresql://db/x?PassWord=***&application_name=wm"),
    ("http://h/a?pass=1&pwd=2&passwd=3&secret=4", "http://h/a?pass=***&pwd=***&passwd=***&secret=***"),
    ("http://h/a?token=1&access_token=2&auth=3", "http://h/a?token=***&access_token=***&auth=***"),
    ("http://h/a?authorization=1&key=2&api_key=3", "http://h/a?authorization=***&key=***&api_key=***"),
    ("http://h/a?apikey=1&api-key=2&x-api-key=3", "http://h/a?apikey=***&api-key=***&x-api-key=***"),
    ("http://h/a?sig=1&signature=2", "http://h/a?sig=***&signature=***"),
    # presigned S3 (SigV4): the credential, session token and signature go, the rest stays
    (PRESIGNED, PRESIGNED_SHOWN),
    ("https://h/v?x-amz-signature=ab&x-amz-expires=60", "https://h/v?x-amz-signature=***&x-amz-expires=60"),
    ("https://h/v?X%2DAmz%2DSignature=ab", "https://h/v?X%2DAmz%2DSignature=***"),
    # S3 SigV2, GCS V4 and V2, Azure SAS
    ("https://h/v?AWSAccessKeyId=AK&Expires=1&Signature=s%3D", "https://h/v?AWSAccessKeyId=***&Expires=1&Signature=***"),
    ("https://h/v?X-Goog-Credential=c&X-Goog-Signature=s&X-Goog-Date=d", "https://h/v?X-Goog-Credential=***&X-Goog-Signature=***&X-Goog-Date=d"),
    ("https://h/v?GoogleAccessId=g&Signature=s", "https://h/v?GoogleAccessId=***&Signature=***"),
    ("https://a.blob.core.windows.net/c/v?sv=2022-11-02&sp=r&sig=abc%3D", "https://a.blob.core.windows.net/c/v?sv=2022-11-02&sp=r&sig=***"),
    # OAuth in a fragment; names ending in a secret's; token_type is no secret
    ("https://h/cb#access_token=t&token_type=bearer", "https://h/cb#access_token=***&token_type=bearer"),
    ("https://h/a?client_secret=c&refresh_token=r&db_password=p", "https://h/a?client_secret=***&refresh_token=***&db_password=***"),
    ("https://h/a?sentry_key=k&sentry_version=7", "https://h/a?sentry_key=***&sentry_version=7"),
    # a URL inside a parameter
    ("https://h/login?next=https://u:pw@other/x", "https://h/login?next=https://u:***@other/x"),
    # libpq keyword/value connection strings
    ("host=db user=u password=s3 dbname=x", "host=db user=u password=*** dbname=x"),
    ("host=db password = 's3 cr\\'et' dbname=x", "host=db password = *** dbname=x"),
    ("host=db sslpassword=k", "host=db sslpassword=***"),
    # `;` separates query parameters too (W3C HTML 4.01, B.2.2)
    ("https://h/a?a=1;password=pw", "https://h/a?a=1;password=***"),
    ("https://h/a?a=1;b=2;token=t&c=3", "https://h/a?a=1;b=2;token=***&c=3"),
    ("host=db password=a;b dbname=x", "host=db password=*** dbname=x"),
    # nothing secret: unchanged
    ("https://backend.example/v1/nodes/n1/workloads?version=1.2.0", "https://backend.example/v1/nodes/n1/workloads?version=1.2.0"),
    ("s3://versions/manager/version", "s3://versions/manager/version"),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("https://h/a?monkey=1&keys=2&password=", "https://h/a?monkey=1&keys=2&password="),
    ("", ""),
]  # fmt: skip


@pytest.mark.parametrize(("url", "expected"), URLS)
def test_redact_url(url: str, expected: str) -> None:
    assert redaction.redact_url(url) == expected


TEXTS = [
    # httpx names the URL, with its query, in its errors
    (
        f"Client error '403 Forbidden' for url '{PRESIGNED}'\nFor more information check: "
        "https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/403",
        f"Client error '403 Forbidden' for url '{PRESIGNED_SHOWN}'\nFor more information check: "
        "https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/403",
    ),
    (
        "postgres at postgresql://u:pw@db/x?password=s3 is not reachable: refused",
        "postgres at postgresql://u:***@db/x?password=*** is not reachable: refused",
    ),
    (
        "GET <https://h/v?token=abc>: HTTP 500",
        "GET <https://h/v?token=***>: HTTP 500",
    ),
    # a request line (uvicorn's access log) has no scheme
    (
        '127.0.0.1:5 - "GET /v1/status?token=abc&x=1 HTTP/1.1" 200',
        '127.0.0.1:5 - "GET /v1/status?token=***&x=1 HTTP/1.1" 200',
    ),
    # a repr with keyword arguments
    ("Dsn(host='db', password='s3')", "Dsn(host='db', password=***)"),
    # Authorization values, as a header repr in a frame variable or an error shows them
    ("(b'authorization', b'Bearer apiToken7c1d')", "(b'authorization', b'Bearer ***')"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==, next", "Authorization: Basic ***, next"),
    ('WWW-Authenticate: Basic realm="wm"', 'WWW-Authenticate: Basic realm="wm"'),
    ("a bearer token works too", "a bearer token works too"),
    ('{"Authorization": "Bearer abcdefghijklmnop"}', '{"Authorization": "***"}'),
    ('headers: "Bearer abcdefghijklmnop"', 'headers: "Bearer ***"'),
    ('"Basic dXNlcjpwYXNzd29yZA=="', '"Basic ***"'),
    ('WWW-Authenticate: Bearer realmname="wm"', 'WWW-Authenticate: Bearer realmname="wm"'),
    # double-quoted values, and quoted keys (JSON, a Python dict's repr)
    ('password = "x"', "password = ***"),
    ('config(password="s3 cr\\"et", user="u")', 'config(password=***, user="u")'),
    ("{'password': 'x', 'user': 'u'}", "{'password': '***', 'user': 'u'}"),
    ('{"password": "x", "user": "u"}', '{"password": "***", "user": "u"}'),
    ('{"db_password" : "a \\" b"}', '{"db_password" : "***"}'),
    ('{"password": ""}', '{"password": ""}'),
    ('{"passwords": ["a"], "token_type": "t"}', '{"passwords": ["a"], "token_type": "t"}'),
    # text that only looks like it
    ("sync: 3 created, key rotation=off, 0 failed", "sync: 3 created, key rotation=off, 0 failed"),
    ("a = b, token", "a = b, token"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), TEXTS)
def test_redact_text(text: str, expected: str) -> None:
    assert redact_text(text) == expected


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("password", True), ("PASSWORD", True), ("X-Amz-Security-Token", True),
        ("x_amz_credential", True), ("X%2DAmz%2DSignature", True), ("client_secret", True),
        ("sig", True), ("key", True), ("sslpassword", True), ("aws_credentials", True),
        ("token_type", False), ("password_file", False), ("keys", False), ("sv", False),
        ("X-Amz-Expires", False), ("version", False), ("sslmode", False),
    ],
)  # fmt: skip
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_scrub_walks_json_like_values() -> None:
    event: dict[str, Any] = {
        "message": "GET https://h/v?sig=abc failed",
        "breadcrumbs": {"values": [{"message": "nats://tok@n:4222 down", "level": 30}]},
        "extra": {"password": "plain", "token": None, "tuple": ("a=1&auth=b",)},
    }
    assert scrub(event) == {
        "message": "GET https://h/v?sig=*** failed",
        "breadcrumbs": {"values": [{"message": "nats://***@n:4222 down", "level": 30}]},
        "extra": {"password": MASK, "token": None, "tuple": ("a=1&auth=***",)},
    }
    assert event["message"] == "GET https://h/v?sig=abc failed"  # a copy: the input is kept


SECRET = st.text(
    alphabet=st.characters(codec="ascii", categories=("L", "N"), include_characters="-_.~+/="),
    min_size=8,
    max_size=40,
)
# a password as a setting may hold it: unescaped `/` included
USERINFO_SECRET = SECRET
NAMES = st.sampled_from([*sorted(redaction.SECRET_NAMES), "X-Amz-Signature", "Password"])


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    secret=SECRET,
    userinfo=USERINFO_SECRET,
    name=NAMES,
    user=st.sampled_from(["", "u", "reg"]),
)
def test_no_secret_survives(secret: str, userinfo: str, name: str, user: str) -> None:
    assert userinfo not in redact_text(f"postgresql://{user}:{userinfo}@db:5432/x/p@q")
    for shown in (
        f"https://h/v?a=1&{name}={secret}&b=2",
        f"https://h/v?a=1;{name}={secret};b=2",
        f"error for url 'https://h/v#{name}={secret}'",
        f"host=db {name}={secret} dbname=x",
        f'call({name}="{secret}", x=1)',
        f'{{"{name}": "{secret}", "x": 1}}',
        f"{{'{name}': '{secret}'}}",
        f'{{"Authorization": "Bearer {secret}"}}',
    ):
        redacted = redact_text(shown)
        if secret not in shown.replace(secret, ""):  # not also a part of the name or text
            assert secret not in redacted, (shown, redacted)
        assert redact_text(redacted) == redacted  # once is enough


@pytest.mark.parametrize(
    "hostile",
    [
        "a://b/" * 20_000,  # URLs nested in URLs: once a RecursionError past ~700
        "x:// " + "a" * 1_000_000,  # one long run after a scheme: once scanned per letter
        "https://u:p@h/?next=" * 20_000,
    ],
    ids=["nested", "long-run", "chained"],
)
def test_hostile_text_is_redacted_in_one_pass(hostile: str) -> None:
    # linear in the input: a scan per character of a 1 MB run would outlast the test's
    # timeout by far, and recursion per URL would exhaust the stack
    shown = redact_text(hostile)
    assert ":p@" not in shown
    assert shown == hostile.replace(":p@", f":{MASK}@")
