"""Per-node NATS identities in operator mode (tests/support/nats_jwt.py; k8s/nats/README.md
"Per-node identities"): a user JWT named after its node, issued under its tier's scoped
signing key, whose template (`mm.events.{{name()}}.>`, `_INBOX.wm-<tier>.{{name()}}.>`,
the tier's consumers and ledger keys) nats-server expands at connect. Against a real
nats-server: node-c1 cannot publish another node's events or read another node's inbox,
nor anything of tier A (its jobs, its results, its ledger, a consumer on another
stream); a holder of a tier's key cannot issue wider permissions; a revoked
user is refused after a reload; and a real worker process runs a job with its creds file."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from app.adapters.bus import JetStreamBus, NatsAuth, inbox_prefix
from app.adapters.embedded import EmbeddedNats
from app.adapters.kv_ledger import bucket
from app.services.streams import new_job, publish_job
from tests.support.nats_auth import operators_step
from tests.support.nats_jwt import Fleet
from tests.support.polling import eventually
from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    return Fleet(("A", "C"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("creds")


@pytest.fixture(scope="module")
def server(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    started = fleet.start_server(tmp_path_factory.mktemp("operator-mode-nats"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def operator_creds(fleet: Fleet, keys: Path) -> Path:
    return fleet.admin_creds(keys)


@pytest.fixture
async def admin(server: EmbeddedNats, operator_creds: Path) -> Path:
    """The operator's creds, after the operator's step with them (idempotent)."""
    await operators_step(server.url, NatsAuth(creds_file=operator_creds))
    return operator_creds


@asynccontextmanager
async def as_node(
    server: EmbeddedNats, creds: Path, node: str, tier: str
) -> AsyncIterator[tuple[Client, list[str]]]:
    errors: list[str] = []

    async def collect(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await connect(
        server.url, user_credentials=str(creds), error_cb=collect,
        inbox_prefix=inbox_prefix(tier, node),
    )  # fmt: skip
    try:
        yield nc, errors
    finally:
        await nc.close()


async def connect(url: str, **options: Any) -> Client:
    """One attempt; a refused one closes its socket (nats-py leaves it open)."""
    nc = Client()
    try:
        await nc.connect(
            url, allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=5, **options
        )
    except BaseException:
        await nc.close()
        raise
    return nc


def _names(error: str, subject: str) -> bool:
    lowered = error.lower()
    return "permissions violation" in lowered and f'"{subject.lower()}"' in lowered


Attempt = Callable[[Client], Awaitable[object]]


def subscribing(subject: str) -> tuple[str, Attempt]:
    async def attempt(nc: Client) -> None:
        await nc.subscribe(subject)
        await nc.flush()

    return subject, attempt


def publishing(subject: str) -> tuple[str, Attempt]:
    async def attempt(nc: Client) -> None:
        await nc.publish(subject, b"{}", reply=nc.new_inbox())
        await nc.flush()

    return subject, attempt


TIER_A_BUCKET = bucket("A")
TIER_A_KEY = "a2V5"  # base64url of "key"
REFUSED: dict[str, tuple[str, Attempt]] = {
    "events of another node of its tier": publishing("mm.events.node-c2.job.completed"),
    "events of a node of tier A": publishing("mm.events.node-a1.job.completed"),
    "events that name no node": publishing("mm.events.job.completed"),
    "the inbox of another node of its tier": subscribing("_INBOX.wm-C.node-c2.>"),
    "every inbox of its tier": subscribing("_INBOX.wm-C.>"),
    "tier A's inboxes": subscribing("_INBOX.wm-A.>"),
    "the events (results)": subscribing("mm.events.>"),
    "tier A's job subjects": subscribing("mm.write.A.>"),
    "fetching from tier A's consumer": publishing("$JS.API.CONSUMER.MSG.NEXT.MM_WRITE.wm-A"),
    "tier C's consumer filtered on tier A": publishing(
        "$JS.API.CONSUMER.CREATE.MM_WRITE.wm-C.mm.write.A.>"
    ),
    "a consumer on the events stream": publishing(
        "$JS.API.CONSUMER.CREATE.MM_EVENTS.wm-C.mm.events.>"
    ),
    "a consumer on the ledger's stream": publishing(
        f"$JS.API.CONSUMER.CREATE.KV_{TIER_A_BUCKET}.wm-C.$KV.{TIER_A_BUCKET}.>"
    ),
    "writing tier A's ledger key": publishing(f"$KV.{TIER_A_BUCKET}.{TIER_A_KEY}"),
    "reading tier A's ledger key": publishing(
        f"$JS.API.DIRECT.GET.KV_{TIER_A_BUCKET}.$KV.{TIER_A_BUCKET}.{TIER_A_KEY}"
    ),
    "tier A's bucket's state and key listing": publishing(
        f"$JS.API.STREAM.INFO.KV_{TIER_A_BUCKET}"
    ),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
async def test_node_c1_is_refused(
    fleet: Fleet, server: EmbeddedNats, keys: Path, admin: Path, case: tuple[str, Attempt]
) -> None:
    subject, attempt = case
    creds, _user = fleet.node_creds(keys, "node-c1", "C")
    async with as_node(server, creds, "node-c1", "C") as (nc, errors):
        await attempt(nc)

        async def refused() -> bool:
            return any(_names(error, subject) for error in errors)

        await eventually(refused, within=10)


async def test_node_c1_publishes_its_own_events(
    fleet: Fleet, server: EmbeddedNats, keys: Path, admin: Path
) -> None:
    creds, _user = fleet.node_creds(keys, "node-c1", "C")
    async with as_node(server, creds, "node-c1", "C") as (nc, errors):
        ack = await nc.jetstream(timeout=5).publish("mm.events.node-c1.node.online", b"{}")
        assert ack.stream == "MM_EVENTS"
        assert errors == []


async def test_a_tier_key_cannot_issue_wider_permissions(
    fleet: Fleet, server: EmbeddedNats, keys: Path, admin: Path
) -> None:
    """A user JWT from a scoped key that carries permissions of its own is refused at
    connect: the template is all a tier's key can give."""
    creds, _user = fleet.node_creds(
        keys, "node-c9", "C", extra={"pub": {"allow": [">"]}, "sub": {"allow": [">"]}}
    )
    with pytest.raises(nats.errors.Error, match="Authorization"):
        await connect(server.url, user_credentials=str(creds))


async def test_a_revoked_node_is_refused_after_a_reload(
    fleet: Fleet, server: EmbeddedNats, keys: Path, admin: Path
) -> None:
    creds, user = fleet.node_creds(keys, "node-c7", "C")
    async with as_node(server, creds, "node-c7", "C"):
        pass  # accepted before
    fleet.revoked[user] = int(time.time()) + 1  # every JWT of this user issued until now
    try:
        await asyncio.to_thread(fleet.reload, server)

        async def refused() -> bool:
            try:
                async with as_node(server, creds, "node-c7", "C"):
                    return False
            except nats.errors.Error as exc:
                return "authorization" in str(exc).lower()
            except OSError:
                return False  # the server closed the socket first (a reload): ask again

        await eventually(refused, within=15, step=0.2)
    finally:
        fleet.revoked.pop(user)
        await asyncio.to_thread(fleet.reload, server)


async def test_a_worker_with_its_node_creds_runs_its_tiers_jobs(
    fleet: Fleet, server: EmbeddedNats, keys: Path, admin: Path, tmp_path: Path
) -> None:
    creds, _user = fleet.node_creds(keys, "node-c1", "C")
    operator = await nats.connect(server.url, user_credentials=str(admin))
    events: list[tuple[str, dict[str, Any]]] = []

    async def collect(msg: Any) -> None:
        events.append((msg.subject, json.loads(msg.data)))

    await operator.subscribe("mm.events.>", cb=collect)
    (tmp_path / "node").mkdir()
    env = {
        "APP_ENV": "production", "NODE_ID": "node-c1", "TIER": "C",
        "NATS_URL": server.url, "NATS_CREDS_FILE": str(creds),
    }  # fmt: skip
    node = ManagerProcess(env=env, workdir=tmp_path / "node").start()
    try:
        js = operator.jetstream(timeout=5)

        async def bound() -> bool:
            info = await js.consumer_info("MM_WRITE", "wm-C")
            return int(info.num_waiting or 0) >= 1

        await eventually(bound, within=30, step=0.2)
        bus = JetStreamBus(
            server.servers, name="producer", timeout=5, auth=NatsAuth(creds_file=admin)
        )
        await bus.connect()
        try:
            job = new_job("noop", payload={}, idempotency_key="node-identity")
            await publish_job(bus, job, kind="write", tier="C")
        finally:
            await bus.drain()

        async def completed() -> bool:
            return any(
                subject == "mm.events.node-c1.job.completed"
                and body.get("idempotency_key") == "node-identity"
                for subject, body in events
            )

        await eventually(completed, within=30, step=0.1)
        assert "permissions violation" not in node.log().lower(), node.log()
    finally:
        await operator.close()
        assert node.stop() in (0, -signal.SIGTERM), node.log()
