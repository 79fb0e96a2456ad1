"""Request recording and one-shot fault/delay injection, shared by test and server threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None  # without parameters, e.g. application/strategic-merge-patch+json
    status: int
    body: Any  # parsed JSON, raw text otherwise, None if empty


@dataclass
class Rule:
    method: str | None
    path_contains: str
    times: int
    status: int = 0
    message: str = ""
    retry_after: int | None = None
    seconds: float = 0.0

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method.upper() == method) and (
            self.path_contains in path
        )


class Control:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[RecordedRequest] = []
        self._faults: list[Rule] = []
        self._delays: list[Rule] = []
        # Requests started before a reset neither wait out their delay nor get recorded after it.
        self._epoch = 0
        self._interrupt = threading.Event()
        self._release = threading.Event()  # ends the holds under way early, forwarding them

    def begin(self) -> tuple[int, threading.Event, threading.Event]:
        """Epoch, interrupt and release events for a request that is starting."""
        with self._lock:
            return self._epoch, self._interrupt, self._release

    def release(self) -> None:
        """Requests held now are forwarded at once; later holds are not affected."""
        with self._lock:
            self._release.set()
            self._release = threading.Event()

    def reset(self) -> None:
        with self._lock:
            self._epoch += 1
            self._interrupt.set()
            self._interrupt = threading.Event()
            self._requests.clear()
            self._faults.clear()
            self._delays.clear()

    def add_fault(self, rule: Rule) -> None:
        with self._lock:
            self._faults.append(rule)

    def add_delay(self, rule: Rule) -> None:
        with self._lock:
            self._delays.append(rule)

    def take_fault(self, method: str, path: str) -> Rule | None:
        with self._lock:
            return _take(self._faults, method, path)

    @property
    def delays_waiting(self) -> int:
        """Delay rules not yet taken by a request."""
        with self._lock:
            return len(self._delays)

    def take_delay(self, method: str, path: str) -> float:
        with self._lock:
            rule = _take(self._delays, method, path)
        return rule.seconds if rule else 0.0

    def record(self, request: RecordedRequest, epoch: int) -> None:
        with self._lock:
            if epoch == self._epoch:
                self._requests.append(request)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._delays.clear()


def _take(rules: list[Rule], method: str, path: str) -> Rule | None:
    for rule in rules:
        if rule.matches(method, path):
            rule.times -= 1
            if rule.times <= 0:
                rules.remove(rule)
            return rule
    return None
