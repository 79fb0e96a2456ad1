"""With only tier C's credentials, no reply subject commands another tier or JetStream.

NATS checks the subject a client publishes to, never the reply subject it names, and
JetStream answers whatever reply a request carries, inside the account where it runs. In
one shared account that let a tier store bytes in its own bucket and have the server
publish them anywhere: a direct get of its own key answered onto `mm.write.A.noop` ran a
job on tier A's nodes, answered onto tier A's ledger key forged its record, answered onto
`$JS.API.*` created, deleted and purged streams; a pull on its own consumer did the same
with its jobs. The shipped accounts (k8s/nats/auth.conf.example) put the streams in an
account of their own that exports services; across an import the server rewrites every
reply, so an answer lands back in tier C's own account, where nothing listens.

Each test performs one attack on a real nats-server with the accounts file the tests run
(`NATS_AUTH_FILE` names a candidate; the shipped example otherwise), then checks, as the
operator, that it had no effect; the last ones show the legitimate paths still work with
each tier's own credentials. Pointed at the former single-account file, the attacks take
effect and these tests fail.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from app.adapters.bus import JetStreamBus, NatsAuth, inbox_prefix
from app.adapters.embedded import EmbeddedNats
from app.adapters.kv_ledger import bucket, key_name
from app.domain.jobs import EVENTS_STREAM, STREAMS, consumer_name
from app.domain.nats_servers import NatsServers
from app.services.streams import consumer_specs
from app.settings import Settings
from tests.support.nats_auth import (
    PRODUCERS,
    new_nkey_user,
    operator_url,
    operators_step,
    start_server,
)
from tests.support.nats_jwt import Fleet
from tests.support.polling import eventually

pytestmark = pytest.mark.e2e

NODE_C = "node-c"
LEDGER_A, LEDGER_B, LEDGER_C = bucket("A"), bucket("B"), bucket("C")
JOBS = STREAMS["write"]
TIERS = ("A", "B", "C")


@dataclass(frozen=True)
class Deployment:
    """A running nats-server with the fleet's accounts, and each party's credentials."""

    url: str
    operator: NatsAuth
    producer: NatsAuth
    tier: Callable[[str, str], NatsAuth]  # (tier, node) -> that node's credentials
    operator_url: str = ""

    def connect(self, auth: NatsAuth, prefix: str | None = None) -> Awaitable[Client]:
        options: dict[str, Any] = {} if prefix is None else {"inbox_prefix": prefix}
        return nats.connect(self.url, allow_reconnect=False, **auth.options(), **options)


def accounts_file(directory: Path) -> tuple[EmbeddedNats, Deployment]:
    """The accounts file (the shipped example, or `NATS_AUTH_FILE`), tier nkeys filled in."""
    users = {name: new_nkey_user(directory, name) for name in (*TIERS, PRODUCERS)}
    server = start_server(directory / "nats", users)
    return server, Deployment(
        server.url, NatsAuth(), NatsAuth(nkey_seed_file=users[PRODUCERS].seed_file),
        lambda tier, _node: NatsAuth(nkey_seed_file=users[tier].seed_file),
        operator_url=operator_url(server),
    )  # fmt: skip


def operator_mode(directory: Path) -> tuple[EmbeddedNats, Deployment]:
    """The same accounts as JWTs (k8s/nats/README.md, "Per-node identities"): a user per
    node under its tier's signing key; JOBS's own user publishes the jobs."""
    fleet = Fleet(TIERS)
    server = fleet.start_server(directory / "nats")
    admin = NatsAuth(creds_file=fleet.admin_creds(directory))

    def node(tier: str, name: str) -> NatsAuth:
        return NatsAuth(creds_file=fleet.node_creds(directory, name, tier)[0])

    return server, Deployment(server.url, admin, admin, node)


@pytest.fixture(scope="module", params=[accounts_file, operator_mode], ids=lambda f: f.__name__)
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    server, made = request.param(tmp_path_factory.mktemp("reply-attacks"))
    try:
        yield made
    finally:
        server.stop()


@pytest.fixture
async def world(deployment: Deployment) -> Deployment:
    """The deployment, after the operator's step."""
    await operators_step(deployment.operator_url or deployment.url, deployment.operator)
    return deployment


@asynccontextmanager
async def connected(
    world: Deployment, auth: NatsAuth, prefix: str | None = None
) -> AsyncIterator[Client]:
    nc = await world.connect(auth, prefix)
    try:
        yield nc
    finally:
        await nc.close()


@asynccontextmanager
async def as_operator(world: Deployment) -> AsyncIterator[JetStreamContext]:
    if world.operator_url:
        nc = await nats.connect(world.operator_url, allow_reconnect=False)
    else:
        nc = await world.connect(world.operator)
    try:
        yield nc.jetstream(timeout=5)
    finally:
        await nc.close()


def tier_c(world: Deployment) -> AbstractAsyncContextManager[Client]:
    """Tier C's node, with only its own credentials: the attacker."""
    return connected(world, world.tier("C", NODE_C), inbox_prefix("C", NODE_C))


def producer(world: Deployment) -> AbstractAsyncContextManager[Client]:
    return connected(world, world.producer)


async def store(nc: Client, key: str, body: bytes, headers: dict[str, str] | None = None) -> None:
    """Tier C writes `body` under its own ledger key, as it may."""
    answer = await nc.request(f"$KV.{LEDGER_C}.{key}", body, timeout=5, headers=headers)
    assert "error" not in json.loads(answer.data), answer.data


async def answered_onto(nc: Client, key: str, reply: str) -> None:
    """A direct get of tier C's own key with `reply` as the reply subject; then the same get
    answered to tier C's inbox, so the first one has been served when this returns."""
    subject = f"$JS.API.DIRECT.GET.KV_{LEDGER_C}.$KV.{LEDGER_C}.{key}"
    await nc.publish(subject, b"", reply=reply)
    answer = await nc.request(subject, b"", timeout=5)
    assert answer.headers is not None and "Nats-Sequence" in answer.headers, answer


async def pending(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages `stream` holds on `subject`, as the operator reads it."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_a_forged_job_answered_onto_tier_as_subject_is_never_stored(
    world: Deployment,
) -> None:
    job = json.dumps({"type": "noop", "idempotency_key": "forged-by-c"}).encode()
    async with as_operator(world) as js:
        before = await pending(js, JOBS, "mm.write.A.>")
        async with tier_c(world) as nc:
            await store(nc, "forged-job", job)
            await answered_onto(nc, "forged-job", "mm.write.A.noop")
        assert await pending(js, JOBS, "mm.write.A.>") == before
        consumer = await js.consumer_info(JOBS, consumer_name("A"))
        assert consumer.num_pending == 0 and consumer.num_ack_pending == 0


async def test_tier_as_ledger_is_neither_forged_nor_deleted_through_a_reply(
    world: Deployment,
) -> None:
    forged_key, kept_key = key_name("forged by C"), key_name("kept by A")
    completed = json.dumps({"state": "completed", "node": "node-a"}).encode()
    async with as_operator(world) as js:
        ledger_a = await js.key_value(LEDGER_A)
        revision = await ledger_a.put(kept_key, b"tier A's")
        async with tier_c(world) as nc:
            await store(nc, "completed", completed)
            await answered_onto(nc, "completed", f"$KV.{LEDGER_A}.{forged_key}")
            await store(nc, "deleted", b"", headers={"KV-Operation": "DEL"})
            await answered_onto(nc, "deleted", f"$KV.{LEDGER_A}.{kept_key}")
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await ledger_a.get(forged_key)
        entry = await ledger_a.get(kept_key)
        assert (entry.value, entry.revision, entry.operation) == (b"tier A's", revision, None)


async def test_a_stored_request_answered_onto_the_jetstream_api_does_nothing(
    world: Deployment,
) -> None:
    """A stream that sources the jobs and events, a consumer pushing them to tier C, tier B's
    consumer and ledger deleted, the job stream purged: every body stored by tier C, every
    one answered onto the API subject that would act on it."""
    spy = {
        "name": "SPY", "subjects": [], "storage": "memory",
        "sources": [{"name": JOBS}, {"name": EVENTS_STREAM}],
    }  # fmt: skip
    push = {
        "stream_name": JOBS,
        "config": {"durable_name": "spy", "deliver_subject": "_INBOX.wm-C.node-c.spy",
                   "ack_policy": "none", "deliver_policy": "all"},
    }  # fmt: skip
    requests = {
        "spy-stream": (json.dumps(spy).encode(), "$JS.API.STREAM.CREATE.SPY"),
        "spy-consumer": (json.dumps(push).encode(), f"$JS.API.CONSUMER.DURABLE.CREATE.{JOBS}.spy"),
        "delete-b": (b"{}", f"$JS.API.CONSUMER.DELETE.{JOBS}.{consumer_name('B')}"),
        "drop-ledger-b": (b"{}", f"$JS.API.STREAM.DELETE.KV_{LEDGER_B}"),
        "purge": (b"{}", f"$JS.API.STREAM.PURGE.{JOBS}"),
    }
    async with (
        as_operator(world) as js,
        producer(world) as jobs,
    ):
        await jobs.request("mm.write.A.noop", b'{"job": "tier A\'s"}', timeout=5)
        held = await pending(js, JOBS, "mm.write.A.>")
        assert held >= 1
        async with tier_c(world) as nc:
            for key, (body, target) in requests.items():
                await store(nc, key, body)
                await answered_onto(nc, key, target)
        assert "SPY" not in [stream.config.name for stream in await js.streams_info()]
        assert "spy" not in [c.name for c in await js.consumers_info(JOBS)]
        assert (await js.consumer_info(JOBS, consumer_name("B"))).name == consumer_name("B")
        assert (await js.stream_info(f"KV_{LEDGER_B}")).config.name == f"KV_{LEDGER_B}"
        assert await pending(js, JOBS, "mm.write.A.>") == held


async def test_a_pull_answered_onto_the_jetstream_api_does_nothing(
    world: Deployment,
) -> None:
    """Tier C pulls from its own consumer, whose next job's body is a request, with the
    purge subject as the reply. The answer would land in tier C's own account, where nobody
    listens on that subject, so JetStream delivers nothing; the job stays for tier C's next
    fetch and the stream keeps tier A's job."""
    async with (
        as_operator(world) as js,
        producer(world) as jobs,
    ):
        await jobs.request("mm.write.A.noop", b'{"job": "tier A\'s"}', timeout=5)
        await jobs.request("mm.write.C.purge", b"{}", timeout=5)
        held = await pending(js, JOBS, "mm.write.A.>")
        async with tier_c(world) as nc:
            await nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{JOBS}.{consumer_name('C')}",
                json.dumps({"batch": 1, "expires": 2_000_000_000}).encode(),
                reply=f"$JS.API.STREAM.PURGE.{JOBS}",
            )
            own = await nc.jetstream(timeout=5).pull_subscribe_bind(consumer_name("C"), JOBS)
            (job,) = await own.fetch(1, timeout=5)
            assert job.subject == "mm.write.C.purge"
            await job.ack_sync()
        assert await pending(js, JOBS, "mm.write.A.>") == held


@pytest.mark.parametrize("tier", ["A", "B", "C"])
async def test_each_tier_runs_its_own_jobs_with_its_own_credentials(
    world: Deployment, tier: str
) -> None:
    """The legitimate path across the accounts: a producer's job, the tier's consumer
    fetches it, its ledger keeps the claim, its event is stored, the ack removes the job."""
    node = f"node-{tier.lower()}"
    bus = JetStreamBus(
        NatsServers.parse(world.url), name=f"workload-manager/{node}", timeout=5,
        auth=world.tier(tier, node), inbox_prefix=inbox_prefix(tier, node),
    )  # fmt: skip
    await bus.connect()
    try:
        async with producer(world) as jobs:
            await jobs.request(f"mm.write.{tier}.noop", b'{"n": 1}', timeout=5)
        (consumer,) = [c for c in consumer_specs(Settings(_env_file=None), (tier,))
                       if c.stream == JOBS]  # fmt: skip
        await bus.ensure_consumer(consumer)
        subscription = await bus.subscribe(stream=JOBS, durable=consumer.durable)
        (message,) = await subscription.fetch(1, wait=5)
        assert message.subject == f"mm.write.{tier}.noop"
        ledger = await bus.key_value(bucket(tier))
        await ledger.put(key_name(f"{tier}'s job"), b"claimed")
        assert (await ledger.get(key_name(f"{tier}'s job"))).value == b"claimed"
        published = await bus.publish(f"mm.events.{node}.job.completed", b"{}")
        assert published.seq > 0
        await message.ack()
    finally:
        await bus.drain()
    async with as_operator(world) as js:

        async def acked() -> bool:  # a work queue drops a job once it is acked
            try:
                await js.get_msg(JOBS, message.stream_sequence)
            except nats.js.errors.NotFoundError:
                return True
            return False

        await eventually(acked, within=10)
        assert await pending(js, EVENTS_STREAM, f"mm.events.{node}.>") >= 1
