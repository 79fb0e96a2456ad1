"""Alerts: deduplicated per window, delivered to a Matrix-compatible receiver over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from app.adapters.matrix import MatrixError, MatrixRoom
from app.main import create_app
from app.metrics import Metrics
from app.services.alerting import PRUNE_AT, Alerter
from app.services.features.uptime import UPTIME_RECORD
from app.settings import Settings
from standins.servers import ThreadedServer, serve
from tests.conftest import SettingsFactory, running, runtime_of
from tests.support.matrix_receiver import ROOM, TOKEN, MatrixReceiver
from tests.support.polling import eventually


@pytest.fixture(scope="module")
def matrix() -> Iterator[tuple[MatrixReceiver, ThreadedServer]]:
    receiver = MatrixReceiver()
    with serve(receiver.app) as server:
        yield receiver, server


@pytest.fixture
def receiver(matrix: tuple[MatrixReceiver, ThreadedServer]) -> MatrixReceiver:
    with matrix[0].lock:
        matrix[0].messages.clear()
        matrix[0].puts = 0
        matrix[0].fail_next = 0
    return matrix[0]


def alerting_settings(
    make_settings: SettingsFactory, server: ThreadedServer, node_id: str
) -> Settings:
    return make_settings(
        node_id=node_id,
        matrix_homeserver=server.url,
        matrix_room_id=ROOM,
        matrix_access_token=TOKEN,
    )


def test_the_keys_of_past_windows_are_forgotten() -> None:
    """Workloads come and go (each with its own alert keys): what the alerter holds stays
    bounded, and a key inside its window still suppresses its repeat."""
    now = [1000.0]
    alerter = Alerter(node_id="n1", metrics=Metrics(), window_seconds=60, clock=lambda: now[0])
    for i in range(20_000):
        alerter.alert(f"workload:w{i}:stale", "stale")
        now[0] += 1.0
    assert alerter.held <= 2 * PRUNE_AT
    assert alerter.alert("workload:w19999:stale", "again") is False


def test_one_alert_per_key_per_window() -> None:
    now = [1000.0]
    alerter = Alerter(node_id="n1", metrics=Metrics(), window_seconds=60, clock=lambda: now[0])
    assert alerter.alert("sync:failing", "first") is True
    assert alerter.alert("sync:failing", "again") is False
    assert alerter.alert("workload:api:stale", "other key") is True
    now[0] += 61
    assert alerter.alert("sync:failing", "next window") is True
    assert [a.text for a in alerter.recent] == [
        "[n1] first",
        "[n1] other key",
        "[n1] next window",
    ]


async def test_a_retried_send_is_one_message(
    matrix: tuple[MatrixReceiver, ThreadedServer], receiver: MatrixReceiver
) -> None:
    room = MatrixRoom(homeserver=matrix[1].url, room_id=ROOM, token=TOKEN, timeout=2)
    try:
        receiver.fail_next = 1
        await room.send("hello", txn_id="txn-1")
        await room.send("hello", txn_id="txn-1")  # a retry by the caller: same transaction
    finally:
        await room.aclose()
    assert receiver.puts == 3
    assert receiver.messages == {"txn-1": "hello"}


async def test_a_bad_token_is_an_error_not_a_retry_loop(
    matrix: tuple[MatrixReceiver, ThreadedServer], receiver: MatrixReceiver
) -> None:
    room = MatrixRoom(homeserver=matrix[1].url, room_id=ROOM, token="wrong", timeout=2)
    try:
        with pytest.raises(MatrixError, match="HTTP 401"):
            await room.send("x", txn_id="t")
    finally:
        await room.aclose()
    assert receiver.puts == 1


async def test_a_workload_turning_unhealthy_and_recovering_reaches_the_room(
    make_settings: SettingsFactory,
    matrix: tuple[MatrixReceiver, ThreadedServer],
    receiver: MatrixReceiver,
) -> None:
    app = create_app(alerting_settings(make_settings, matrix[1], "node-alerts"))
    async with running(app) as client:
        rt = runtime_of(app)
        assert rt.components["alerts"].enabled

        async def check() -> None:
            await rt.supervisor.run_now("health-watch")

        await client.post("/v1/workloads/api/health", json={"status": "healthy"})
        await check()
        await client.post("/v1/workloads/api/health", json={"status": "unhealthy"})
        await check()
        await check()  # still unhealthy: no second alert
        await client.post("/v1/workloads/api/health", json={"status": "healthy"})
        await check()

        async def two_messages() -> bool:
            return len(receiver.messages) == 2

        await eventually(two_messages, within=5)
        metrics = (await client.get("/metrics")).text
    assert sorted(receiver.messages.values()) == [
        "[node-alerts] workload api is unhealthy",
        "[node-alerts] workload api recovered (healthy)",
    ]
    assert 'workload_manager_alerts_total{outcome="delivered"} 2.0' in metrics


async def test_without_matrix_alerts_only_go_to_the_log(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(make_settings())
    rt = runtime_of(app)
    assert not rt.components["alerts"].enabled
    assert "MATRIX_HOMESERVER" in rt.components["alerts"].reason
    rt.alerts.alert("k", "something happened")
    assert "alert: [" in caplog.text and "something happened" in caplog.text


async def test_workload_alerts_need_no_reporting(make_settings: SettingsFactory) -> None:
    """The health watch is a loop of its own: with reports switched off, a workload that
    turns unhealthy still raises its alert."""
    app = create_app(make_settings(report_enabled=False, ping_stale_seconds=2.0))
    async with running(app) as client:
        rt = runtime_of(app)
        assert not rt.components["report"].enabled
        await client.post("/v1/workloads/api/health", json={"status": "unhealthy"})

        async def alerted() -> bool:
            return any(a.key == "workload:api:unhealthy" for a in rt.alerts.recent)

        await eventually(alerted, within=10)


async def test_a_start_up_failure_stops_the_alert_sender_it_started(
    make_settings: SettingsFactory,
    matrix: tuple[MatrixReceiver, ThreadedServer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the registry could not be opened")

    # a feature that fails to open after the alerts' has opened
    monkeypatch.setattr(UPTIME_RECORD, "open", refused)
    app = create_app(alerting_settings(make_settings, matrix[1], "node-alerts-start"))
    with pytest.raises(RuntimeError, match="could not be opened"):
        async with running(app):
            pass
    left = [t.get_name() for t in asyncio.all_tasks() if not t.done()]
    assert not [name for name in left if "alert-sender" in name], left
