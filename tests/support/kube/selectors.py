"""Label and field selectors: the query-string grammar of kube-apiserver and its matching.

Label selectors: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`, `a>1`, `a<1`,
comma-separated and ANDed. Field selectors: `metadata.name` and `metadata.namespace` with
`=`, `==` and `!=`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .meta import ApiError, Kind, Obj, bad_request

_TOKEN = re.compile(r"\s*(\(|\)|,|!=|==|=|!|>|<|[^\s(),!=<>]+)")
_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_OPERATORS = {"=", "==", "!=", "in", "notin", ">", "<"}
_SYMBOLS = {"(", ")", ",", "!=", "==", "=", "!", ">", "<"}


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !, =, !=, in, notin, >, <
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        try:
            number, bound = int(value or ""), int(self.values[0])
        except ValueError:
            return False
        return number > bound if self.op == ">" else number < bound


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    stripped = text.rstrip()
    while pos < len(stripped):
        match = _TOKEN.match(stripped, pos)
        if match is None:
            raise _error(text, f"unexpected character at {pos}")
        tokens.append(match.group(1))
        pos = match.end()
    return tokens


def _error(text: str, why: str) -> ApiError:
    return bad_request(f"unable to parse requirement: {why} in {text!r}")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.pos += 1
        return token

    def identifier(self, what: str, pattern: re.Pattern[str]) -> str:
        token = self.take()
        if token is None or token in _SYMBOLS or not pattern.match(token):
            raise _error(self.text, f"invalid {what} {token!r}")
        return token

    def requirement(self) -> Requirement:
        if self.peek() == "!":
            self.take()
            return Requirement(self.identifier("key", _KEY), "!")
        key = self.identifier("key", _KEY)
        op = self.peek()
        if op is None or op == ",":
            return Requirement(key, "exists")
        if op not in _OPERATORS:
            raise _error(self.text, f"unexpected {op!r} after key {key!r}")
        self.take()
        if op in ("in", "notin"):
            return Requirement(key, op, self.value_set())
        if op in (">", "<"):
            bound = self.take() or ""
            if not bound.lstrip("-").isdigit():
                raise _error(self.text, f"{op} needs an integer, got {bound!r}")
            return Requirement(key, op, (bound,))
        if self.peek() in (None, ","):
            return Requirement(key, "=" if op == "==" else op, ("",))
        return Requirement(key, "=" if op == "==" else op, (self.identifier("value", _VALUE),))

    def value_set(self) -> tuple[str, ...]:
        if self.take() != "(":
            raise _error(self.text, "expected '(' after in/notin")
        values: list[str] = []
        while True:
            if self.peek() in (",", ")"):
                values.append("")
            else:
                values.append(self.identifier("value", _VALUE))
            token = self.take()
            if token == ")":
                break
            if token != ",":
                raise _error(self.text, "expected ',' or ')' in value set")
        if values == [""]:
            raise _error(self.text, "value set can't be empty")
        return tuple(values)

    def parse(self) -> list[Requirement]:
        requirements: list[Requirement] = []
        if not self.tokens:
            return requirements
        while True:
            requirements.append(self.requirement())
            token = self.take()
            if token is None:
                return requirements
            if token != ",":
                raise _error(self.text, f"unexpected {token!r}")


def parse_label_selector(text: str) -> list[Requirement]:
    return _Parser(text).parse()


def from_label_selector(selector: Obj) -> list[Requirement]:
    """Requirements of a `metav1.LabelSelector` object (matchLabels + matchExpressions)."""
    requirements = [
        Requirement(key, "=", (str(value),))
        for key, value in (selector.get("matchLabels") or {}).items()
    ]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expression in selector.get("matchExpressions") or []:
        op = ops.get(str(expression.get("operator")))
        if op is None:
            raise bad_request(f"invalid label selector operator {expression.get('operator')!r}")
        values = tuple(str(v) for v in expression.get("values") or [])
        requirements.append(Requirement(str(expression.get("key")), op, values))
    return requirements


def matches(requirements: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    return all(requirement.matches(labels or {}) for requirement in requirements)


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    value: str
    negated: bool

    def matches(self, obj: Obj) -> bool:
        actual = str((obj.get("metadata") or {}).get(self.field.split(".", 1)[1], ""))
        return (actual != self.value) if self.negated else (actual == self.value)


def parse_field_selector(text: str, kind: Kind) -> list[FieldRequirement]:
    supported = ["metadata.name", "metadata.namespace"]
    requirements: list[FieldRequirement] = []
    for term in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"([^!=]+?)\s*(==|!=|=)\s*(.*)", term)
        if match is None:
            raise bad_request(f"invalid field selector: {term!r}")
        field, op, value = match.groups()
        if field not in supported:
            raise bad_request(
                f'field label not supported: "{field}" is not a known field selector for '
                f"{kind.kind}: only " + ", ".join(f'"{name}"' for name in supported)
            )
        requirements.append(FieldRequirement(field, value, negated=op == "!="))
    return requirements
