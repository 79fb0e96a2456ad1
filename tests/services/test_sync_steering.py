"""The sync steered by the backend, over real HTTP and on the real control plane: a
Retry-After on the desired state puts the next sync off, one on the version PUTs keeps
the owed reports until it passes, and the desired state's answers (200 and 304) carry
the interval the backend asks for."""

from __future__ import annotations

from datetime import UTC, datetime

from app.adapters.backend import VERSION
from app.domain.components import Cadence
from app.services.syncing import BackendSource, SyncOutcome
from tests.services.conftest import World
from tests.support.polling import eventually


def _of(world: World, route: str) -> list[int]:
    return [r.status for r in world.backend.requests if r.route == route]


async def test_a_retry_after_on_the_desired_state_puts_the_next_sync_off(world: World) -> None:
    world.desire(("api", "1.0.0"))
    world.backend.fail("workloads", "429", times=None, retry_after="30")
    outcome = world.syncer.outcome_of(await world.syncer.sync())
    assert outcome.retry_in is not None and 30.0 <= outcome.retry_in <= 33.0
    assert "Retry-After until " in (outcome.error or "")
    again = world.syncer.outcome_of(await world.syncer.sync())  # an operator's sync, say
    assert "not sent: Retry-After until " in (again.error or "")
    assert again.retry_in is not None and again.retry_in <= outcome.retry_in
    assert _of(world, "workloads") == [429]  # one request: the second was not sent
    assert world.deployments() == {}


async def test_owed_version_reports_wait_for_the_retry_after_of_the_puts(world: World) -> None:
    """The version PUTs are answered 429 with `Retry-After: 2`: both stay owed (the sync's
    detail says until when), a sync meanwhile sends none, and the first sync after the
    time sends both. (The PUTs of one sync go out side by side, SYNC_CONCURRENCY at a
    time: those already sent when the first answer comes are not recalled.)"""
    world.desire(("api", "1.0.0"), ("worker", "2.3.0"))
    world.backend.fail("version", "429", times=None, retry_after="2")
    first = world.syncer.outcome_of(await world.syncer.sync())
    assert first.succeeded, first.error  # the cluster is synced; the PUTs wait
    assert first.detail["versions_not_reported"] == {"api": "1.0.0", "worker": "2.3.0"}
    assert str(first.detail["versions_waiting"]).startswith("Retry-After until ")
    sent = _of(world, "version")
    assert set(sent) == {429} and len(sent) <= 2
    await world.syncer.sync()
    assert _of(world, "version") == sent
    world.backend.clear_failures()
    source = world.syncer.source
    assert isinstance(source, BackendSource)

    async def lifted() -> bool:
        return source.backend.holds.held(VERSION) is None

    await eventually(lifted, within=10.0)
    last = world.syncer.outcome_of(await world.syncer.sync())
    assert last.detail["versions_not_reported"] == {}
    assert "versions_waiting" not in last.detail
    assert _of(world, "version") == [*sent, 204, 204]
    assert sorted(n for n, _ in world.backend.versions) == ["api", "worker"]


async def test_the_desired_state_carries_the_interval_the_backend_asks_for(
    world: World,
) -> None:
    world.desire(("api", "1.0.0"))
    world.backend.steer("workloads", 1200)
    first = world.syncer.outcome_of(await world.syncer.sync())
    assert first.cadence == Cadence(1200.0)
    world.backend.steer("workloads", 90)
    again = world.syncer.outcome_of(await world.syncer.sync())  # a 304
    assert (again.cadence, _of(world, "workloads")) == (Cadence(90.0), [200, 304])
    world.backend.steer("workloads", None)
    assert world.syncer.outcome_of(await world.syncer.sync()).cadence == Cadence(None)
    world.backend.fail("workloads", "500", times=1)
    failed = world.syncer.outcome_of(await world.syncer.sync())
    assert failed.cadence is None  # no answer: nothing said of the interval
    # a look between syncs reads no answer either
    assert (await world.syncer.run_rollout()).cadence is None


async def test_a_sync_that_aborts_after_the_answer_still_takes_its_interval(
    world: World,
) -> None:
    """The desired state was answered (with the interval the backend asks for) and the
    sync then ended early (the Deployments could not be listed, its deadline passed):
    the interval is applied all the same, as for any answer."""
    aborted = SyncOutcome(started_at=datetime.now(UTC), dry_run=False,
                          aborted="cannot list Deployments, nothing changed: HTTP 503",
                          cadence=Cadence(900.0))  # fmt: skip
    outcome = world.syncer.outcome_of(aborted)
    assert not outcome.succeeded
    assert outcome.cadence == Cadence(900.0)


async def test_a_retry_after_on_a_manifest_puts_the_next_sync_off(world: World) -> None:
    """The workload that needs the manifest fails this sync; the sync runs again when the
    time has passed (not after its 10 s backoff), and a sync meanwhile fetches nothing."""
    world.desire(("api", "1.0.0"))
    world.backend.fail("manifest", "429", times=None, retry_after="30")
    outcome = world.syncer.outcome_of(await world.syncer.sync())
    assert not outcome.succeeded and "HTTP 429" in (outcome.error or "")
    assert outcome.retry_in is not None and 30.0 <= outcome.retry_in <= 33.0
    again = world.syncer.outcome_of(await world.syncer.sync())
    assert "not sent: Retry-After until " in (again.error or "")
    assert _of(world, "manifest") == [429]
    assert world.deployments() == {}
