"""Publishing a job, as a library call and as `workload-manager publish`, against a real
nats-server: a second message with the same Nats-Msg-Id inside the duplicate window is
dropped by JetStream, and the publisher is told so instead of being shown a new sequence."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from app.adapters.bus import JetStreamBus, Published
from app.adapters.embedded import EmbeddedNats
from app.domain.nats_servers import NatsServers
from app.services.streams import init_streams, new_job, publish_job
from app.settings import Settings
from tests.e2e.test_jobs_flow import cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A server of this module's own: the CLI's `init-streams` sets the streams up as the
    default settings say, which the session's server must not be changed to."""
    server = EmbeddedNats(tmp_path_factory.mktemp("nats-publish") / "data").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def bus(own_nats: EmbeddedNats) -> AsyncIterator[JetStreamBus]:
    bus = JetStreamBus(NatsServers.parse(own_nats.url), name="test-publisher", timeout=5)
    await bus.connect()
    await init_streams(bus, Settings(_env_file=None))
    try:
        yield bus
    finally:
        await bus.drain()


async def test_publish_job_says_whether_jetstream_stored_the_message(bus: JetStreamBus) -> None:
    first = new_job("noop", idempotency_key="library-key")
    stored = await publish_job(bus, first, kind="write", tier="A")
    assert stored == Published(seq=stored.seq, duplicate=False) and stored.seq > 0
    # another job under the same key: the same Nats-Msg-Id, dropped inside the window
    again = await publish_job(bus, new_job("noop", idempotency_key="library-key"), kind="write",
                              tier="A")  # fmt: skip
    assert again == Published(seq=stored.seq, duplicate=True), "the sequence it already had"
    other = await publish_job(bus, new_job("noop", idempotency_key="other-key"), kind="write",
                              tier="A")  # fmt: skip
    assert other == Published(seq=stored.seq + 1, duplicate=False)


def test_the_cli_tells_a_duplicate_from_a_published_job(
    own_nats: EmbeddedNats, tmp_path: Path
) -> None:
    env = {"NATS_URL": own_nats.url}
    assert cli(["init-streams"], env, tmp_path).returncode == 0
    args = ["publish", "--kind", "write", "--tier", "C", "--type", "noop", "--key", "cli-key"]
    sent = cli(args, env, tmp_path)
    assert sent.returncode == 0, sent.stderr
    assert "(key cli-key) as stream sequence" in sent.stdout
    sequence = sent.stdout.split()[-1]
    again = cli(args, env, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "(key cli-key) not published: JetStream already had a message with that " in again.stdout
    assert (
        f"Nats-Msg-Id within its duplicate window (stream sequence {sequence}) and stored "
        "nothing" in again.stdout
    ), again.stdout
    assert "as stream sequence" not in again.stdout
