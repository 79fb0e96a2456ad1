"""Secrets out of everything shown: one redaction for URLs, connection strings and text.

Whatever the manager shows (`/v1/status`, the status page, alerts, the log, Sentry
events) passes through `redact_text` on its way out, and a configured URL through
`redact_url`, the same function. It removes:

- a URL's userinfo (RFC 3986, section 3.2.1): the password, and a user name given alone,
  which NATS and Sentry DSNs read as a token (`nats://TOKEN@host`); a user name given
  with a password is kept, the password goes. The userinfo reaches to the last `@`
  before the query, so a password with an unescaped `/` or `#` goes whole.
- the value of every `name=value` whose name is a secret's: URL query and fragment
  parameters, libpq keyword/value connection strings (`host=db password='…'`) and the
  same pairs inside free text (an exception message, a request line). Names are matched
  case-insensitively after percent-decoding, `-` and `_` alike.
- the credentials of an HTTP `Authorization` value (`Bearer …`, RFC 6750; `Basic …`,
  RFC 7617), as a header repr in an error or a frame variable shows them.

Secret names: the exact names of the published schemes that put a credential in a URL
or a connection string, and any name ending in one of the `SECRET_ENDINGS`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

MASK = "***"

# Exact names, normalised (lower case, `-` as `_`), by where they are defined:
SECRET_NAMES = frozenset(
    {
        # libpq connection parameters that are secrets (PostgreSQL docs, 34.1.2)
        "password", "sslpassword",
        # AWS Signature Version 4 query authentication (presigned S3 URLs), and version 2
        "x_amz_signature", "x_amz_credential", "x_amz_security_token",
        "awsaccesskeyid", "signature",
        # Google Cloud Storage signed URLs, V4 and V2
        "x_goog_signature", "x_goog_credential", "googleaccessid",
        # Azure Storage shared access signatures
        "sig",
        # OAuth 2.0 (RFC 6749 section 4, RFC 6750 section 2.3)
        "access_token", "refresh_token", "id_token", "client_secret",
        # Sentry's store endpoint (`?sentry_key=`) and its default scrubbing denylist
        "sentry_key", "sentry_secret", "passwd", "secret", "api_key", "apikey", "auth",
        "credentials", "mysql_pwd", "privatekey", "private_key", "token", "session",
        "sessionid", "authorization", "x_api_key",
        # common short spellings
        "pass", "pwd", "key",
    }
)  # fmt: skip
# any name ending in one of these is a secret's too (`client_secret`, `X-Amz-Security-Token`,
# `db_password`), while `token_type` or `password_file` are not
SECRET_ENDINGS = ("password", "passwd", "secret", "token", "signature", "credential",
                  "credentials", "apikey", "api_key", "private_key", "privatekey")  # fmt: skip

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
# A URL in text: a scheme, then up to white space, a quote, `<`, `>`, or the `,` before
# the next URL (NATS_URL lists several servers that way).
_URL = re.compile(rf"(?P<scheme>{_SCHEME})(?P<rest>(?:(?!,{_SCHEME})[^\s'\"<>`])*)")
# `name=value` after the start, a separator of query strings, or white space; the value
# is a libpq single-quoted string, else everything up to the next separator.
_PAIR = re.compile(
    r"(?P<lead>^|[?&;#\s'\"(\[{,])"
    r"(?P<name>[A-Za-z0-9_.%+\-]+)"
    r"(?P<eq>[ \t]*=[ \t]*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'?|[^&#\s'\"<>]*)"
)

# an Authorization header's credentials: a scheme, then a token68 of 8 characters or more
_CREDENTIALS = re.compile(
    r"(?i)\b(?P<scheme>Bearer|Basic|Digest|Token)(?P<space>\s+)"
    r"[A-Za-z0-9\-._~+/]{8,}=*(?![A-Za-z0-9\-._~+/=\"])"
)


def is_secret_name(name: str) -> bool:
    """Whether a parameter, keyword or field of this name carries a secret."""
    normal = unquote(name).strip().lower().replace("-", "_")
    return normal in SECRET_NAMES or normal.endswith(SECRET_ENDINGS)


def redact_url(url: str) -> str:
    """A configured URL (or NATS server list, or libpq connection string) fit to show."""
    return redact_text(url)


def redact_text(text: str) -> str:
    """`text` with the secrets of every URL and every secret `name=value` in it masked."""
    if "://" in text:
        text = _URL.sub(_redact_userinfo, text)
    if "=" in text:
        text = _PAIR.sub(_redact_pair, text)
    return _CREDENTIALS.sub(rf"\g<scheme>\g<space>{MASK}", text)


def scrub(value: Any) -> Any:
    """A copy of a JSON-like value (dicts, lists, tuples, strings) with every string
    redacted, and every string under a key with a secret's name masked whole."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            key: MASK
            if isinstance(key, str) and isinstance(item, str) and item and is_secret_name(key)
            else scrub(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [scrub(item) for item in value]
    if isinstance(value, tuple):
        return tuple(scrub(item) for item in value)
    return value


def _redact_userinfo(match: re.Match[str]) -> str:
    scheme, rest = match["scheme"], match["rest"]
    query = rest.find("?")
    head, tail = (rest, "") if query < 0 else (rest[:query], rest[query:])
    if "://" in tail:  # a URL in a parameter (`?next=https://user:pw@host/`)
        tail = _URL.sub(_redact_userinfo, tail)
    at = head.rfind("@")
    if at < 0:
        return f"{scheme}{head}{tail}"
    user, colon, _password = head[:at].partition(":")
    shown = f"{user}:{MASK}" if colon and user else MASK
    return f"{scheme}{shown}{head[at:]}{tail}"


def _redact_pair(match: re.Match[str]) -> str:
    if not match["value"] or match["value"] == MASK or not is_secret_name(match["name"]):
        return match[0]
    return f"{match['lead']}{match['name']}{match['eq']}{MASK}"
