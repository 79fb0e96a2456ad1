"""Secrets out of everything shown: one redaction for URLs, connection strings and text.

Whatever the manager shows (`/v1/status`, the status page, alerts, the log, Sentry
events) passes through `redact_text` on its way out, and a configured URL through
`redact_url`, the same function. It removes:

- a URL's userinfo (RFC 3986, section 3.2.1): the password, and a user name given alone,
  which NATS and Sentry DSNs read as a token (`nats://TOKEN@host`); a user name given
  with a password is kept, the password goes. The userinfo is in the authority only (up
  to the first `/`, `?` or `#`), to its last `@`: an `@` in a path, query or fragment is
  none. An unescaped `/` or `#` cannot be in a valid URL's userinfo; when the authority
  before it is not valid either (a port that is not a number: `u:pa/ss@db`), the
  userinfo is taken to the last `@` before the query, so such a password goes whole.
- the value of every `name=value` whose name is a secret's: URL query and fragment
  parameters (separated by `&` or `;`), libpq keyword/value connection strings (`host=db
  password='…'`) and the same pairs inside free text (an exception message, a request
  line, a repr with `name="…"`). Names are matched case-insensitively after
  percent-decoding, `-` and `_` alike.
- the value of every quoted key of a secret's name with a quoted value, as JSON and
  Python reprs write them (`{"password": "…"}`, `{'token': '…'}`).
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
_NAME = r"[A-Za-z0-9_.%+\-]+"
# `name=value` after the start, a separator of query strings, or white space; the value
# is a single- (libpq) or double-quoted string, else everything up to the next `&`, `#`,
# white space, quote or angle bracket, and up to a `;` only when a `name=` follows it (a
# query parameter of its own), so a secret value with a `;` still goes whole.
_PAIR = re.compile(
    r"(?P<lead>^|[?&;#\s'\"(\[{,])"
    rf"(?P<name>{_NAME})"
    r"(?P<eq>[ \t]*=[ \t]*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'?|\"(?:[^\"\\]|\\.)*\"?"
    rf"|[^&#;\s'\"<>]*(?:;(?!{_NAME}[ \t]*=)[^&#;\s'\"<>]*)*)"
)
# a quoted key and a quoted value, as JSON or a Python dict's repr writes them
_QUOTED_PAIR = re.compile(
    r"(?P<key>(?P<q>['\"])(?P<name>[^'\"\s\\]{1,128})(?P=q)[ \t]*:[ \t]*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
)

# an Authorization header's credentials: a scheme, then a token68 of 8 characters or more;
# not an auth-param (`realm="…"`: a token, `=` and a quoted string, RFC 9110 11.2)
_CREDENTIALS = re.compile(
    r"(?i)\b(?P<scheme>Bearer|Basic|Digest|Token)(?P<space>\s+)"
    r"[A-Za-z0-9\-._~+/]{8,}=*(?![A-Za-z0-9\-._~+/=])(?!(?<==)\"[^\s,;)}\]])"
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
    if ":" in text:
        text = _QUOTED_PAIR.sub(_redact_quoted_pair, text)
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


_AUTHORITY_END = re.compile(r"[/?#]")
_PORT = re.compile(r"[0-9]*")


def _valid_host_port(authority: str) -> bool:
    """Whether an authority without userinfo is `host[:port]` with a numeric port (RFC
    3986, 3.2.2-3.2.3; an IP literal in brackets)."""
    if authority.startswith("["):
        end = authority.find("]")
        rest = authority[end + 1 :] if end >= 0 else ":x"
    else:
        rest = authority[authority.find(":") :] if ":" in authority else ""
    return not rest or (rest[0] == ":" and _PORT.fullmatch(rest[1:]) is not None)


def _redact_userinfo(match: re.Match[str]) -> str:
    scheme, rest = match["scheme"], match["rest"]
    end = _AUTHORITY_END.search(rest)
    split = len(rest) if end is None else end.start()
    at = rest.rfind("@", 0, split)
    if at < 0 and not _valid_host_port(rest[:split]):
        # not a valid URL: a password with an unescaped `/` or `#` (`u:pa/ss@db`); its
        # userinfo reaches to the last `@` before the query
        query = rest.find("?")
        at = rest.rfind("@", 0, len(rest) if query < 0 else query)
        split = max(split, at)
    head, tail = rest[:split], rest[split:]
    if "://" in tail:  # a URL in the path or a parameter (`?next=https://user:pw@host/`)
        tail = _URL.sub(_redact_userinfo, tail)
    if at < 0:
        return f"{scheme}{head}{tail}"
    user, colon, _password = head[:at].partition(":")
    shown = f"{user}:{MASK}" if colon and user else MASK
    return f"{scheme}{shown}{head[at:]}{tail}"


def _redact_pair(match: re.Match[str]) -> str:
    value = match["value"]
    masked = value.startswith(MASK) and not value[len(MASK) :].strip(",)]}")  # `f(p=***, …)`
    if value in ("", "''", '""') or masked or not is_secret_name(match["name"]):
        return match[0]
    return f"{match['lead']}{match['name']}{match['eq']}{MASK}"


def _redact_quoted_pair(match: re.Match[str]) -> str:
    value = match["value"]
    if len(value) == 2 or value[1:-1] == MASK or not is_secret_name(match["name"]):
        return match[0]
    return f"{match['key']}{value[0]}{MASK}{value[0]}"
