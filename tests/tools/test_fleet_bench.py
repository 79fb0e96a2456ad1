"""The fleet benchmark's arithmetic (bench/fleet.py), without its servers: the knobs, how
the fleet is split over processes, and what a storm's records add up to."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bench.fleet import Knobs, Progress, _fine, _storm_summary, _window


def test_the_knobs_default_to_a_run_this_machine_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLEET_NODES", "FLEET_PROCESSES", "FLEET_NODES_PER_PROCESS", "FLEET_NICE",
                 "FLEET_SIMULATED_MAX"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    knobs = Knobs.read(quick=False)
    assert knobs.nodes == (150, 1500)
    # the nodes share the cores with the servers as equals: niced, a node waiting for CPU
    # holds a PgBouncer server connection between asyncpg's two exchanges (measured)
    assert knobs.nice == 0
    assert [knobs.processes_for(n) for n in (150, 1500, 5000, 15000)] == [1, 1, 2, 6]


def test_the_environment_sets_the_sizes_and_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_NODES", "150,1500,5000,15000")
    monkeypatch.setenv("FLEET_PROCESSES", "4")
    monkeypatch.setenv("FLEET_NICE", "10")
    knobs = Knobs.read(quick=True)
    assert knobs.nice == 10
    assert knobs.nodes == (150, 1500, 5000, 15000)
    assert knobs.processes_for(15000) == 4
    assert knobs.processes_for(3) == 3  # never more processes than nodes


def _world(*ports: int) -> Any:
    members = [SimpleNamespace(name=f"n{i}", server=SimpleNamespace(port=p))
               for i, p in enumerate(ports)]  # fmt: skip
    return SimpleNamespace(cluster=SimpleNamespace(members=members))


def test_a_storm_counts_the_nodes_back_their_attempts_and_the_busiest_100_ms() -> None:
    killed = 100.0
    rows = [
        {"lost_at": killed, "back_at": killed + 0.05, "back_to": 4223, "waits": [0.04],
         "resubscribed_at": killed + 0.2},
        {"lost_at": killed, "back_at": killed + 0.07, "back_to": 4224, "waits": [0.06],
         "resubscribed_at": killed + 0.3},
        {"lost_at": killed, "back_at": killed + 1.5, "back_to": 4223, "waits": [0.9, 0.5],
         "resubscribed_at": killed + 1.6},
    ]  # fmt: skip
    after = {"gave_up": 0, "connected": 3, "subscribed": 3, "servers": {}, "logs": {}}
    storm = _storm_summary("jitter", None, "n0", 3, killed, killed + 5, rows, after, 1.0,
                           _world(4222, 4223, 4224))  # fmt: skip
    assert storm["all_back_seconds"] == 1.5
    assert storm["all_resubscribed_seconds"] == 1.6
    assert storm["attempts_histogram"] == {"1": 2, "2": 1}
    assert storm["busiest_100ms_share"] == round(2 / 3, 3)
    assert storm["moved_to"] == {"n1": 2, "n2": 1}


def test_a_storm_with_a_node_not_back_is_not_complete() -> None:
    rows = [{"lost_at": 1.0, "back_at": None, "back_to": None, "waits": [1.0, 1.0],
             "resubscribed_at": None}]  # fmt: skip
    after = {"gave_up": 0, "connected": 0, "subscribed": 0, "servers": {}, "logs": {}}
    storm = _storm_summary("fixed", 1.0, "n0", 1, 0.0, 5.0, rows, after, None, _world(1))
    assert storm["all_back_seconds"] is None
    assert storm["all_resubscribed_seconds"] is None


@pytest.mark.parametrize(
    ("simulated_max", "n", "split"),
    [
        ("", 150, (150, 0)),
        ("", 1500, (1500, 0)),
        ("", 15000, (1500, 13500)),  # the default: what this machine's cores hold
        ("5000", 15000, (5000, 10000)),
        ("0", 15000, (15000, 0)),  # 0: every node simulated
    ],
)
def test_nodes_beyond_the_simulated_most_are_stand_ins(
    monkeypatch: pytest.MonkeyPatch, simulated_max: str, n: int, split: tuple[int, int]
) -> None:
    monkeypatch.setenv("FLEET_SIMULATED_MAX", simulated_max)
    assert Knobs.read(quick=False).split(n) == split


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("progress: 5.0 s, 400.2 tps, lat 1.234 ms stddev 0.567, 0 failed, lag 0.123 ms",
         (400.2, 1.234, 0, 0.123)),
        ("progress: 10.0 s, 12.0 tps, lat 3.500 ms stddev 1.000, 2 failed", (12.0, 3.5, 2, None)),
        ("progress: 15.0 s, 0.0 tps, lat NaN ms stddev NaN, 0 failed, lag 0.000 ms",
         (0.0, None, 0, 0.0)),
    ],
)  # fmt: skip
def test_pgbench_progress_lines_are_read(
    line: str, parsed: tuple[float, float | None, int, float | None]
) -> None:
    p = Progress.parse(line, at=1.0)
    assert p is not None
    assert (p.tps, p.latency_ms, p.failed, p.lag_ms) == parsed


@pytest.mark.parametrize(
    "line", ["pgbench (PostgreSQL) 18.6", "transaction type: standins.sql", "progress: soon"]
)
def test_other_pgbench_lines_are_not_progress(line: str) -> None:
    assert Progress.parse(line, at=1.0) is None


def test_a_window_takes_the_progress_lines_read_within_it() -> None:
    lines = [Progress(at=t, tps=tps, latency_ms=lat, failed=f, lag_ms=0.1)
             for t, tps, lat, f in ((5, 100.0, 1.0, 0), (10, 500.0, 2.0, 1),
                                    (15, 300.0, 4.0, 0), (20, 999.0, 9.0, 5))]  # fmt: skip
    window = _window(lines, 5, 15)  # (5, 15]: the second and third
    assert window["lines"] == 2
    assert window["per_second"] == 400.0
    assert window["latency_ms_mean"] == 3.0 and window["latency_ms_worst_5s"] == 4.0
    assert window["failed"] == 1
    assert _window(lines, 20, 30) == {"lines": 0}


@pytest.mark.parametrize(
    ("per_second", "errors", "p99", "fine"),
    [
        (9000.0, 0, 5.0, True),
        (5000.0, 0, 1000.0, True),
        (5000.0, 0, 1000.1, False),  # past the bound
        (5000.0, 3, 5.0, False),  # a heartbeat failed
        (0.0, 0, None, False),  # nothing done in the step: not room, a stall
    ],
)
def test_a_closed_loop_step_counts_as_room_only_within_the_bound(
    per_second: float, errors: int, p99: float | None, fine: bool
) -> None:
    step = {"per_second": per_second, "errors": errors, "latency_ms": {"p99": p99}}
    assert _fine(step) is fine
