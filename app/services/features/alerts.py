"""Alerts to a Matrix room: the workloads' and the components' changes, each key at most
once a window, sent by one background task; without a room they go to the log."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import SecretStr

from app.domain.components import Outcome
from app.domain.redaction import redact_url
from app.services.features.base import Decision, Off, On, Phase, Running, Spec, Step, Task
from app.services.features.deps import Decisions, Deps, Shared
from app.settings import Settings


@dataclass(frozen=True)
class MatrixConfig:
    homeserver: str
    room_id: str
    token: SecretStr
    timeout: float


class _Alerts(Spec[MatrixConfig, Running]):
    name = "alerts"

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[MatrixConfig]:
        homeserver, room, token = (
            settings.matrix_homeserver, settings.matrix_room_id, settings.matrix_access_token
        )  # fmt: skip
        if homeserver is None or room is None or token is None:
            missing = [
                name
                for name, value in (
                    ("MATRIX_HOMESERVER", homeserver),
                    ("MATRIX_ROOM_ID", room),
                    ("MATRIX_ACCESS_TOKEN", token),
                )
                if value is None
            ]
            return Off(f"{', '.join(missing)} not set: alerts go to the log")
        return On(
            MatrixConfig(homeserver, room, token, settings.backend_timeout_seconds),
            f"Matrix room {room} on {redact_url(homeserver)}",
        )

    async def open(self, config: MatrixConfig, deps: Deps) -> Running:
        from app.adapters.matrix import MatrixRoom

        room = MatrixRoom(
            homeserver=config.homeserver,
            room_id=config.room_id,
            token=config.token.get_secret_value(),
            timeout=config.timeout,
        )
        deps.stack.push_async_callback(room.aclose)
        deps.component(self).record(datetime.now(UTC), Outcome.ok())
        alerts = deps.alerts

        async def flush(budget: float) -> None:
            await alerts.flush(within=budget)

        return Running(
            tasks=[Task("alert-sender", functools.partial(alerts.deliver_to, room))],
            stops={Phase.FLUSH: Step("alerts", flush, 2.0)},
        )


ALERTS = _Alerts()
