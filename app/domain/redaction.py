"""Secrets out of everything shown: one redaction for URLs, connection strings and text.

Whatever the manager shows (`/v1/status`, the status page, alerts, the log, Sentry
events) passes through `redact_text` on its way out, and a configured URL through
`redact_url`, the same function. It removes:

- a URL's userinfo (RFC 3986, section 3.2.1): the password, and a user name given alone,
  which NATS and Sentry DSNs read as a token (`nats://TOKEN@host`); a user name given
  with a password is kept, the password goes. It fails closed: a password may hold an
  unescaped `/`, `#` or `@` (`u:p@ss/w0rd@db`, not a valid URL, but what a setting may
  hold), so when the authority (up to the first `/`, `?` or `#`) has a `:` or an `@`,
  everything up to the last `@` before the query is taken as userinfo, even if that
  hides an `@` of the path too (`https://u:pw@host/p/a@b` shows as `https://u:***@b`).
  Only an authority with neither (`https://host/p/user@example.com`) has no userinfo.
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
# Where a URL starts in text: a scheme not preceded by a scheme character (so a long run
# of letters is scanned once, not once per letter). A URL runs to the next one's start
# (a URL in a parameter, the next server of a NATS_URL list), white space, a quote, `<`,
# `>` or a backquote.
_URL_START = re.compile(rf"(?<![A-Za-z0-9+.\-]){_SCHEME}")
_URL_END = re.compile(r"[\s'\"<>`]")
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
        text = _redact_urls(text)
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


def _redact_urls(text: str) -> str:
    """Each URL's userinfo masked, the URLs taken one after the other (no recursion, so
    no input nests deep enough to exhaust the stack)."""
    starts = [(m.start(), m.end()) for m in _URL_START.finditer(text)]
    if not starts:
        return text
    parts = [text[: starts[0][0]]]
    for index, (start, body) in enumerate(starts):
        stop = starts[index + 1][0] if index + 1 < len(starts) else len(text)
        end = _URL_END.search(text, body, stop)
        url_end = stop if end is None else end.start()
        parts.append(text[start:body])  # the scheme
        parts.append(_redact_userinfo(text[body:url_end]))
        parts.append(text[url_end:stop])
    return "".join(parts)


def _redact_userinfo(rest: str) -> str:
    """The part of a URL after its scheme, with its userinfo masked (failing closed: see
    the module's docstring)."""
    end = _AUTHORITY_END.search(rest)
    authority = rest if end is None else rest[: end.start()]
    if "@" not in authority and ":" not in authority:
        return rest  # no userinfo, whatever the path, query or fragment hold
    query = rest.find("?")
    at = rest.rfind("@", 0, len(rest) if query < 0 else query)
    if at < 0:
        return rest
    user, colon, _password = rest[:at].partition(":")
    shown = f"{user}:{MASK}" if colon and user and "/" not in user else MASK
    return f"{shown}{rest[at:]}"


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
