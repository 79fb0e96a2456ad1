"""Alerts: deduplicated, rate-limited, never blocking a loop on the homeserver.

`alert(key, text)` logs at WARNING and queues the message for the Matrix room (when one
is configured); a background task sends it. One alert per key per window: a workload
flapping every minute, or a sync failing every tick, is one message per window, not a
flood. The queue is bounded; when the homeserver is down and it fills, the oldest
alerts are dropped (and counted), never the loop that raised them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from app.domain.redaction import redact_text
from app.metrics import Metrics

if TYPE_CHECKING:
    from app.adapters.matrix import MatrixRoom

log = logging.getLogger(__name__)

QUEUE_SIZE = 100
RECENT = 20
# alert keys held before the expired ones are forgotten (then twice what is left)
PRUNE_AT = 1_024


@dataclass(frozen=True, slots=True)
class RaisedAlert:
    at: datetime
    key: str
    text: str


class Alerter:
    def __init__(
        self,
        *,
        node_id: str,
        metrics: Metrics,
        window_seconds: float,
        deliver: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`deliver`: alerts are queued for a sender (`deliver_to`), not only logged."""
        self._node_id = node_id
        self._metrics = metrics
        self._window = window_seconds
        self._delivers = deliver
        self._clock = clock
        self._last: dict[str, float] = {}
        self._prune_at = PRUNE_AT
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._recent: deque[RaisedAlert] = deque(maxlen=RECENT)

    def alert(self, key: str, text: str) -> bool:
        """Raise an alert; False when the same key already alerted in this window."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._window:
            self._metrics.alerts.labels("suppressed").inc()
            return False
        self._last[key] = now
        if len(self._last) > self._prune_at:
            self._forget_expired(now)
        # the text may quote an error that names a URL: redacted for the room and the log
        message = redact_text(f"[{self._node_id}] {text}")
        log.warning("alert: %s", message)
        self._recent.append(RaisedAlert(datetime.fromtimestamp(now, UTC), key, message))
        self._metrics.alerts.labels("raised").inc()
        if self._delivers:
            # the window's start makes the id deterministic: a retry of this alert is
            # the same transaction for the homeserver
            txn = hashlib.sha256(f"{self._node_id}|{key}|{int(now // self._window)}".encode())
            if self._queue.full():
                self._queue.get_nowait()
                self._queue.task_done()
                self._metrics.alerts.labels("dropped").inc()
            self._queue.put_nowait((message, txn.hexdigest()[:32]))
        return True

    def _forget_expired(self, now: float) -> None:
        """Keys whose window is over suppress nothing: a workload's keys go with it."""
        self._last = {k: at for k, at in self._last.items() if now - at < self._window}
        self._prune_at = max(PRUNE_AT, 2 * len(self._last))

    @property
    def held(self) -> int:
        """Alert keys held for suppression."""
        return len(self._last)

    @property
    def recent(self) -> list[RaisedAlert]:
        """The last alerts raised (suppressed repeats not included), oldest first."""
        return list(self._recent)

    async def deliver_to(self, room: MatrixRoom, stopping: asyncio.Event) -> None:
        """The background sender (a supervised task); returns once `stopping` is set and
        the queue is empty (`flush` bounds that wait on shutdown)."""
        from app.adapters.matrix import MatrixError

        while not (stopping.is_set() and self._queue.empty()):
            try:
                message, txn_id = await asyncio.wait_for(self._queue.get(), timeout=0.5)
            except TimeoutError:
                continue
            try:
                await room.send(message, txn_id=txn_id)
            except MatrixError as exc:
                self._metrics.alerts.labels("undelivered").inc()
                log.warning("alert not delivered to Matrix: %s", exc)
            else:
                self._metrics.alerts.labels("delivered").inc()
            finally:
                self._queue.task_done()

    async def flush(self, *, within: float) -> None:
        """Give queued alerts a moment to go out on shutdown."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout=within)
        except TimeoutError:
            log.warning("%d alert(s) not sent before shutdown", self._queue.qsize())
