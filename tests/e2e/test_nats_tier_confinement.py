"""A tier's NATS credentials reach that tier's work and nothing else, against a real
nats-server with the shipped per-tier permissions (tests/support/nats_auth.py, which
k8s/nats/auth.conf.example must equal): as tier C, every way of reading tier A's jobs,
its results (the events stream) or its ledger, of changing another tier's consumer or
ledger keys, and of reading through another stream is a permissions violation; a rollup
header on its own ledger key is refused by its bucket and wipes nothing; the manager of
tier C still does all it needs with the same credentials."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import api

from app.adapters.bus import BucketMissing, JetStreamBus, NatsAuth, inbox_prefix
from app.adapters.embedded import EmbeddedNats
from app.adapters.kv_ledger import JetStreamLedger, bucket, key_name
from app.domain.ledger import Claim, job_fingerprint
from app.domain.nats_servers import NatsServers
from app.services.streams import consumer_specs, init_streams
from app.settings import Settings
from tests.support import nats_auth
from tests.support.nats_auth import NkeyUser, operator_url, start_server
from tests.support.polling import eventually

NODE_C = "node-c"
KEY = "a2V5"  # a ledger key (base64url of "key")


pytestmark = pytest.mark.e2e

users = nats_auth.users
secured = nats_auth.secured
topology = nats_auth.topology


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


TIER_A, TIER_C = bucket("A"), bucket("C")
TIER_A_KEY = f"$KV.{TIER_A}.{KEY}"
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
        f"$JS.API.CONSUMER.CREATE.KV_{TIER_C}.wm-C.$KV.{TIER_C}.>"
    ),
    "an unnamed consumer": publishing("$JS.API.CONSUMER.CREATE.MM_WRITE"),
    "a job stream's messages": publishing("$JS.API.STREAM.MSG.GET.MM_WRITE"),
    "the events stream's messages": publishing("$JS.API.DIRECT.GET.MM_EVENTS"),
    "a ledger record by a body that names the key": publishing(
        f"$JS.API.STREAM.MSG.GET.KV_{TIER_C}"
    ),
    "reading tier A's ledger key": publishing(f"$JS.API.DIRECT.GET.KV_{TIER_A}.$KV.{TIER_A}.{KEY}"),
    "writing tier A's ledger key": publishing(TIER_A_KEY),
    "deleting tier A's ledger key": publishing(TIER_A_KEY, {"KV-Operation": "DEL"}),
    "purging tier A's ledger key": publishing(
        TIER_A_KEY, {"KV-Operation": "PURGE", "Nats-Rollup": "sub"}
    ),
    "a ledger key outside every tier's bucket": publishing(f"$KV.JOB_LEDGER.{KEY}"),
    "a job stream's state": publishing("$JS.API.STREAM.INFO.MM_WRITE"),
    "tier A's bucket's state and key listing": publishing(f"$JS.API.STREAM.INFO.KV_{TIER_A}"),
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
        kv = await operator.jetstream().key_value(TIER_A)
        revision = await kv.put(KEY, b"tier A's")
        async with as_tier_c(secured, users) as (nc, errors):
            await nc.publish(TIER_A_KEY, b"forged", reply=nc.new_inbox())
            await nc.publish(TIER_A_KEY, b"", headers={"KV-Operation": "DEL"})
            await eventually(functools.partial(_count, errors, TIER_A_KEY, 2), within=10)
        entry = await kv.get(KEY)
        assert (entry.value, entry.revision) == (b"tier A's", revision)
    finally:
        await operator.close()


@pytest.mark.parametrize("rollup", ["all", "sub"])
async def test_a_rollup_on_tier_cs_own_key_is_refused_and_wipes_nothing(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None, rollup: str
) -> None:
    """`Nats-Rollup` on a key tier C may write would purge the whole stream (`all`) or the
    key's subject (`sub`); no permission can see a header, so the buckets allow no
    rollups: the server refuses it, and tier A's record and tier C's own stay."""
    operator = await nats.connect(operator_url(secured))
    try:
        js = operator.jetstream(timeout=5)
        tier_a, tier_c = await js.key_value(TIER_A), await js.key_value(TIER_C)
        a_name, c_name = key_name(f"A's {rollup}"), key_name(f"C's {rollup}")
        a_revision = await tier_a.put(a_name, b"tier A's")
        c_revision = await tier_c.put(c_name, b"tier C's")
        async with as_tier_c(secured, users) as (nc, errors):
            answer = await nc.request(
                f"$KV.{TIER_C}.{c_name}", b"rolled up", timeout=5,
                headers={"Nats-Rollup": rollup},
            )  # fmt: skip
            assert errors == []
        entry = await tier_a.get(a_name)
        assert (entry.value, entry.revision) == (b"tier A's", a_revision)
        entry = await tier_c.get(c_name)
        assert (entry.value, entry.revision) == (b"tier C's", c_revision)
        assert "rollup" in json.loads(answer.data)["error"]["description"].lower(), answer.data
    finally:
        await operator.close()


async def test_tier_c_cannot_list_tier_as_ledger_keys(
    secured: EmbeddedNats, users: dict[str, NkeyUser], topology: None
) -> None:
    """Stream info with `subjects_filter` lists a stream's subjects, so a key listing of
    the bucket tier C may ask about names only tier C's records; tier A's is refused."""
    operator = await nats.connect(operator_url(secured))
    try:
        js = operator.jetstream(timeout=5)
        a_name, c_name = key_name("A's listed"), key_name("C's listed")
        await (await js.key_value(TIER_A)).put(a_name, b"tier A's")
        await (await js.key_value(TIER_C)).put(c_name, b"tier C's")
        listing = json.dumps({"subjects_filter": ">"}).encode()
        async with as_tier_c(secured, users) as (nc, errors):
            own = f"$JS.API.STREAM.INFO.KV_{TIER_C}"
            answer = json.loads((await nc.request(own, listing, timeout=5)).data)
            listed = answer["state"].get("subjects") or {}
            assert f"$KV.{TIER_C}.{c_name}" in listed, answer
            assert not [subject for subject in listed if a_name in subject], listed
            theirs = f"$JS.API.STREAM.INFO.KV_{TIER_A}"
            await nc.publish(theirs, listing, reply=nc.new_inbox())
            await eventually(functools.partial(_count, errors, theirs, 1), within=10)
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
        NatsServers.parse(secured.url), name=f"workload-manager/{NODE_C}", timeout=5,
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
            await bus.key_value(TIER_C), tier="C", node_id=NODE_C, claimant="me", timeout=5
        )
        job = "00000000-0000-4000-8000-000000000001"
        key = "confined/key with spaces"
        noop = job_fingerprint("noop", {})
        claimed, _number = await ledger.claim(
            key=key, job_id=job, job_type="noop", fingerprint=noop, lease_seconds=30
        )
        assert claimed is Claim.CLAIMED
        assert await ledger.renew(key=key, lease_seconds=30)
        assert await ledger.complete(key=key, result={"ok": True})
        again, _left = await ledger.claim(
            key=key, job_id=job, job_type="noop", fingerprint=noop, lease_seconds=30
        )
        assert again is Claim.COMPLETED
        assert bus.refusal is None
    finally:
        await bus.drain()


async def test_init_streams_makes_a_hand_made_bucket_safe_for_its_tier(
    users: dict[str, NkeyUser], tmp_path: Path
) -> None:
    """A bucket made by hand (`nats kv add`, nats-py's defaults) reads a key by
    `STREAM.MSG.GET`, which names it in the body and so is refused to a tier, and allows
    rollups: the manager says which command fixes it, and `init-streams --tier C` switches
    direct gets on and rollups off (updated, once) and makes no other tier's bucket."""
    server = start_server(tmp_path / "nats", users)
    try:
        operator = JetStreamBus(NatsServers.parse(operator_url(server)), name="operator", timeout=5)
        await operator.connect()
        by_hand = await nats.connect(operator_url(server))
        try:
            js = by_hand.jetstream(timeout=5)
            await js.create_key_value(api.KeyValueConfig(bucket=TIER_C, history=1))
            bus = JetStreamBus(
                NatsServers.parse(server.url), name=f"workload-manager/{NODE_C}", timeout=5,
                auth=NatsAuth(nkey_seed_file=users["C"].seed_file),
                inbox_prefix=inbox_prefix("C", NODE_C),
            )  # fmt: skip
            await bus.connect()
            try:
                with pytest.raises(BucketMissing, match=r"direct gets.*init-streams"):
                    await bus.key_value(TIER_C)
                made = dict(await init_streams(operator, Settings(_env_file=None), tiers=("C",)))
                assert [what for what in made if what.startswith("bucket ")] == [f"bucket {TIER_C}"]
                assert made[f"bucket {TIER_C}"] == "updated"
                config = (await js.stream_info(f"KV_{TIER_C}")).config
                assert (config.allow_direct, config.allow_rollup_hdrs) == (True, False)
                ledger = JetStreamLedger(
                    await bus.key_value(TIER_C), tier="C", node_id=NODE_C, claimant="me",
                    timeout=5,
                )  # fmt: skip
                claimed, _number = await ledger.claim(
                    key="k", job_id="00000000-0000-4000-8000-000000000002", job_type="noop",
                    fingerprint=job_fingerprint("noop", {}), lease_seconds=30,
                )  # fmt: skip
                assert claimed is Claim.CLAIMED and bus.refusal is None
            finally:
                await bus.drain()
            again = dict(await init_streams(operator, Settings(_env_file=None), tiers=("C",)))
            assert again[f"bucket {TIER_C}"] == "unchanged"
            with pytest.raises(nats.js.errors.BucketNotFoundError):
                await js.key_value(TIER_A)
        finally:
            await by_hand.close()
            await operator.drain()
    finally:
        server.stop()
