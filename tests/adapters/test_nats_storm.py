"""No reconnect storms: many of the manager's own NATS connections (`JetStreamBus`), in one
process, against a real nats-server that is killed (SIGKILL) and started again, or that
goes into lame duck mode in a cluster.

Every wait before an attempt is heard through the bus's hook and recorded with the time
the attempt is due; the test shows the attempts and the reconnections spread (no 100 ms
holds more than a small share of them), every client reconnected and none gave up. The
same kill with nats-py's fixed wait (the bus's former `reconnect_time_wait=1`) is measured
beside it: those clients come back in lockstep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest

from app.adapters.bus import JetStreamBus
from app.adapters.embedded import EmbeddedNats
from app.domain.nats_servers import NatsServers
from app.domain.spreading import ReconnectPolicy
from tests.support.nats_cluster import running_cluster

log = logging.getLogger(__name__)

CLIENTS = 100
BIN = 0.1  # seconds: "the same instant" for a server taking connections


@dataclass
class Recorder:
    """Each client's attempts (monotonic time each is due) and reconnections."""

    attempts: dict[int, list[float]] = field(default_factory=dict)
    reconnected: dict[int, float] = field(default_factory=dict)

    def hook(self, client: int) -> Callable[[int, float], None]:
        def heard(_attempt: int, delay: float) -> None:
            self.attempts.setdefault(client, []).append(time.monotonic() + delay)

        return heard


def busiest_share(times: Iterable[float], width: float = BIN) -> float:
    """The largest share of `times` that falls in one bin of `width` seconds (the bins
    aligned on the first time)."""
    values = sorted(times)
    if not values:
        return 0.0
    bins = Counter(int((t - values[0]) / width) for t in values)
    return max(bins.values()) / len(values)


def histogram(times: Iterable[float], start: float, width: float = 0.5) -> str:
    bins = Counter(int((t - start) / width) for t in times)
    return " ".join(f"{k * width:.1f}s:{bins[k]}" for k in range(max(bins) + 1)) if bins else ""


async def poll(check: Callable[[], bool], *, within: float, what: str) -> None:
    ends = time.monotonic() + within
    while not check():
        if time.monotonic() > ends:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    if server.running:
        server.stop(graceful=False)


async def _buses(
    servers: NatsServers, policy: ReconnectPolicy, recorder: Recorder, count: int
) -> list[JetStreamBus]:
    buses = []
    for i in range(count):
        bus = JetStreamBus(
            servers, name=f"storm-{i}", timeout=2.0, reconnect=policy, on_attempt=recorder.hook(i)
        )
        await bus.connect()
        buses.append(bus)
    return buses


def _watch_reconnects(buses: list[JetStreamBus], recorder: Recorder) -> Callable[[], bool]:
    def check() -> bool:
        now = time.monotonic()
        for i, bus in enumerate(buses):
            if bus.connected and bus.reconnects and i not in recorder.reconnected:
                recorder.reconnected[i] = now
        return len(recorder.reconnected) == len(buses)

    return check


async def test_a_killed_server_s_clients_come_back_spread_and_none_gives_up(
    server: EmbeddedNats,
) -> None:
    policy = ReconnectPolicy(base=0.5, cap=4.0, draw=random.Random(38).random)
    recorder = Recorder()
    buses = await _buses(server.servers, policy, recorder, CLIENTS)
    fixed = [
        await nats.connect(
            server.url, name=f"fixed-{i}", max_reconnect_attempts=-1, reconnect_time_wait=1,
            connect_timeout=2, error_cb=_quiet,
        )
        for i in range(CLIENTS)
    ]  # fmt: skip
    try:
        assert all(bus.connected for bus in buses)
        killed = time.monotonic()
        server.stop(graceful=False)
        # down long enough for every client to try several times, the windows growing
        await poll(
            lambda: len(recorder.attempts) == CLIENTS
            and all(len(a) >= 4 for a in recorder.attempts.values()),
            within=30, what="four attempts from every client",
        )  # fmt: skip
        server.start()
        restarted = time.monotonic()
        check = _watch_reconnects(buses, recorder)
        fixed_back: dict[int, float] = {}

        def fixed_check() -> bool:
            now = time.monotonic()
            for i, nc in enumerate(fixed):
                if nc.is_connected and i not in fixed_back:
                    fixed_back[i] = now
            return len(fixed_back) == CLIENTS

        await poll(lambda: check() & fixed_check(), within=30, what="every client back")
        assert not any(bus._nc.is_closed for bus in buses), "a client gave up"
        assert all(bus.connected and bus.reconnects == 1 for bus in buses)

        first = [a[0] for a in recorder.attempts.values()]
        due = [t for a in recorder.attempts.values() for t in a]
        back = list(recorder.reconnected.values())
        log.info(
            "%d clients; first attempts after the kill (0.5 s bins): %s; reconnections "
            "after the restart: %s, busiest 100 ms %.0f%% (attempts overall %.0f%%); "
            "fixed 1 s wait, reconnections: %s, busiest 100 ms %.0f%%",
            CLIENTS, histogram(first, killed), histogram(back, restarted),
            100 * busiest_share(back), 100 * busiest_share(due),
            histogram(fixed_back.values(), restarted), 100 * busiest_share(fixed_back.values()),
        )  # fmt: skip
        # the first attempts spread over the first window (0.5 s), the reconnections over
        # the window reached (up to the cap): no 100 ms holds a crowd
        assert max(first) - min(first) > 0.3
        assert busiest_share(first) < 0.35
        assert busiest_share(back) < 0.2
        assert max(back) - min(back) > 1.0
        # with the fixed wait they come back in lockstep
        assert busiest_share(fixed_back.values()) > 2 * busiest_share(back)
    finally:
        for bus in buses:
            await bus.drain(within=1.0)
        for nc in fixed:
            await nc.close()


async def _quiet(_exc: Exception) -> None:
    return None


async def test_clients_leave_a_lame_duck_server_spread_over_the_lame_duck_wait(
    tmp_path: Path,
) -> None:
    """A server told to go (lame duck mode, SIGUSR2) announces it; every client moves to
    another server of the cluster after its own draw, not all at the announcement, and
    before the server starts closing connections itself (its grace period, 10 s)."""
    spread = 3.0
    with running_cluster(tmp_path / "cluster") as cluster:
        n0 = cluster.member("n0")
        policy = ReconnectPolicy(base=0.5, cap=4.0, lame_duck_spread=spread)
        recorder = Recorder()
        # connected to n0 alone; the others are learnt from its INFO
        count = 40
        buses = await _buses(NatsServers((n0.url,)), policy, recorder, count)
        try:
            await poll(
                lambda: all(len(b._nc.servers) == 3 for b in buses), within=10,
                what="every client knows the cluster",
            )  # fmt: skip
            assert n0.server.pid is not None
            announced = time.monotonic()
            os.kill(n0.server.pid, signal.SIGUSR2)
            check = _watch_reconnects(buses, recorder)
            await poll(check, within=spread + 8, what="every client moved")
            moved = list(recorder.reconnected.values())
            log.info("moves after the announcement: %s", histogram(moved, announced))
            assert all(b.connected and b._left != n0.url.removeprefix("nats://") for b in buses)
            assert max(moved) - announced < spread + 3  # before the server closes them
            assert max(moved) - min(moved) > spread / 3
            assert busiest_share(moved) < 0.3
        finally:
            for bus in buses:
                await bus.drain(within=1.0)
            if n0.server.running:
                n0.server.stop(graceful=False)
