"""The uptime record, without a cluster: its size is bounded (it must fit one ConfigMap,
1 MiB in all, with every workload the settings allow), a save writes only when it changed,
an old record is read (migrated), and something else is refused with a warning. Every
call returns the outcome the supervisor records. The clocks are injected: nothing sleeps;
`World.advance` looks and saves as the `uptime-record` and `uptime-save` loops do."""

from __future__ import annotations

import json
import logging

import pytest

from app.domain.components import Outcome, Result
from app.domain.health import Ping, PingStatus
from app.domain.uptime import HOUR, SAVE_EVERY_SECONDS, WEEK, UptimeRecord
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
    def __init__(
        self,
        kube: FakeKube | None = None,
        *,
        max_step: float = 30.0,
        save_every: float = SAVE_EVERY_SECONDS,
    ) -> None:
        self.wall = START
        self.mono = 0.0
        self.kube = kube or FakeKube()
        self.book = WorkloadBook(
            stale_after=10 * WEEK, forget_after=10 * WEEK, capacity=MAX_TRACKED + MAX_DESIRED,
            clock=lambda: self.mono, wall_clock=lambda: self.wall,
        )  # fmt: skip
        self.recorder = UptimeRecorder(
            store=ConfigMapStore(self.kube, "workload-manager-uptime"), where="ConfigMap test",
            errors=(RuntimeError,), max_step=max_step, wall=lambda: self.wall,
        )  # fmt: skip
        self.save_every = save_every
        self.saves: list[Outcome] = []  # what each scheduled save returned
        self._since_save = 0.0

    def look(self) -> None:
        self.recorder.observe(self.book.statuses())

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
            self.look()
            self._since_save += moved
            if self._since_save >= self.save_every:
                self._since_save = 0.0
                self.saves.append(await self.recorder.save())


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
    world.look()
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


async def test_a_save_writes_only_with_news() -> None:
    world = World()
    assert (await world.recorder.open()).detail == {
        "uptime_record": "read", "kept_in": "ConfigMap test"
    }  # fmt: skip
    await world.advance(HOUR)  # nobody pinged: nothing to say, nothing written
    assert world.kube.writes == []
    assert len(world.saves) == 12 and all(o.result is Result.OK for o in world.saves)
    world.ping(["api"], PingStatus.HEALTHY)
    for _ in range(int(HOUR // 10)):
        world.ping(["api"], PingStatus.HEALTHY)
        await world.advance(10.0)
    assert len(world.kube.writes) == 12  # each save of the hour had news
    assert (await world.recorder.save()).result is Result.OK  # nothing new since then
    assert len(world.kube.writes) == 12


async def test_a_stop_saves_what_was_counted_since_the_last_write() -> None:
    world = World()
    await world.recorder.open()
    world.look()  # the first look: counting starts here
    world.ping(["api"], PingStatus.HEALTHY)
    await world.advance(290.0)
    assert world.kube.writes == []  # the five minutes are not over
    await world.recorder.save()  # as stop_runtime does
    again = World(kube=world.kube)
    again.wall = world.wall
    await again.recorder.open()
    assert again.recorder.record.hours == {"api": {int(START // HOUR): [290.0, 290.0]}}


async def test_a_failing_write_is_an_outage_kept_in_memory_and_tried_again() -> None:
    world = World()
    await world.recorder.open()
    world.kube.fail = RuntimeError("etcdserver: leader changed")  # the store's outage
    for _ in range(3):
        world.ping(["api"], PingStatus.HEALTHY)
        await world.advance(SAVE_EVERY_SECONDS)
    assert [o.result for o in world.saves] == [Result.UNAVAILABLE] * 3
    assert world.saves[-1].error == "etcdserver: leader changed"
    assert world.saves[-1].detail["uptime_record"].startswith("not saved (kept in memory)")
    world.kube.fail = None
    world.ping(["api"], PingStatus.HEALTHY)
    await world.advance(SAVE_EVERY_SECONDS)
    assert world.saves[-1].detail["uptime_record"] == "saved"
    assert world.saves[-1].result is Result.OK
    again = World(kube=world.kube)  # nothing counted during the outage was lost
    again.wall = world.wall
    await again.recorder.open()
    assert again.recorder.record.hours == world.recorder.record.hours != {}


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
        opened = await world.recorder.open()
    assert opened.result is Result.FAILED
    assert "not an uptime record" in opened.detail["uptime_record"]
    assert any("starting empty" in r.getMessage() for r in caplog.records)
    assert world.recorder.record.hours == {}


async def test_a_gap_or_a_clock_set_back_counts_nothing_and_counting_goes_on() -> None:
    world = World()
    await world.recorder.open()
    world.look()
    world.ping(["api"], PingStatus.HEALTHY)
    await world.advance(60.0)
    world.wall -= 600.0  # someone set the clock back ten minutes: this step counts nothing
    world.look()
    world.wall += 3 * 30.0  # a look missed for longer than max_step: nor does this one
    world.look()
    world.ping(["api"], PingStatus.HEALTHY)
    await world.advance(20.0)  # and then counting goes on
    assert sum(sum(h) for h in world.recorder.record.hours["api"].values()) == 2 * 80.0


async def test_a_record_the_api_server_would_refuse_is_not_sent() -> None:
    """Settings raised far beyond the defaults can outgrow a ConfigMap: the store says so
    instead of sending what the API server would refuse."""
    world = World()
    await world.recorder.open()
    many = dict.fromkeys((name_of(i) for i in range(2_000)), "healthy")
    world.recorder.record.observe(many, start=world.wall - WEEK, end=world.wall)
    refused = await world.recorder.save()
    assert world.kube.writes == []
    assert refused.result is Result.FAILED
    assert "more than a ConfigMap holds" in refused.detail["uptime_record"]
