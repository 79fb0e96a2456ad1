"""A tier's NATS credentials reach that tier's work and nothing else, against a real
nats-server with the shipped per-tier permissions (tests/support/nats_auth.py, which
k8s/nats/auth.conf.example must equal): as tier C, every way of reading tier A's jobs,
its results (the events stream) or its ledger, of changing another tier's consumer or
ledger keys, and of reading through another stream is a permissions violation; the
manager of tier C still does all it needs with the same credentials."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js import api

from app.adapters.bus import BucketMissing, JetStreamBus, NatsAuth, inbox_prefix
from app.adapters.embedded import EmbeddedNats
from app.adapters.kv_ledger import BUCKET, JetStreamLedger
from app.domain.ledger import Claim
from app.services.streams import consumer_specs, init_streams
from app.settings import Settings
from tests.support.nats_auth import NkeyUser, new_nkey_user, operator_url, start_server
from tests.support.polling import eventually

NODE_C = "node-c"
KEY = "a2V5"  # a ledger key (base64url of "key")


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NkeyUser]:
    keys = tmp_path_factory.mktemp("nkeys")
    return {tier: new_nkey_user(keys, f"tier-{tier}") for tier in ("A", "C")}


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, users: dict[str, NkeyUser]
) -> Iterator[EmbeddedNats]:
    server = start_server(tmp_path_factory.mktemp("confined-nats"), users)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def topology(secured: EmbeddedNats) -> None:
    """The operator's step: streams, consumers and the ledger bucket (idempotent)."""
    bus = JetStreamBus(operator_url(secured), name="operator", timeout=5)
    await bus.connect()
    try:
        await init_streams(bus, Settings(_env_file=None))
    finally:
        await bus.drain()


@asynccontextmanager
async def as_tier_c(
    secured: EmbeddedNats, users: dict[str, NkeyUser]
) -> AsyncIterator[tuple[Client, list[str]]]:
    """A plain client with tier C's nkey and the inbox prefix tier C may use, and the
    errors the server sent it."""
    errors: list[str] = []

    async def collect(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        secured.url, nkeys_seed=str(users["C"].seed_file), error_cb=collect,
        inbox_prefix=inbox_prefix("C", NODE_C), allow_reconnect=False,
    )  # fmt: skip
    try:
        yield nc, errors
    finally:
        await nc.close()


Attempt = Callable[[Client], Awaitable[object]]


def subscribing(subject: str) -> tuple[str, Attempt]:
    async def attempt(nc: Client) -> None:
        await nc.subscribe(subject)
        await nc.flush()

    return subject, attempt


def publishing(subject: str, headers: dict[str, str] | None = None) -> tuple[str, Attempt]:
    async def attempt(nc: Client) -> None:
        await nc.publish(subject, b"{}", reply=nc.new_inbox(), headers=headers)
        await nc.flush()

    return subject, attempt


TIER_A_KEY = f"$KV.{BUCKET}.A.{KEY}"
REFUSED: dict[str, tuple[str, Attempt]] = {
    "every tier's inbox": subscribing("_INBOX.>"),
    "tier A's inboxes": subscribing("_INBOX.wm-A.>"),
    "tier A's job subjects": subscribing("mm.write.A.>"),
    "the events (results)": subscribing("mm.events.>"),
    "fetching from tier A's consumer": publishing("$JS.API.CONSUMER.MSG.NEXT.MM_WRITE.wm-A"),
    "answering tier A's deliveries": publishing("$JS.ACK.MM_WRITE.wm-A.1.1.1.1.1.0"),
    "reading tier A's consumer": publishing("$JS.API.CONSUMER.INFO.MM_ONLINE.wm-A"),
    "tier C's consumer filtered on tier A": publishing(
        "$JS.API.CONSUMER.CREATE.MM_WRITE.wm-C.mm.write.A.>"
    ),
    "tier C's consumer with the filter in the body only": publishing(
        "$JS.API.CONSUMER.CREATE.MM_WRITE.wm-C"
    ),
    "the legacy durable create (filter in the body)": publishing(
        "$JS.API.CONSUMER.DURABLE.CREATE.MM_WRITE.wm-C"
    ),
    "a consumer of another name": publishing("$JS.API.CONSUMER.CREATE.MM_WRITE.spy.mm.write.C.>"),
    "a consumer on the events stream": publishing(
        "$JS.API.CONSUMER.CREATE.MM_EVENTS.wm-C.mm.events.>"
    ),
    "a consumer on the ledger's stream": publishing(
        f"$JS.API.CONSUMER.CREATE.KV_{BUCKET}.wm-C.$KV.{BUCKET}.>"
    ),
    "an unnamed consumer": publishing("$JS.API.CONSUMER.CREATE.MM_WRITE"),
    "a job stream's messages": publishing("$JS.API.STREAM.MSG.GET.MM_WRITE"),
    "the events stream's messages": publishing("$JS.API.DIRECT.GET.MM_EVENTS"),
    "a ledger record by a body that names the key": publishing(
        f"$JS.API.STREAM.MSG.GET.KV_{BUCKET}"
    ),
    "reading tier A's ledger key": publishing(
        f"$JS.API.DIRECT.GET.KV_{BUCKET}.$KV.{BUCKET}.A.{KEY}"
    ),
    "writing tier A's ledger key": publishing(TIER_A_KEY),
    "deleting tier A's ledger key": publishing(TIER_A_KEY, {"KV-Operation": "DEL"}),
    "purging tier A's ledger key": publishing(
        TIER_A_KEY, {"KV-Operation": "PURGE", "Nats-Rollup": "sub"}
    ),
    "a ledger key outside every tier": publishing(f"$KV.{BUCKET}.{KEY}"),
    "a job stream's state": publishing("$JS.API.STREAM.INFO.MM_WRITE"),
    "publishing a job to tier A": publishing("mm.write.A.memory.write"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
async def test_tier_c_is_refused(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None, case: tuple[str, Attempt]
) -> None:
    subject, attempt = case
    async with as_tier_c(secured, users) as (nc, errors):
        await attempt(nc)

        async def refused() -> bool:
            return any(_names(error, subject) for error in errors)

        await eventually(refused, within=10)


async def test_tier_c_cannot_refilter_its_consumer_through_the_body(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None
) -> None:
    """The one create subject tier C may use names tier C's filter; a body asking for tier
    A's jobs on it is refused by the server, and wm-C keeps its filter."""
    subject = "$JS.API.CONSUMER.CREATE.MM_WRITE.wm-C.mm.write.C.>"
    body = {
        "stream_name": "MM_WRITE",
        "config": {"name": "wm-C", "durable_name": "wm-C", "filter_subject": "mm.write.A.>",
                   "ack_policy": "explicit"},
    }  # fmt: skip
    async with as_tier_c(secured, users) as (nc, errors):
        answer = json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=5)).data)
        assert "did not match" in answer["error"]["description"], answer
        info = await nc.jetstream(timeout=5).consumer_info("MM_WRITE", "wm-C")
        assert info.config.filter_subject == "mm.write.C.>"
        assert errors == []


async def test_tier_a_ledger_key_is_untouched_by_tier_c(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None
) -> None:
    """The refusal loses nothing and changes nothing: tier A's record is as it was."""
    operator = await nats.connect(operator_url(secured))
    try:
        kv = await operator.jetstream().key_value(BUCKET)
        revision = await kv.put(f"A.{KEY}", b"tier A's")
        async with as_tier_c(secured, users) as (nc, errors):
            await nc.publish(TIER_A_KEY, b"forged", reply=nc.new_inbox())
            await nc.publish(TIER_A_KEY, b"", headers={"KV-Operation": "DEL"})
            await eventually(functools.partial(_count, errors, TIER_A_KEY, 2), within=10)
        entry = await kv.get(f"A.{KEY}")
        assert (entry.value, entry.revision) == (b"tier A's", revision)
    finally:
        await operator.close()


def _names(error: str, subject: str) -> bool:
    """Whether `error` is the server's permissions violation for `subject` (it writes a
    subscription's subject in lower case)."""
    lowered = error.lower()
    return "permissions violation" in lowered and f'"{subject.lower()}"' in lowered


async def _count(errors: list[str], subject: str, times: int) -> bool:
    return sum(_names(error, subject) for error in errors) >= times


async def test_the_manager_of_tier_c_does_its_work_with_tier_c_credentials(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None
) -> None:
    """Its consumers by name and filter, a fetch, its node's events, its tier's ledger
    keys (claim, renew, complete, read back), all without one refusal."""
    bus = JetStreamBus(
        secured.url, name=f"workload-manager/{NODE_C}", timeout=5,
        auth=NatsAuth(nkey_seed_file=users["C"].seed_file), inbox_prefix=inbox_prefix("C", NODE_C),
    )  # fmt: skip
    await bus.connect()
    try:
        for consumer in consumer_specs(Settings(_env_file=None), ("C",)):
            assert await bus.ensure_consumer(consumer) in ("unchanged", "updated")
            assert await bus.consumer_state(consumer.stream, consumer.durable) is not None
            subscription = await bus.subscribe(stream=consumer.stream, durable=consumer.durable)
            assert await subscription.fetch(1, wait=0.2) == []
            await subscription.unsubscribe()
        await bus.publish(f"mm.events.{NODE_C}.node.online", {"hello": True}, msg_id="confined")
        ledger = JetStreamLedger(
            await bus.key_value(BUCKET), tier="C", node_id=NODE_C, claimant="me", timeout=5
        )
        job = "00000000-0000-4000-8000-000000000001"
        key = "confined/key with spaces"
        claimed, _number = await ledger.claim(
            key=key, job_id=job, job_type="noop", lease_seconds=30
        )
        assert claimed is Claim.CLAIMED
        assert await ledger.renew(key=key, lease_seconds=30)
        assert await ledger.complete(key=key, result={"ok": True})
        again, _left = await ledger.claim(key=key, job_id=job, job_type="noop", lease_seconds=30)
        assert again is Claim.COMPLETED
        assert bus.refusal is None
    finally:
        await bus.drain()


async def test_a_bucket_without_direct_gets_is_switched_on_by_init_streams(
    users: dict[str, NkeyUser], tmp_path: Path
) -> None:
    """A bucket made by an older release reads a key by `STREAM.MSG.GET`, which names it
    in the body and so is refused to a tier: the manager says which command fixes it, and
    `init-streams` switches direct gets on (updated, once)."""
    server = start_server(tmp_path / "nats", users)
    try:
        operator = JetStreamBus(operator_url(server), name="operator", timeout=5)
        await operator.connect()
        try:
            old = await nats.connect(operator_url(server))  # as an older release made it
            await old.jetstream().create_key_value(api.KeyValueConfig(bucket=BUCKET, history=1))
            await old.close()
            bus = JetStreamBus(
                server.url, name=f"workload-manager/{NODE_C}", timeout=5,
                auth=NatsAuth(nkey_seed_file=users["C"].seed_file),
                inbox_prefix=inbox_prefix("C", NODE_C),
            )  # fmt: skip
            await bus.connect()
            try:
                with pytest.raises(BucketMissing, match=r"direct gets.*init-streams"):
                    await bus.key_value(BUCKET)
                made = dict(await init_streams(operator, Settings(_env_file=None)))
                assert made[f"bucket {BUCKET}"] == "updated"
                ledger = JetStreamLedger(
                    await bus.key_value(BUCKET), tier="C", node_id=NODE_C, claimant="me",
                    timeout=5,
                )  # fmt: skip
                claimed, _number = await ledger.claim(
                    key="k", job_id="00000000-0000-4000-8000-000000000002", job_type="noop",
                    lease_seconds=30,
                )  # fmt: skip
                assert claimed is Claim.CLAIMED and bus.refusal is None
            finally:
                await bus.drain()
            again = dict(await init_streams(operator, Settings(_env_file=None)))
            assert again[f"bucket {BUCKET}"] == "unchanged"
        finally:
            await operator.drain()
    finally:
        server.stop()
