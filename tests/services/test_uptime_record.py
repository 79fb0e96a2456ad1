"""The uptime record, without a cluster: its size is bounded (it must fit one ConfigMap,
1 MiB in all, with every workload the settings allow), it is written at most every few
minutes and only when it changed, an old record is read (migrated), and something else
is refused with a warning. The clocks are injected: nothing sleeps."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from app.domain.components import Component
from app.domain.health import Ping, PingStatus
from app.domain.uptime import HOUR, WEEK, UptimeRecord
from app.services.uptime import UPTIME_KEY, ConfigMapStore, UptimeRecorder
from app.services.workloads import WorkloadBook
from app.settings import Settings

CONFIG_MAP_LIMIT = 1_048_576  # bytes, all of a ConfigMap (etcd's object limit)
HEADROOM = 256 * 1024  # metadata, managedFields, and room to spare
LONGEST_NAME = 63  # what the app takes as a workload name: a DNS-1123 label
MAX_TRACKED = Settings.model_fields["max_tracked_workloads"].default
MAX_DESIRED = Settings.model_fields["max_desired_workloads"].default
START = 1_000 * HOUR + 17.25  # wall seconds, not on an hour boundary


class FakeKube:
    """What `ConfigMapStore` needs of the cluster client; counts the writes."""

    def __init__(self, data: dict[str, str] | None = None) -> None:
        self.data = data
        self.writes: list[dict[str, str]] = []
        self.fail: Exception | None = None

    async def read_config_map(self, name: str) -> dict[str, str] | None:
        return self.data

    async def write_config_map(self, name: str, data: dict[str, str]) -> None:
        if self.fail is not None:
            raise self.fail
        self.data = dict(data)
        self.writes.append(self.data)

    def size(self) -> int:
        """The data's size as the API server counts it: keys and values, in bytes."""
        assert self.data is not None
        return sum(len(k.encode()) + len(v.encode()) for k, v in self.data.items())


class World:
    def __init__(self, kube: FakeKube | None = None, **options: Any) -> None:
        self.wall = START
        self.mono = 0.0
        self.kube = kube or FakeKube()
        self.book = WorkloadBook(
            stale_after=10 * WEEK, forget_after=10 * WEEK, capacity=MAX_TRACKED + MAX_DESIRED,
            clock=lambda: self.mono, wall_clock=lambda: self.wall,
        )  # fmt: skip
        self.component = Component("uptime", True, "test")
        self.recorder = UptimeRecorder(
            book=self.book, store=ConfigMapStore(self.kube, "workload-manager-uptime"),
            errors=(RuntimeError,), component=self.component, wall=lambda: self.wall,
            **{"max_step": 30.0, **options},
        )  # fmt: skip

    def ping(self, names: list[str], status: PingStatus) -> None:
        for name in names:
            self.book.record(name, Ping(status=status))

    async def advance(self, seconds: float, *, step: float = 10.0) -> None:
        """Let `seconds` pass, one look every `step` seconds."""
        left = seconds
        while left > 0:
            moved = min(step, left)
            self.wall += moved
            self.mono += moved
            left -= moved
            await self.recorder.tick()


def name_of(i: int, prefix: str = "w") -> str:
    stem = f"{prefix}{i}-"
    return stem + "x" * (LONGEST_NAME - len(stem))


async def test_the_worst_case_record_fits_one_config_map_with_room_to_spare() -> None:
    """Every workload the book may hold at once (each ping the settings allow, and each
    desired workload without a Deployment: `missing`), names of the longest kind, a
    week of hours each partly healthy with odd seconds: the record as written to the
    ConfigMap stays well under 1 MiB."""
    pinged = [name_of(i) for i in range(MAX_TRACKED)]
    desired = [name_of(i, "d") for i in range(MAX_DESIRED)]
    assert all(len(n) == LONGEST_NAME for n in pinged + desired)
    world = World(max_step=2 * HOUR, save_every=2 * WEEK)  # one write, at the end
    world.book.set_desired(dict.fromkeys(desired, "1.0.0"))
    world.book.set_deployed({})
    await world.recorder.open()
    await world.recorder.tick()
    for _ in range(int(WEEK // HOUR) + 2):  # a week and then some: every hour has data
        world.ping(pinged, PingStatus.HEALTHY)
        await world.advance(1_234.567, step=1_234.567)
        world.ping(pinged, PingStatus.UNHEALTHY)
        await world.advance(HOUR - 1_234.567, step=HOUR - 1_234.567)
    await world.recorder.save()
    assert world.kube.writes, "the record was not written"
    size = world.kube.size()
    assert size < CONFIG_MAP_LIMIT - HEADROOM, f"{size} bytes for {len(pinged + desired)}"
    # and nothing was lost on the way: every workload's share is in the record
    day, week = world.recorder.shares(pinged[0])
    assert day is not None and week is not None and 0.3 < day < 0.4
    assert world.recorder.shares(desired[0]) == (0.0, 0.0)


async def test_writes_come_at_most_every_five_minutes_and_only_with_news() -> None:
    world = World()
    await world.recorder.open()
    await world.advance(HOUR)  # nobody pinged: nothing to say, nothing written
    assert world.kube.writes == []
    world.ping(["api"], PingStatus.HEALTHY)
    for _ in range(int(HOUR // 10)):
        world.ping(["api"], PingStatus.HEALTHY)
        await world.advance(10.0)
    assert 11 <= len(world.kube.writes) <= 13  # one an hour in every five minutes
    written = len(world.kube.writes)
    await world.recorder.save()  # nothing new since the last write
    assert len(world.kube.writes) == written


async def test_a_stop_saves_what_was_counted_since_the_last_write() -> None:
    world = World()
    await world.recorder.open()
    await world.recorder.tick()  # the first look: counting starts here
    world.ping(["api"], PingStatus.HEALTHY)
    await world.advance(290.0)
    assert world.kube.writes == []  # the five minutes are not over
    await world.recorder.save()  # as stop_runtime does
    again = World(kube=world.kube)
    again.wall = world.wall
    await again.recorder.open()
    assert again.recorder.record.hours == {"api": {int(START // HOUR): [290.0, 290.0]}}


async def test_a_failing_write_warns_once_and_is_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World(save_every=60.0)
    await world.recorder.open()
    world.kube.fail = RuntimeError("etcdserver: request is too large")
    with caplog.at_level(logging.WARNING, logger="app.services.uptime"):
        for _ in range(10):
            world.ping(["api"], PingStatus.HEALTHY)
            await world.advance(60.0)
    warned = [r for r in caplog.records if "not saved" in r.getMessage()]
    assert len(warned) == 1
    assert world.component.detail["uptime_record"].startswith("not saved: etcdserver")
    world.kube.fail = None
    world.ping(["api"], PingStatus.HEALTHY)
    await world.advance(60.0)
    assert world.component.detail["uptime_record"] == "saved"
    assert world.kube.writes


async def test_a_version_1_record_is_read_and_written_back_compact() -> None:
    hour = int(START // HOUR)
    old = {"version": 1, "hours": {"api": {str(hour): [1800.5, 900.25]}}}
    world = World(kube=FakeKube({UPTIME_KEY: json.dumps(old)}))
    await world.recorder.open()
    assert world.recorder.record.hours == {"api": {hour: [1800.5, 900.25]}}
    await world.recorder.save()
    stored = json.loads(world.kube.writes[-1][UPTIME_KEY])
    assert stored["version"] == 2
    assert UptimeRecord.from_json(stored).hours == {"api": {hour: [1800.0, 900.0]}}


async def test_something_else_in_the_config_map_is_refused_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World(kube=FakeKube({UPTIME_KEY: json.dumps({"version": 3})}))
    with caplog.at_level(logging.WARNING, logger="app.services.uptime"):
        await world.recorder.open()
    assert "not an uptime record" in world.component.detail["uptime_record"]
    assert any("starting empty" in r.getMessage() for r in caplog.records)
    assert world.recorder.record.hours == {}


async def test_the_clock_set_back_does_not_stop_the_saves() -> None:
    world = World()
    await world.recorder.open()
    await world.recorder.tick()
    for _ in range(31):
        world.ping(["api"], PingStatus.HEALTHY)
        await world.advance(10.0)
    assert len(world.kube.writes) == 1
    world.wall -= 600.0  # someone set the clock back ten minutes
    for _ in range(61):
        world.ping(["api"], PingStatus.HEALTHY)
        await world.advance(10.0)
    assert len(world.kube.writes) >= 3  # at once, and every five minutes after


async def test_a_record_the_api_server_would_refuse_is_not_sent() -> None:
    """Settings raised far beyond the defaults can outgrow a ConfigMap: the store says so
    instead of sending what the API server would refuse."""
    world = World()
    await world.recorder.open()
    many = dict.fromkeys((name_of(i) for i in range(2_000)), "healthy")
    world.recorder.record.observe(many, start=world.wall - WEEK, end=world.wall)
    await world.recorder.save()
    assert world.kube.writes == []
    assert "more than a ConfigMap holds" in world.component.detail["uptime_record"]
