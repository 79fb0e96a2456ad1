"""Uptime management and crash loops on the real control plane. A managed workload that
stays unhealthy gets a rollout restart (the pod-template annotation that `kubectl rollout
restart` sets, so the real deployment controller rolls it), backs off, stops at its
budget with an alert, and the next sync sees no drift. A workload that never pinged is
not restarted. A pod in a crash loop makes its workload `crashlooping`."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

from prometheus_client import generate_latest

from app.adapters.kube import RESTARTED_AT, KubeError
from app.domain.components import Result
from app.domain.health import Ping, PingStatus
from app.domain.reports import UpdateView
from app.domain.uptime import RestartPolicy, UptimeRecord
from app.services.healthwatch import HealthWatch
from app.services.uptime import UPTIME_KEY, ConfigMapStore, UptimeKeeper, UptimeRecorder
from standins.sync_world import manifest
from tests.services.conftest import World
from tests.support.polling import eventually

WALL = 1_000 * 3600.0  # wall seconds at the test's time 0

POLICY = RestartPolicy(
    after_seconds=180, backoff_seconds=300, backoff_max_seconds=3600,
    per_workload_per_hour=2, per_node_per_hour=10,
)  # fmt: skip


def restarted_at(world: World, name: str) -> str | None:
    found = world.cluster.get_deployment("workloads", name) or {}
    template = found.get("spec", {}).get("template", {})
    annotations: dict[str, str] = template.get("metadata", {}).get("annotations") or {}
    return annotations.get(RESTARTED_AT)


async def test_an_unhealthy_workload_is_restarted_backs_off_and_stops_at_its_budget(
    world: World,
) -> None:
    world.desire(("api", "1.0.0"), ("quiet", "1.0.0"))
    await world.syncer.sync()
    await world.settled("api")  # rolled out: its status is the workload's own word now
    await world.syncer.sync()
    world.runtime.book.record("api", Ping(status=PingStatus.UNHEALTHY, message="db down"))
    now = [0.0]
    shown_last: dict[str, dict[str, object]] = {}
    record = UptimeRecord()  # where the restarts are kept across restarts of the manager

    def keeper_on(record: UptimeRecord, since_boot: float) -> UptimeKeeper:
        return UptimeKeeper(
            book=world.runtime.book, kube=world.syncer.kube, errors=(KubeError,),
            cluster_lock=asyncio.Lock(), alerts=world.runtime.alerts,
            metrics=world.runtime.metrics, policy=POLICY, record=record,
            clock=lambda: now[0] - since_boot, wall=lambda: WALL + now[0],
        )  # fmt: skip

    keepers = [keeper_on(record, 0.0)]
    world.forget_requests()

    async def at(seconds: float) -> dict[str, object]:
        now[0] = seconds
        world.runtime.book.record("api", Ping(status=PingStatus.UNHEALTHY, message="db down"))
        outcome = await keepers[-1].check()
        shown_last.clear()
        shown_last.update(outcome.detail["workloads"])
        shown: dict[str, object] = shown_last.get("api") or {}
        return shown

    shown = await at(0.0)
    assert "restarted after 180 s" in str(shown["reason"])
    assert world.kube_writes() == [] and restarted_at(world, "api") is None
    generation = (world.cluster.get_deployment("workloads", "api") or {})["metadata"]["generation"]

    shown = await at(200.0)
    assert str(shown["reason"]).startswith("restarted: unhealthy for 200 s")
    stamp = restarted_at(world, "api")
    assert stamp is not None and datetime.fromisoformat(stamp)
    assert world.kube_writes() == ["PATCH /apis/apps/v1/namespaces/workloads/deployments/api"]
    live = world.cluster.get_deployment("workloads", "api") or {}
    assert live["metadata"]["generation"] == generation + 1, "a new rollout"
    assert any(a.key == "workload:api:restarted" for a in world.runtime.alerts.recent)

    # the restart is no drift: the next sync changes nothing and keeps the annotation
    await world.settled("api")
    outcome = await world.syncer.sync()
    assert {(r.name, r.outcome) for r in outcome.results} == {
        ("api", "unchanged"), ("quiet", "unchanged"),
    }  # fmt: skip
    assert restarted_at(world, "api") == stamp

    shown = await at(300.0)  # bad again, counted from the restart
    assert "unhealthy for 100 s; restarted after 180 s" in str(shown["reason"])
    shown = await at(450.0)  # bad long enough, but the backoff is 300 s after a restart
    assert "next restart in 50 s (backoff)" in str(shown["reason"])
    assert restarted_at(world, "api") == stamp
    await at(700.0)  # bad for 500 s since the restart, 500 s after it: the second
    assert restarted_at(world, "api") != stamp
    shown = await at(2000.0)  # the budget (2 an hour) is spent: alerted, not restarted
    assert "restart budget spent" in str(shown["reason"])
    assert shown["restarts_last_hour"] == 2
    assert any(a.key == "workload:api:restart-budget" for a in world.runtime.alerts.recent)
    # `quiet` never pinged: unknown, not stale, never restarted for silence
    assert restarted_at(world, "quiet") is None
    assert "quiet" not in shown_last

    # the manager starts again (a new monotonic clock): the restarts of the last hour come
    # back with the saved record and still count against the budget
    stamp = restarted_at(world, "api")
    saved = UptimeRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert [len(ts) for ts in saved.restarts.values()] == [2]
    keepers.append(keeper_on(saved, 1_500.0))
    await at(2_100.0)
    shown = await at(2_300.0)  # bad for 200 s in this process: the budget decides
    assert "restart budget spent" in str(shown["reason"])
    assert shown["restarts_last_hour"] == 2
    assert restarted_at(world, "api") == stamp


async def test_a_pod_in_a_crash_loop_makes_its_workload_crashlooping(world: World) -> None:
    """Read with the manager's own token (RBAC: list pods, nothing more), from the pod
    status a kubelet would write; alerted once, and not restarted for it."""
    crashy = manifest("crashy", "1", image="registry.example/crashy:never-ready")
    world.desire(("crashy", "1"), crashy=crashy)
    await world.syncer.sync()

    async def scheduled() -> bool:
        return bool(world.cluster.pods("workloads", "app=crashy"))

    await eventually(scheduled, within=30.0, step=0.1)
    (pod,) = world.cluster.pods("workloads", "app=crashy")
    world.cluster.set_pod_status("workloads", pod["metadata"]["name"], {
        "phase": "Running",
        "containerStatuses": [{
            "name": "crashy", "image": "registry.example/crashy:never-ready", "imageID": "",
            "ready": False, "restartCount": 4, "started": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s"}},
        }],
    })  # fmt: skip
    await world.syncer.refresh_view()
    view = world.runtime.book.view("crashy")
    assert view is not None and view.status == "crashlooping", view
    assert view.message is not None and "CrashLoopBackOff after 4 restarts" in view.message
    assert world.runtime.book.counts() == {"crashlooping": 1}
    watch = HealthWatch(book=world.runtime.book, alerts=world.runtime.alerts)
    await watch.check()
    assert [a.key for a in world.runtime.alerts.recent if "crashy" in a.key] == [
        "workload:crashy:crashlooping"
    ]


async def test_uptime_is_counted_from_the_book_and_kept_across_a_restart(world: World) -> None:
    """Kept in the ConfigMap of the manager's own namespace, written with the manager's
    own token (RBAC: get and patch on that one ConfigMap); a manager that starts again
    reads it back; a garbled record starts empty and says so."""
    # the sync's own client, in the manager's namespace, as the runtime wires it
    own = world.syncer.kube.in_namespace("workload-manager")
    store = ConfigMapStore(own, "workload-manager-uptime")
    await own.write_config_map("workload-manager-uptime", {UPTIME_KEY: "{}"})
    wall = [1_000 * 3600.0]
    book = world.runtime.book

    def recorder() -> UptimeRecorder:
        made = UptimeRecorder(
            store=store, where="ConfigMap", errors=(KubeError,), max_step=30.0,
            wall=lambda: wall[0],
        )  # fmt: skip
        book.set_uptime(made.shares)
        return made

    first = recorder()
    opened = await first.open()
    assert opened.result is Result.FAILED
    assert opened.detail["uptime_record"].startswith("not read, started empty")
    first.observe(book.statuses())  # the first look: counting starts here
    for status, seconds in ((PingStatus.HEALTHY, 300), (PingStatus.UNHEALTHY, 100)):
        for _ in range(seconds // 10):  # each look counts the 10 s before it
            wall[0] += 10.0
            book.record("api", Ping(status=status))
            first.observe(book.statuses())
    assert (await first.save()).detail["uptime_record"] == "saved"
    view = book.view("api")
    assert view is not None and view.uptime_24h == view.uptime_7d == 0.75
    exported = generate_latest(world.runtime.metrics.registry).decode()
    assert 'workload_manager_workload_uptime_ratio{window="7d",workload="api"} 0.75' in (exported)

    again = recorder()  # the manager started again
    assert (await again.open()).result is Result.OK
    assert again.shares("api") == (0.75, 0.75)


async def test_a_restart_due_while_a_sync_holds_the_cluster_waits_for_it_not_a_tick(
    world: World,
) -> None:
    """The sync, the self-update and uptime management run at the same cadence on a node
    (every 3 s in tests/node): a check that skipped whenever the lock was held could skip
    every time. The check looks at the book regardless, and a restart it decides waits
    for the cluster, then is made."""
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    await world.settled("api")
    await world.syncer.sync()
    now = [0.0]
    lock = asyncio.Lock()
    keeper = UptimeKeeper(
        book=world.runtime.book, kube=world.syncer.kube, errors=(KubeError,),
        cluster_lock=lock, alerts=world.runtime.alerts, metrics=world.runtime.metrics,
        policy=POLICY, record=None, clock=lambda: now[0], wall=lambda: WALL + now[0],
    )  # fmt: skip
    world.runtime.book.record("api", Ping(status=PingStatus.UNHEALTHY, message="db down"))
    async with lock:  # a sync at each tick
        await keeper.check()
    now[0] = 200.0
    world.runtime.book.record("api", Ping(status=PingStatus.UNHEALTHY, message="db down"))
    async with lock:
        check = asyncio.create_task(keeper.check())
        await eventually(lambda: _waits_for(lock))
        assert restarted_at(world, "api") is None  # not while the sync holds the cluster
    outcome = await asyncio.wait_for(check, timeout=30)
    assert restarted_at(world, "api") is not None
    assert str(outcome.detail["workloads"]["api"]["reason"]).startswith(
        "restarted: unhealthy for 200 s"
    )


async def _waits_for(lock: asyncio.Lock) -> bool:
    return bool(getattr(lock, "_waiters", None))


async def test_a_workload_whose_update_is_judged_is_not_restarted(world: World) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    await world.settled("api")
    await world.syncer.sync()  # the book sees it rolled out: its status is its pings' now
    book = world.runtime.book
    since = datetime(2026, 1, 1, tzinfo=UTC)
    book.set_updates({"api": UpdateView("1.1.0", "judging", since, "judging", 3.0, in_flight=True)})
    now = [0.0]
    keeper = UptimeKeeper(
        book=book, kube=world.syncer.kube, errors=(KubeError,), cluster_lock=asyncio.Lock(),
        alerts=world.runtime.alerts, metrics=world.runtime.metrics, policy=POLICY,
        clock=lambda: now[0], wall=lambda: WALL + now[0],
    )  # fmt: skip
    for now[0] in (0.0, 200.0, 400.0):
        book.record("api", Ping(status=PingStatus.UNHEALTHY, message="new version failing"))
        shown = (await keeper.check()).detail["workloads"]["api"]
        assert shown["reason"] == "an update is being judged: not restarted meanwhile"
    assert restarted_at(world, "api") is None
    # judged (here: reverted): the rule applies again, counted from then
    book.set_updates({"api": UpdateView("1.1.0", "rolled-back", since, "failed", 3.0)})
    book.record("api", Ping(status=PingStatus.UNHEALTHY))
    shown = (await keeper.check()).detail["workloads"]["api"]
    assert "restarted after 180 s" in str(shown["reason"])
