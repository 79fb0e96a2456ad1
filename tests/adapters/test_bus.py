"""The JetStream bus against a real nats-server: NATS_URL with several servers, and the
consumer statistics read through it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.js.client
import pytest

from app.adapters.bus import Delivery, JetStreamBus, server_info
from app.adapters.embedded import EmbeddedNats, free_port
from app.domain.jobs import STREAMS, consumer_name
from app.domain.nats_servers import NatsServers
from app.domain.spreading import ReconnectPolicy
from app.metrics import Metrics
from app.services.features.worker import _consumer_stats as consumer_stats
from app.services.streams import consumer_specs, init_streams, new_job, publish_job
from app.settings import Settings
from tests.support.jobs_world import own_nats
from tests.support.listener import Listener, listening
from tests.support.polling import eventually


async def test_a_url_with_several_servers_reaches_one_that_is_up(
    nats_server: EmbeddedNats,
) -> None:
    down = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    url = f"{down},{nats_server.url}"
    bus = JetStreamBus(NatsServers.parse(url), name="test-several", timeout=5)
    await bus.connect()
    try:
        assert bus.connected
    finally:
        await bus.drain()
    info = await server_info(NatsServers.parse(url), connect_timeout=5)
    assert info["version"] and info["jetstream"] is True


async def test_consumer_stats_that_cannot_be_read_are_a_warning_not_a_failed_loop(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer the server does not know (or a leader election's timeout) is logged
    and left to the next tick; the loop itself does not fail with a traceback."""
    bus = JetStreamBus(nats_server.servers, name="test-stats", timeout=5)
    await bus.connect()
    try:
        collect = consumer_stats(bus, Metrics(), "no-such-tier")
        with caplog.at_level(logging.WARNING):
            await collect()
    finally:
        await bus.drain()
    assert any("consumer state of" in r.getMessage() for r in caplog.records)


async def test_a_nak_delay_holds_on_every_delivery_of_the_job_consumers(tmp_path: Path) -> None:
    """The worker hands a job on (not-here, held) with a NAK and a delay; the redelivery
    must not come before that delay on the second, third, ... delivery either. A consumer
    BackOff breaks this on nats-server: it redelivers after delay + backoff[n] - ack_wait,
    at once when the backoff step is shorter than the ack wait."""
    settings = Settings(_env_file=None, job_ack_wait_seconds=30, job_backoff_seconds=[1.0, 2.0])
    delay = 1.5
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(NatsServers.parse(server.url), name="test-nak-delay", timeout=5)
        await bus.connect()
        try:
            await init_streams(bus, settings, tiers=("free",))
            await publish_job(bus, new_job("noop"), kind="online", tier="free")
            sub = await bus.subscribe(stream=STREAMS["online"], durable=consumer_name("free"))
            nakked_at = time.monotonic()
            for expected in (1, 2, 3, 4):
                got: list[Delivery] = []
                while not got:  # polls; a redelivery that does not come fails at the end
                    got = await sub.fetch(1, wait=1.0)
                    assert time.monotonic() - nakked_at < 30, "never redelivered"
                (delivery,) = got
                assert delivery.delivered == expected
                if expected > 1:
                    waited = time.monotonic() - nakked_at
                    assert waited >= delay * 0.9, f"delivery {expected} after {waited:.2f} s"
                await delivery.nak(delay)
                nakked_at = time.monotonic()
            await sub.unsubscribe()
        finally:
            await bus.drain()


async def test_a_job_consumer_made_with_a_backoff_loses_it_on_init(tmp_path: Path) -> None:
    """Consumers an earlier release made (with BackOff) are updated in place."""
    settings = Settings(_env_file=None)
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(NatsServers.parse(server.url), name="test-backoff-update", timeout=5)
        await bus.connect()
        try:
            await init_streams(bus, settings, tiers=("free",))
            (spec, *_) = consumer_specs(settings, ("free",))
            with_backoff = dataclasses.replace(spec, backoff_seconds=(30.0, 5.0))
            assert await bus.ensure_consumer(with_backoff) == "updated"
            assert await bus.ensure_consumer(spec) == "updated"
            assert await bus.ensure_consumer(spec) == "unchanged"
            info = await bus._js.consumer_info(spec.stream, spec.durable)
            assert not info.config.backoff
        finally:
            await bus.drain()


async def _connected(
    tmp_path: Path, name: str, policy: ReconnectPolicy
) -> tuple[EmbeddedNats, JetStreamBus]:
    """A nats-server of its own and a bus connected to it with `policy`."""
    server = EmbeddedNats(tmp_path / "nats").start()
    bus = JetStreamBus(NatsServers.parse(server.url), name=name, timeout=2, reconnect=policy)
    await bus.connect()
    return server, bus


class _Closer:
    """A port's handler that takes each connection and closes it at once, counting them."""

    def __init__(self) -> None:
        self.accepted = 0

    async def __call__(
        self, _: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Listener
    ) -> None:
        self.accepted += 1
        writer.close()


async def test_connecting_again_while_reconnecting_replaces_the_client_and_keeps_the_waits(
    tmp_path: Path,
) -> None:
    """The worker's `prepare` connects when the bus is not connected, also while the bus's
    client is still reconnecting after a loss. That connection replaces the old client (which
    is closed, not left reconnecting beside it) and waits the policy's jittered time
    between attempts like any first connection, not one attempt after another. Here the
    server is gone and its port answers every connection by closing it; the attempts are
    counted there."""
    server, bus = await _connected(tmp_path, "test-connect-again", ReconnectPolicy(0.2, 0.4))
    old, port, closer = bus._nc, server.port, _Closer()
    server.stop(graceful=False)
    again = None
    try:
        await eventually(lambda: _false(bus.connected))
        async with listening(closer, port):
            again = asyncio.create_task(bus.connect())
            await eventually(lambda: _true(closer.accepted >= 3))
            before, began = closer.accepted, time.monotonic()
            await asyncio.sleep(1.0)  # counted over a second: waits of at most 0.4 s
            rate = (closer.accepted - before) / (time.monotonic() - began)
            assert rate <= 15, f"{rate:.0f} attempts/s"  # without the waits: hundreds
            assert old.is_closed and bus._nc is not old
    finally:
        if again is not None:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)
        await bus.drain(within=2)


@contextlib.asynccontextmanager
async def _bus_and_publisher(
    servers: NatsServers, name: str
) -> AsyncIterator[tuple[JetStreamBus, JetStreamBus]]:
    """A node's bus and a publisher's, both connected to `servers`; drained on leaving."""
    bus = JetStreamBus(servers, name=name, timeout=5)
    publisher = JetStreamBus(servers, name=f"{name}-publisher", timeout=5)
    await bus.connect()
    await publisher.connect()
    try:
        yield bus, publisher
    finally:
        await publisher.drain()
        await bus.drain()


def _close_wait_to(port: int) -> int:
    """This network namespace's TCP sockets in CLOSE_WAIT whose peer is 127.0.0.1:`port`:
    the peer closed them and this side has not (yet)."""
    peer = f"0100007F:{port:04X}"
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        count += fields[2] == peer and fields[3] == "08"  # 08: CLOSE_WAIT
    return count


async def test_a_reconnect_attempt_the_server_closes_leaves_no_socket_open(
    tmp_path: Path,
) -> None:
    """A port that takes each connection and closes it before the NATS handshake (a server
    at its connection limit, a proxy with nothing behind it): each reconnect attempt
    fails there, and the next one replaces the connection in nats-py's transport without
    closing the last. The bus closes it before the next attempt, so the node does not
    keep one half-closed socket per attempt until a garbage collection happens to find
    it (one that does find it warns of an unclosed transport, which fails the test too)."""
    server, bus = await _connected(tmp_path, "test-no-leak", ReconnectPolicy(0.02, 0.05))
    port, closer = server.port, _Closer()
    try:
        server.stop(graceful=False)
        await eventually(lambda: _false(bus.connected))
        async with listening(closer, port):
            await eventually(lambda: _true(closer.accepted >= 12))
            left = _close_wait_to(port)
            assert left <= 1, f"{left} sockets left open after {closer.accepted} attempts"
    finally:
        await bus.drain(within=2)


async def _true(value: bool) -> bool:
    return value


async def _false(value: bool) -> bool:
    return not value


async def test_a_server_that_drops_each_connection_soon_gets_a_growing_backoff(
    tmp_path: Path,
) -> None:
    """A server (or a proxy before it) that takes each connection and drops it a moment
    later must not keep a fleet in its first, shortest backoff window: the count of
    attempts starts again only after a connection stayed up the policy's cap. Here each
    connection is cut 0.15 s after it is made (the cap is 0.4 s); the waits are counted
    at the policy's hook."""
    attempts: list[int] = []
    with own_nats(tmp_path / "nats") as server:

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()

        async def cut_soon(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proxy: Listener
        ) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", server.port)
            proxy.own(up_writer)
            both = [asyncio.create_task(pipe(reader, up_writer)),
                    asyncio.create_task(pipe(up_reader, writer))]  # fmt: skip
            try:
                await asyncio.sleep(0.15)
            finally:
                for task in both:
                    task.cancel()
                await asyncio.gather(*both, return_exceptions=True)
                writer.close()
                up_writer.close()

        async with listening(cut_soon) as proxy:
            bus = JetStreamBus(NatsServers.parse(f"nats://127.0.0.1:{proxy.port}"),
                               name="test-flap", timeout=2,
                               reconnect=ReconnectPolicy(base=0.05, cap=0.4),
                               on_attempt=lambda n, _wait: attempts.append(n))  # fmt: skip
            try:
                await bus.connect()
                await eventually(lambda: _true(len(attempts) >= 6), within=20)
            finally:
                await bus.drain(within=2)
    assert max(attempts) >= 3, attempts  # it grew: 0, 1, 2, 3, ... not 0, 0, 0, ...


async def test_every_node_of_a_tier_can_keep_its_long_pull_waiting(tmp_path: Path) -> None:
    """An idle node keeps one pull request waiting at each of its tier's consumers, so a
    consumer holds one per node of the tier: thousands in a fleet, past JetStream's default
    MaxWaiting of 512, where the server answers `409 Exceeded MaxWaiting` and the node's
    fetch fails. The consumers are made with JOB_CONSUMER_MAX_WAITING; 600 pulls wait."""
    settings = Settings(_env_file=None)
    pulls = 600
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(server.servers, name="test-max-waiting", timeout=5)
        await bus.connect()
        try:
            await init_streams(bus, settings, tiers=("free",))
            (spec, *_) = consumer_specs(settings, ("free",))
            nc = bus._nc
            answered: list[str] = []

            async def answer(msg: Any) -> None:
                answered.append(f"{msg.headers}")

            await nc.subscribe("_INBOX.waiting.*", cb=answer)
            request = json.dumps({"batch": 1, "expires": 60 * 10**9}).encode()
            for i in range(pulls):
                await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{spec.stream}.{spec.durable}",
                                 request, reply=f"_INBOX.waiting.{i}")  # fmt: skip
            await nc.flush()

            async def all_waiting() -> bool:
                info = await bus._js.consumer_info(spec.stream, spec.durable)
                return bool(answered) or info.num_waiting == pulls

            await eventually(all_waiting)
            assert answered == [], f"{len(answered)} pulls refused: {answered[:1]}"
            info = await bus._js.consumer_info(spec.stream, spec.durable)
            assert info.config.max_waiting == settings.job_consumer_max_waiting
        finally:
            await bus.drain()


async def test_a_consumer_made_with_another_max_waiting_keeps_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MaxWaiting cannot be changed on an existing consumer (nats-server refuses the
    update): one an earlier release made keeps its own, the other settings are still
    brought in line, and the log says how to change it."""
    settings = Settings(_env_file=None)
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(server.servers, name="test-max-waiting-kept", timeout=5)
        await bus.connect()
        try:
            await init_streams(bus, settings, tiers=("free",))
            (spec, *_) = consumer_specs(settings, ("free",))
            await bus._js.delete_consumer(spec.stream, spec.durable)
            earlier = dataclasses.replace(spec, max_waiting=512, ack_wait_seconds=17.0)
            assert await bus.ensure_consumer(earlier) == "created"
            with caplog.at_level(logging.WARNING, logger="app.adapters.bus"):
                assert await bus.ensure_consumer(spec) == "updated"
                assert await bus.ensure_consumer(spec) == "unchanged"
            info = await bus._js.consumer_info(spec.stream, spec.durable)
            assert info.config.max_waiting == 512
            assert info.config.ack_wait == spec.ack_wait_seconds
            assert "max_waiting" in caplog.text and "recreate" in caplog.text
        finally:
            await bus.drain()


async def test_a_job_published_during_a_long_pull_is_delivered_at_once(tmp_path: Path) -> None:
    """An idle stream's pull waits WORKER_PULL_WAIT_SECONDS on the server; a job that
    arrives meanwhile is delivered at once, so the long wait costs no latency."""
    settings = Settings(_env_file=None)
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(server.servers, name="test-long-pull", timeout=5)
        await bus.connect()
        try:
            await init_streams(bus, settings, tiers=("free",))
            sub = await bus.subscribe(stream=STREAMS["online"], durable=consumer_name("free"))
            pulling = asyncio.create_task(sub.fetch(1, wait=30.0, cut=(bus.lost,)))
            await asyncio.sleep(0.3)  # the pull request waits on the server
            assert not pulling.done()
            published = time.monotonic()
            await publish_job(bus, new_job("noop"), kind="online", tier="free")
            (delivery,) = await asyncio.wait_for(pulling, timeout=5)
            latency = time.monotonic() - published
            await delivery.ack()
        finally:
            await bus.drain()
    assert latency < 0.25, f"{latency:.3f} s"


async def test_a_cut_ends_a_long_pull_at_once_and_loses_no_job(tmp_path: Path) -> None:
    """The stop cuts a 30 s pull short; the subscription then goes, and its pull request
    with it: the next job is not swallowed by it (it would come back only after the ack
    wait), and draining the connection does not wait for it."""
    settings = Settings(_env_file=None, job_ack_wait_seconds=30)
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(server.servers, name="test-cut-pull", timeout=5)
        await bus.connect()
        try:
            await init_streams(bus, settings, tiers=("free",))
            durable = consumer_name("free")
            sub = await bus.subscribe(stream=STREAMS["online"], durable=durable)
            stop = asyncio.Event()
            pulling = asyncio.create_task(sub.fetch(1, wait=30.0, cut=(stop, bus.lost)))
            await asyncio.sleep(0.3)
            cut_at = time.monotonic()
            stop.set()
            assert await asyncio.wait_for(pulling, timeout=5) == []
            cut_took = time.monotonic() - cut_at
            await sub.unsubscribe()
            await publish_job(bus, new_job("noop"), kind="online", tier="free")
            again = await bus.subscribe(stream=STREAMS["online"], durable=durable)
            started = time.monotonic()
            (delivery,) = await again.fetch(1, wait=10.0)
            fetch_took = time.monotonic() - started
            await delivery.ack()
            pulling = asyncio.create_task(again.fetch(1, wait=30.0, cut=(bus.lost,)))
            await asyncio.sleep(0.3)
        finally:
            drain_at = time.monotonic()
            await bus.drain(within=10)
            drain_took = time.monotonic() - drain_at
        assert await asyncio.wait_for(pulling, timeout=5) == []  # the drain's loss cut it
    assert cut_took < 0.2, f"{cut_took:.3f} s"
    assert fetch_took < 1.0, f"{fetch_took:.3f} s: the cut pull took the job"
    assert drain_took < 2.0, f"{drain_took:.3f} s"


async def test_a_job_that_reaches_the_client_as_the_stop_comes_is_returned(
    tmp_path: Path,
) -> None:
    """The stop and a job arrive in the same instant: the client has taken the job off the
    connection into the subscription's queue, and nats-py's waiting fetch has been woken
    for it but has not run yet, when the cut comes. Cancelling the fetch then would drop
    the job inside nats-py (its `next_msg` had already taken it off the queue): counted
    as received, returned by no one, back only after the ack wait (30 s here). The instant
    is made exact by setting the stop as the job is queued."""
    settings = Settings(_env_file=None, job_ack_wait_seconds=30)
    with own_nats(tmp_path / "nats") as server:
        async with _bus_and_publisher(server.servers, "test-cut-instant") as (bus, publisher):
            await init_streams(bus, settings, tiers=("free",))
            durable, stream = consumer_name("free"), STREAMS["online"]
            sub = await bus.subscribe(stream=stream, durable=durable)
            stop = asyncio.Event()
            queue = sub._sub._sub._pending_queue
            queued = queue.put_nowait

            def queue_then_stop(msg: Any) -> None:
                queued(msg)
                if not nats.js.client.JetStreamContext.is_status_msg(msg):
                    stop.set()  # the stop comes in the instant the job does

            queue.put_nowait = queue_then_stop
            pulling = asyncio.create_task(sub.fetch(1, wait=30.0, cut=(stop,)))

            async def waiting() -> bool:
                info = await publisher._js.consumer_info(stream, durable)
                return (info.num_waiting or 0) >= 1

            await eventually(waiting)
            await publish_job(publisher, new_job("noop"), kind="online", tier="free")
            deliveries = await asyncio.wait_for(pulling, timeout=10)
            assert len(deliveries) == 1, "the job reached the node and was dropped in it"
            await deliveries[0].ack()
            await sub.unsubscribe()


async def test_a_job_sent_in_the_instant_of_a_cut_is_handed_over_not_lost(
    tmp_path: Path,
) -> None:
    """The stop cuts a long pull while a job arrives. Every message that reached the
    node must be in what the cut fetch returns (to be handed back): none may stay in the
    client unanswered (counted by the connection's own `in_msgs`). A job the consumer
    gave the pull in the instant the server was already dropping its interest never
    reaches the node; JetStream redelivers it after the ack wait (2 s here), as it does
    any delivery no one answers, so no job is lost: each is taken once, here or later."""
    settings = Settings(_env_file=None, job_ack_wait_seconds=2)
    trials, in_client = 25, 0
    with own_nats(tmp_path / "nats") as server:
        async with _bus_and_publisher(server.servers, "test-cut-race") as (bus, publisher):
            await init_streams(bus, settings, tiers=("free",))
            durable, stream = consumer_name("free"), STREAMS["online"]

            async def consumer() -> Any:
                return await publisher._js.consumer_info(stream, durable)

            for _ in range(trials):
                sub = await bus.subscribe(stream=stream, durable=durable)
                stop = asyncio.Event()
                pulling = asyncio.create_task(sub.fetch(1, wait=30.0, cut=(stop,)))

                async def waiting() -> bool:
                    return ((await consumer()).num_waiting or 0) >= 1

                await eventually(waiting)
                before = bus._nc.stats["in_msgs"]
                sending = asyncio.create_task(
                    publish_job(publisher, new_job("noop"), kind="online", tier="free")
                )
                await asyncio.sleep(0)  # the publish is on its way: now the stop
                stop.set()
                deliveries = await asyncio.wait_for(pulling, timeout=5)
                await sending
                await sub.unsubscribe()
                in_client += bus._nc.stats["in_msgs"] - before - len(deliveries)
                for delivery in deliveries:
                    await delivery.ack()
                # what the cut pull did not take is in the stream, or comes back after the
                # ack wait: taken now, once
                left = await bus.subscribe(stream=stream, durable=durable)
                if not deliveries:
                    for delivery in await left.fetch(1, wait=settings.job_ack_wait_seconds + 3):
                        await delivery.ack()

                async def answered() -> bool:
                    info = await consumer()
                    return not info.num_ack_pending and not info.num_pending

                await eventually(answered, within=5)
                await left.unsubscribe()
    assert in_client == 0, f"{in_client} job(s) reached the node and were dropped in it"
