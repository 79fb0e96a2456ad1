"""Jobs on NATS JetStream: the schema v1 payload, subjects, and what to do with a delivery.

Everything here is pure. `admit` decides, before anything runs, whether a delivered
job is rejected, expired, not for this node, or run; `classify_failure` and
`after_failure` decide between a delayed retry and the dead letter; `encode_event` makes
an event that fits the server's max_payload. Subjects are an interface shared with
producers across the fleet: keep them exact.
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from app.domain.requirements import NodeProfile, Requirements, match_requirements

JOB_KINDS = ("online", "offline", "write")
STREAMS = {"online": "MM_ONLINE", "offline": "MM_OFFLINE", "write": "MM_WRITE"}
EVENTS_STREAM = "MM_EVENTS"
_TYPE = r"[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)*"
_SUBJECT = re.compile(rf"^mm\.(online|offline|write)\.([ABC])\.({_TYPE})$")


class EventKind(StrEnum):
    COMPLETED = "job.completed"
    FAILED = "job.failed"
    REJECTED = "job.rejected"
    EXPIRED = "job.expired"
    DEAD = "job.dead"  # dead-lettered, `code` says why (`unroutable` among them)
    NODE_ONLINE = "node.online"
    NODE_DRAINING = "node.draining"
    NODE_OFFLINE = "node.offline"


class Job(BaseModel):
    """Job payload, schema v1."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["job/v1"] = Field(alias="schema")
    job_id: UUID
    idempotency_key: Annotated[str, Field(min_length=1, max_length=255)]
    type: Annotated[str, Field(pattern=f"^{_TYPE}$", max_length=128)]
    requirements: Requirements = Requirements()
    payload: dict[str, Any] = Field(default_factory=dict)
    created_at: AwareDatetime
    deadline: AwareDatetime | None = None


def job_json_schema() -> dict[str, Any]:
    """JSON Schema of job/v1, as published in docs/job-schema-v1.json."""
    schema = Job.model_json_schema(by_alias=True)
    schema["$id"] = "https://node-system/schemas/job/v1.json"
    schema["title"] = "Job (schema job/v1)"
    return schema


def job_subject(kind: str, tier: str, job_type: str) -> str:
    return f"mm.{kind}.{tier}.{job_type}"


def consumer_filter(kind: str, tier: str) -> str:
    return f"mm.{kind}.{tier}.>"


def consumer_name(tier: str) -> str:
    return f"wm-{tier}"


def event_subject(node_id: str, event: EventKind) -> str:
    return f"mm.events.{node_id}.{event.value}"


def parse_subject(subject: str) -> tuple[str, str, str] | None:
    """(kind, tier, type) of a job subject, or None when it is not one."""
    match = _SUBJECT.fullmatch(subject)
    return None if match is None else (match.group(1), match.group(2), match.group(3))


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a delivery is not a valid job, with whatever ids could be read from it."""

    reason: str
    job_id: str | None = None
    idempotency_key: str | None = None


# NATS's default max_payload: a bigger message does not reach a consumer anyway, and one
# that does (a server configured larger) is refused before it is decoded.
MAX_JOB_BYTES = 1024 * 1024
# Arrays and objects inside one another, the job object being level 1: deep enough for any
# payload a handler means to read, and far below what json, pydantic and the encoders the
# job meets later (events, the ledger, HTTP bodies) recurse through.
MAX_JOB_DEPTH = 64
# Values (objects, arrays, strings, numbers, ...) in one job. Structure costs far more
# memory than its text: 1 MiB of `{},{},...` is 350,000 dicts, which json.loads keeps in
# 24 MiB (47 MiB at its peak), so that four such jobs at once exhausted a 256 MiB pod. At
# this bound the costliest structure measured (one-member objects) keeps 3.5 MiB (peak
# 4.5 MiB), less than the text of a 1 MiB job can take on its own (8 MiB at the peak:
# one astral character makes Python store every character of it in 4 bytes); 50,000
# floats at full precision are about as many as 1 MiB of JSON holds.
MAX_JOB_VALUES = 50_000
MAX_REJECTION_REASON = 500
_MAX_ID_CHARS = 255
_SURROGATE = re.compile("[\ud800-\udfff]")
_UNFIT_IN_ID = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
# What counts values before json.loads: every value of a JSON object but the object
# itself follows a `[`, `,` or `:`, so these and `{` outside strings are at least as many
# as its values, and they are counted at C speed without decoding anything. In UTF-8 no
# byte of a multi-byte character is ASCII, so the bytes can be scanned as they came.
_STRUCTURE = (b"{", b"[", b",", b":")
# From where a scan stands to the next string with structure inside it (its span is
# group 1), over any text and strings without: one match per such string, none per plain
# string, so that neither allocates per string (re.sub would, 60 MiB for 1 MiB of
# `"",""...`). Possessive, so that nothing backtracks, and never failing (the string's
# closing quote is optional, and the end of the text ends a match), so that no match is
# tried again from inside a string, which could be quadratic.
_NEXT_STRUCTURED_STRING = re.compile(
    rb'(?:[^"]++|"[^"\\{\[,:]*+(?:\\.[^"\\{\[,:]*+)*+")*+'
    rb'(?:("[^"\\]*+(?:\\.[^"\\]*+)*+"?)|\Z)',
    re.DOTALL,
)


class _NotJson(ValueError):
    """A token Python's json reads but JSON does not have (NaN, Infinity)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def parse_job(data: bytes, subject: str) -> Job | Rejection:
    """The job a delivery carries, or why it is not one. Total: whatever the bytes, a Job
    or a Rejection, never an exception (it would leave the delivery unanswered).

    A Job returned can go on: its text is Unicode (it encodes to UTF-8 for the ledger,
    events and HTTP bodies), its numbers are finite, its nesting bounded and its key free
    of NUL, which PostgreSQL text cannot hold.
    """
    if len(data) > MAX_JOB_BYTES:
        return Rejection(
            f"payload is {len(data)} bytes, more than the {MAX_JOB_BYTES} a job may be"
        )
    if _structure(data) > MAX_JOB_VALUES:
        return Rejection(f"payload has more than the {MAX_JOB_VALUES} values a job may have")
    try:
        # strictly UTF-8 (RFC 8259): json.loads(bytes) would also take UTF-16 and UTF-32
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejection(f"payload is not JSON: not UTF-8 (byte {exc.start})")
    try:
        raw = json.loads(text, parse_constant=_refuse_constant)
    except _NotJson as exc:
        return Rejection(f"payload is not JSON: {exc}")
    except json.JSONDecodeError as exc:
        return Rejection(f"payload is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        return Rejection("payload is not JSON: a number too long to read")
    except RecursionError:
        return Rejection(f"payload nests arrays and objects more than {MAX_JOB_DEPTH} deep")
    ids: dict[str, Any] = {}
    if isinstance(raw, dict):
        ids = {key: _readable_id(raw.get(key)) for key in ("job_id", "idempotency_key")}
    unfit = _unfit(raw)
    if unfit is not None:
        return Rejection(unfit, **ids)
    try:
        job = Job.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _bounded(".".join(str(p) for p in first["loc"]), 120) or "payload"
        return Rejection(_bounded(f"{where}: {first['msg']}"), **ids)
    if "\x00" in job.idempotency_key:
        return Rejection("idempotency_key: must not contain NUL (\\u0000)", **ids)
    parsed = parse_subject(subject)
    if parsed is None:
        return Rejection(_bounded(f"subject {subject!r} is not mm.<kind>.<tier>.<type>"), **ids)
    if parsed[2] != job.type:
        return Rejection(
            _bounded(f"subject type {parsed[2]!r} differs from payload type {job.type!r}"),
            **ids,
        )
    return job


def _structure(data: bytes) -> int:
    """The `{`, `[`, `,` and `:` outside the strings of a JSON text: an upper bound of its
    values when it is an object. Counted with the strings' own first, which is enough for
    almost every job; only when that is over the bound are the strings with structure
    inside found and theirs taken off, until the count is within the bound or it is
    certain not to be: two strings always have a `,` or `:` between them, so more
    strings than the bound (plus one) means more structure. Allocates nothing of the
    text's size. Text that is not JSON may get any count (it is rejected either way)."""
    count = sum(map(data.count, _STRUCTURE))
    if count <= MAX_JOB_VALUES:
        return count
    for strings, match in enumerate(_NEXT_STRUCTURED_STRING.finditer(data), 1):
        start, end = match.span(1)
        if start < 0 or strings > MAX_JOB_VALUES + 1:  # the end of the text, or certain
            break
        count -= sum(data.count(mark, start, end) for mark in _STRUCTURE)
        if count <= MAX_JOB_VALUES:
            break
    return count


def _unfit(value: Any) -> str | None:
    """Why parsed JSON cannot travel on as a job, or None. Iterative, so that no depth can
    make it recurse; json.loads gives exactly dict, list, str, int, float, bool and None."""
    stack: list[tuple[Any, int]] = [([value], 0)]
    while stack:
        container, depth = stack.pop()
        if depth > MAX_JOB_DEPTH:
            return f"payload nests arrays and objects more than {MAX_JOB_DEPTH} deep"
        if type(container) is dict:
            for key in container:
                if not key.isascii() and _SURROGATE.search(key):
                    return _not_unicode(key)
            items = container.values()
        else:
            items = container
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif kind is str:
                if not item.isascii() and _SURROGATE.search(item):
                    return _not_unicode(item)
            elif kind is float and not math.isfinite(item):
                return "payload has a number out of range (it does not fit a 64-bit float)"
    return None


def _not_unicode(text: str) -> str:
    found = _SURROGATE.search(text)
    code = f"\\u{ord(found.group()):04x}" if found else "?"
    return f"payload has text with an unpaired surrogate ({code}), which is not Unicode"


def _readable_id(value: Any) -> str | None:
    """An id worth reporting with a rejection: a short string (or integer) that can go
    into an event and a Nats-Msg-Id header; None for anything else (a 100 kB string, a
    nested list, a control character or an unpaired surrogate)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID_CHARS:
        return None
    return None if _UNFIT_IN_ID.search(value) else value


def _bounded(text: str, limit: int = MAX_REJECTION_REASON) -> str:
    """Short enough for an event and a log line, however long the input was."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Admission(StrEnum):
    RUN = "run"
    REJECT = "reject"  # term + job.rejected
    EXPIRE = "expire"  # term + job.expired
    NOT_HERE = "not-here"  # nak with delay; another node may run it


@dataclass(frozen=True, slots=True)
class Decision:
    admission: Admission
    reason: str = ""


def admit(job: Job | Rejection, *, node: NodeProfile, now: datetime) -> Decision:
    """Run, reject, expire, or leave the job to another node. Another trust zone is one
    more unmet requirement, not a refusal: the tier's consumer is shared by its nodes in
    every zone, and one of them may run the job."""
    if isinstance(job, Rejection):
        return Decision(Admission.REJECT, job.reason)
    if job.deadline is not None and job.deadline <= now:
        return Decision(Admission.EXPIRE, f"deadline {job.deadline.isoformat()} has passed")
    misses = match_requirements(job.requirements, node)
    if misses:
        return Decision(
            Admission.NOT_HERE,
            "requirements not met: " + ", ".join(m.value for m in misses),
        )
    return Decision(Admission.RUN)


class FailureKind(StrEnum):
    RETRYABLE = "retryable"
    PERMANENT = "permanent"


class JobFailure(Exception):
    """Raised by handlers to say how a failure should be treated."""

    kind: FailureKind = FailureKind.RETRYABLE


class RetryableJobFailure(JobFailure):
    kind = FailureKind.RETRYABLE


class PermanentJobFailure(JobFailure):
    kind = FailureKind.PERMANENT


# How a handler's failure that is not a JobFailure is treated: the first row whose class
# it is an instance of decides (docs/jobs.md says why). Connection errors come before
# ValueError because a certificate that does not verify is both, and is transient (one
# being rotated); TimeoutError is an OSError. The last row takes anything else, which
# may be transient and is retried within the attempts.
FAILURE_CLASSES: tuple[tuple[type[BaseException], FailureKind], ...] = (
    (OSError, FailureKind.RETRYABLE),
    # the same payload fails the same way on every attempt: pydantic's ValidationError,
    # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
    (ValueError, FailureKind.PERMANENT),
    (KeyError, FailureKind.PERMANENT),
    (TypeError, FailureKind.PERMANENT),
    (BaseException, FailureKind.RETRYABLE),
)


def classify_failure(exc: BaseException) -> FailureKind:
    """Retry or dead-letter a handler's failure: a JobFailure says its own kind; an
    exception group (from a TaskGroup) is permanent only when everything in it is;
    anything else by the first row of FAILURE_CLASSES that it matches."""
    if isinstance(exc, JobFailure):
        return exc.kind
    if isinstance(exc, BaseExceptionGroup):
        kinds = {classify_failure(inner) for inner in exc.exceptions}
        return FailureKind.PERMANENT if kinds == {FailureKind.PERMANENT} else FailureKind.RETRYABLE
    return next(kind for cls, kind in FAILURE_CLASSES if isinstance(exc, cls))


@dataclass(frozen=True, slots=True)
class Verdict:
    retry: bool
    delay: float = 0.0


def after_failure(
    kind: FailureKind, *, attempt: int, max_attempts: int, backoff: tuple[float, ...]
) -> Verdict:
    """Retry or dead-letter a job whose attempt failed. `attempt` is the ledger's count of
    real attempts (the claim number, 1 for the first), not JetStream's delivery count,
    which hand-ons to other nodes and outages spend too. Retry n waits backoff[n-1], the
    last step once the list is spent; a permanent failure, or the last attempt allowed
    failing, is dead-lettered."""
    if kind is FailureKind.PERMANENT or attempt >= max_attempts:
        return Verdict(retry=False)
    if not backoff:
        return Verdict(retry=True, delay=1.0)
    return Verdict(retry=True, delay=backoff[min(max(attempt, 1), len(backoff)) - 1])


def event_body(
    *,
    node_id: str,
    job_id: str | None,
    idempotency_key: str | None,
    at: datetime,
    reason: str | None = None,
    result: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "job_id": job_id,
        "idempotency_key": idempotency_key,
        "node_id": node_id,
        "at": at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
    }
    if reason is not None:
        body["reason"] = reason
    if result is not None:
        body["result"] = result
    body.update(extra)
    return body


# What a shortened string ends with, so that a reader knows it is not the whole text.
TRUNCATED_MARK = "… (truncated)"
# Never shortened while anything else can give way: what an event is found and deduplicated by.
_EVENT_IDS = frozenset({"job_id", "idempotency_key", "node_id", "at"})
_TRUE = b"true"
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 400
_REPR.maxlevel = 8


def encode_event(body: dict[str, Any], *, max_bytes: int) -> bytes:
    """The compact JSON (UTF-8) of an event body, in at most `max_bytes` (the server's
    max_payload): a bigger message is refused by the server, and the job's answer waits
    on the event. Never raises, whatever the body holds.

    A body that fits is sent as it is. One that does not gets `"truncated": true`, and
    its biggest parts are shortened first, down to a common size that fits (so that a
    huge result does not take all the room from a long reason): `result`, an object or
    an array becomes `{"truncated": true, "excerpt": "<first characters of its JSON>",
    "bytes": <its size>}`; a string is cut and ends with TRUNCATED_MARK. Only when every
    other part is as short as it gets are parts left out, the biggest first, and only
    then are the ids (job_id, idempotency_key, node_id, at) shortened or left out. A
    value that is not JSON (a set, NaN, an object) becomes the text of its repr, and the
    body is marked truncated; an unpaired surrogate in text becomes U+FFFD.
    """
    if all(isinstance(key, str) for key in body):
        # the common case, in one dumps: what the parts below would join to when it fits
        text, exact = _json_text(body)
        if exact:
            data = text.encode()
            if len(data) <= max_bytes:
                return data
    parts: dict[str, _Part] = {}
    changed = False
    for key, value in body.items():
        name = key if isinstance(key, str) else _describe(key)
        parts[name] = part = _Part.of(name, value)
        changed = changed or not part.exact
    if not changed and _size(parts.values()) <= max_bytes:
        return _join(parts.values())
    parts["truncated"] = _Part.fixed("truncated", _TRUE)
    for protected in (False, True):
        group = [
            p for p in parts.values() if p.key != "truncated" and (p.key in _EVENT_IDS) is protected
        ]
        while True:
            if _fill(parts, group, max_bytes):
                return _join(parts.values())
            if not group:
                break
            # even at their shortest they do not fit: leave out the biggest of them
            left_out = max(group, key=lambda p: (p.least, len(p.data)))
            group.remove(left_out)
            del parts[left_out.key]
    return b'{"truncated":true}' if max_bytes >= 18 else b"{}"


@dataclass(slots=True)
class _Part:
    """One member of an event body: its encoded key, its value now, and how it shortens."""

    key: str
    head: bytes  # the key's JSON and ':'
    data: bytes  # the value's JSON now
    exact: bool  # data is the value's own JSON
    least: int  # the fewest bytes it can take (data, or its shortest form when smaller)
    shorten: Callable[[int], bytes] | None  # its JSON in at most n bytes (or its shortest)

    @classmethod
    def of(cls, key: str, value: Any) -> _Part:
        text, exact = _json_text(value)
        data = text.encode()
        shorten: Callable[[int], bytes] | None = None
        if exact and (key == "result" or isinstance(value, dict | list)):
            shorten = functools.partial(_excerpt, text, len(data))
        elif not exact or isinstance(value, str):
            shorten = functools.partial(_cut, value if exact else json.loads(text))
        least = len(data) if shorten is None else min(len(data), len(shorten(0)))
        return cls(key, _json_text(key)[0].encode() + b":", data, exact, least, shorten)

    @classmethod
    def fixed(cls, key: str, data: bytes) -> _Part:
        return cls(key, _json_text(key)[0].encode() + b":", data, True, len(data), None)


def _fill(parts: dict[str, _Part], group: list[_Part], max_bytes: int) -> bool:
    """Shorten the parts of `group` so that all parts fit `max_bytes`, each to one common
    level at most (the biggest give way first); False when they cannot fit."""
    budget = max_bytes - _size(parts.values()) + sum(len(p.data) for p in group)
    if sum(p.least for p in group) > budget:
        return False

    def cost(level: int) -> int:
        return sum(max(p.least, min(len(p.data), level)) for p in group)

    low, high = 0, max((len(p.data) for p in group), default=0)
    if cost(high) <= budget:
        return True
    while low < high:  # the highest level that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cost(middle) <= budget else (low, middle - 1)
    for part in group:
        if part.shorten is not None and len(part.data) > low:
            shorter = part.shorten(low)
            if len(shorter) < len(part.data):
                part.data = shorter
    return True


def _size(parts: Iterable[_Part]) -> int:
    items = [len(p.head) + len(p.data) for p in parts]
    return 2 + sum(items) + max(len(items) - 1, 0)


def _join(parts: Iterable[_Part]) -> bytes:
    return b"{" + b",".join(p.head + p.data for p in parts) + b"}"


def _json_text(value: Any) -> tuple[str, bool]:
    """A value's compact JSON, and whether it is exactly the value's: a value that is not
    JSON is described by its repr instead. Unpaired surrogates become U+FFFD, as UTF-8
    has no room for them."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        exact = True
    except Exception:  # TypeError, ValueError (NaN, a circular value), RecursionError, ...
        text, exact = json.dumps(_describe(value), ensure_ascii=False), False
    if not text.isascii() and _SURROGATE.search(text):
        text = _SURROGATE.sub("\ufffd", text)
    return text, exact


def _describe(value: Any) -> str:
    try:
        return _REPR.repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def _excerpt(text: str, size: int, limit: int) -> bytes:
    return _longest(lambda k: _excerpt_json(text[:k], size), len(text), limit)


def _excerpt_json(excerpt: str, size: int) -> bytes:
    return b'{"truncated":true,"excerpt":%s,"bytes":%d}' % (_json_text(excerpt)[0].encode(), size)


def _cut(text: str, limit: int) -> bytes:
    return _longest(lambda k: _json_text(text[:k] + TRUNCATED_MARK)[0].encode(), len(text), limit)


def _longest(form: Callable[[int], bytes], length: int, limit: int) -> bytes:
    """form(k) for the most characters k that fit `limit` bytes, form(0) if none do.
    Each character takes a byte at least, so at most limit - len(form(0)) can fit; for
    ASCII text without escapes that is the answer at once."""
    shortest = form(0)
    high = min(length, limit - len(shortest))
    if high <= 0:
        return shortest
    best = form(high)
    if len(best) <= limit:
        return best
    low = 0
    best = shortest
    high -= 1
    while low < high:
        middle = (low + high + 1) // 2
        candidate = form(middle)
        if len(candidate) <= limit:
            low, best = middle, candidate
        else:
            high = middle - 1
    return best
