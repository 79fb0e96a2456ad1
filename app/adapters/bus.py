"""NATS JetStream through nats-py: streams, durable pull consumers, publishing.

Pitfalls handled here, so the worker does not have to know them:
- `max_reconnect_attempts=0` means "no limit" when nats-py picks a server, so a single
  attempt is spelled `1`; the manager's long-lived connection uses -1 (reconnect forever).
- pull subscriptions can go silent after a server restart (nats.py #504): the worker
  re-creates them after every reconnect, using `reconnects` to notice.
- `fetch()` raises TimeoutError on an empty stream; here it returns an empty list.
- the default error callback logs every failed attempt at ERROR (and so to Sentry);
  connection trouble is logged once per state change instead.
- every reply (requests, JetStream API answers, pull deliveries) comes to the client's
  inbox prefix, `_INBOX` unless set: a node connects with one of its own
  (`inbox_prefix`), so its credentials need subscribe on that and on no other inbox.
- nats-py waits a fixed `reconnect_time_wait` between attempts on one server, and tries
  the next server of its pool at once: a fleet that lost one server all came back in the
  same instant. The manager's connection waits a capped exponential backoff with full
  jitter (`ReconnectPolicy`) before every attempt instead, through nats-py's
  `reconnect_to_server_handler` (2.16: called before each reconnect attempt, it names
  the server and the wait) and, for the first connection, which nats-py runs without
  that handler, through the error callback, which nats-py awaits after each failed
  attempt and before the next. A server announcing lame duck mode is left after a
  jittered wait (`lame_duck_mode_cb`, then `force_reconnect`).
- a pull subscription's `fetch` cannot be told to stop: cancelled, the pull request
  stays on the server until it expires and takes the next message into a queue nobody
  reads (and the connection's `drain()` then waits for that queue). `fetch(..., cut=)`
  ends a long pull when an event is set: it cancels the wait, withdraws the interest the
  server's pull request needs and waits one round trip (so whatever the server delivered
  before that is here), takes what the subscription's queue holds, and the caller
  unsubscribes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
import nats.js.client
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from app.adapters.nats_auth import NatsAuth as NatsAuth  # the connection takes it
from app.domain.nats_servers import NatsServers
from app.domain.redaction import redact_url
from app.domain.spreading import ReconnectPolicy

log = logging.getLogger(__name__)

BusError = (nats.errors.Error, TimeoutError, OSError)
REFUSAL_POLL_SECONDS = 0.1  # how often a first connection looks for a refusal
ABANDON_TRIES = 50  # cancels of a refused first attempt, REFUSAL_POLL_SECONDS apart
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default max_payload


@dataclass(frozen=True, slots=True)
class Published:
    """A stream's answer to a publish: the message's sequence, and whether it was a
    duplicate (a message with its Nats-Msg-Id was stored within the stream's duplicate
    window: nothing was stored, `seq` is that earlier message's)."""

    seq: int
    duplicate: bool


class BucketMissing(Exception):
    """A key-value bucket the manager needs does not exist (an operator's step to take)."""


# JetStream's refusals of a stream's (or bucket's) replica count: more than one on a server
# that is not clustered; more than the cluster has peers for; not enough resources (peers
# up, storage) for that many
REPLICA_REFUSALS = {
    10074: "replicas > 1 not supported in non-clustered mode",
    10005: "no suitable peers for placement",
    10023: "insufficient resources",
}


class ReplicasRefused(nats.errors.Error):
    """The server refused a stream's (or key-value bucket's) replica count. A bus error
    like the others (`BusError`), with the setting to change in its message."""

    def __init__(self, stream: str, replicas: int, description: str) -> None:
        super().__init__(stream, replicas, description)
        self.stream = stream
        self.replicas = replicas
        self.description = description

    def __str__(self) -> str:
        return (
            f"the NATS server refused stream {self.stream} with {self.replicas} replicas "
            f"({self.description}): set NATS_STREAM_REPLICAS to what the server can hold "
            "(1 for a single server, at most the cluster's size)"
        )


def _replicas_refused(exc: BaseException, stream: str, replicas: int) -> ReplicasRefused | None:
    """`exc` as ReplicasRefused when it is JetStream's refusal of the replica count."""
    if not isinstance(exc, nats.js.errors.APIError) or exc.err_code not in REPLICA_REFUSALS:
        return None
    return ReplicasRefused(stream, replicas, exc.description or REPLICA_REFUSALS[exc.err_code])


class NatsRefused(Exception):
    """NATS refused this node: its credentials (authorization) or a subject it needs
    (permissions). Not a fault to retry quickly: an operator has to change something."""


# A node id in a subject is one token of these: a `.` would make it several, and node
# `node-c1`'s wildcards (`_INBOX.wm-C.node-c1.>`, `mm.events.node-c1.>`) would then cover
# the inboxes and events of node `node-c1.eu`; `*`, `>` and white space are no subject.
NODE_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def inbox_prefix(tier: str, node_id: str) -> str:
    """The inbox prefix of a node's connection, `_INBOX.wm-<tier>.<node>`: what its NATS
    user may subscribe to (k8s/nats/auth.conf.example). The node id is one subject token
    of letters, digits, `-` and `_`, as in its events subject `mm.events.<node>.<kind>`;
    anything else is refused (ValueError)."""
    if NODE_TOKEN.fullmatch(node_id) is None:
        raise ValueError(
            f"node id {node_id!r} cannot be part of a NATS subject "
            "(one token of letters, digits, '-' and '_')"
        )
    return f"_INBOX.wm-{tier}.{node_id}"


def _refusal(exc: BaseException) -> str | None:
    """The server's words when `exc` is an authorization or permissions refusal."""
    text = str(exc)
    lowered = text.lower()
    if "authorization violation" in lowered or "authentication" in lowered:
        return f"NATS refused this node's credentials ({text.strip()})"
    if "permissions violation" in lowered:
        return f"NATS denied this node a subject ({text.strip()})"
    return None


async def _log_quietly(exc: Exception) -> None:
    log.debug("nats: %s", exc)


async def _abandon(connecting: asyncio.Task[Any], client: Any, close_within: float) -> None:
    """Stop a first connection's attempt and close its client. The cancel is repeated
    until the attempt has ended (bounded): Python 3.11's `asyncio.wait_for` drops a cancel
    that arrives together with the answer it waits for."""
    for _ in range(ABANDON_TRIES):
        if connecting.done():
            break
        connecting.cancel()
        await asyncio.wait({connecting}, timeout=REFUSAL_POLL_SECONDS)
    else:
        log.warning("a refused NATS connection attempt did not stop when cancelled")
    if connecting.done() and not connecting.cancelled():
        connecting.exception()  # retrieved: the refusal is what is reported
    try:
        await asyncio.wait_for(client.close(), timeout=close_within)
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        log.debug("closing a refused NATS connection: %s", exc)


async def server_info(
    servers: NatsServers, *, connect_timeout: float, auth: NatsAuth | None = None
) -> dict[str, object]:
    """Connect once, read the server's version, ask JetStream, close; raises on failure
    (NatsRefused when the server refused the credentials)."""
    nc: Any = Client()
    try:
        await nc.connect(
            list(servers.urls),
            connect_timeout=connect_timeout,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            error_cb=_log_quietly,
            **(auth or NatsAuth()).options(),
        )
    except BaseException as exc:
        await nc.close()  # a failed first connection leaves its socket open otherwise
        refused = _refusal(exc)
        if refused is not None:
            raise NatsRefused(refused) from None
        raise
    try:
        server = nc.connected_server_version
        version = f"{server.major}.{server.minor}.{server.patch}"
        jetstream = True
        try:
            await nc.jetstream(timeout=connect_timeout).account_info()
        except (nats.errors.Error, TimeoutError):
            jetstream = False
        return {"version": version, "jetstream": jetstream}
    finally:
        await nc.close()


@dataclass(frozen=True, slots=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: str  # "limits" | "workqueue" | "interest"
    max_age_seconds: float
    duplicate_window_seconds: float
    replicas: int


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    stream: str
    durable: str
    filter_subject: str
    ack_wait_seconds: float
    max_deliver: int
    backoff_seconds: tuple[float, ...]
    max_ack_pending: int
    max_waiting: int  # pull requests that may wait at once: one per idle node of the tier


class Delivery:
    """One delivered message: the data, and the four answers JetStream accepts."""

    def __init__(self, msg: Any) -> None:
        self._msg = msg

    @property
    def subject(self) -> str:
        return str(self._msg.subject)

    @property
    def data(self) -> bytes:
        return bytes(self._msg.data)

    @property
    def delivered(self) -> int:
        return int(self._msg.metadata.num_delivered)

    @property
    def stream_sequence(self) -> int:
        return int(self._msg.metadata.sequence.stream)

    async def ack(self) -> None:
        await self._msg.ack()

    async def nak(self, delay: float) -> None:
        # Always with a delay: a plain NAK is redelivered at once.
        await self._msg.nak(delay=max(delay, 0.001))

    async def term(self) -> None:
        await self._msg.term()

    async def in_progress(self) -> None:
        await self._msg.in_progress()


# the round trip that makes sure a cut pull's deliveries have all arrived
WITHDRAW_SECONDS = 2.0
# the status a cut puts behind a pull's deliveries to end nats-py's waiting fetch; the
# server never sends it (JetStream's pull statuses are 100, 404, 408, 409)
CUT_STATUS, CUT_DESCRIPTION = 499, "workload-manager: pull cut"


class PullSubscription:
    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def fetch(
        self, batch: int, *, wait: float, cut: Sequence[asyncio.Event] = ()
    ) -> list[Delivery]:
        """Up to `batch` deliveries, waiting at most `wait` seconds for the first; [] when
        none came. When an event of `cut` is set first, the wait of a single fetch (an
        idle stream's long poll) ends there with what reached the node meanwhile (the
        caller unsubscribes next: the pull request still waiting on the server then
        lapses, having no interest). A batch is not cut: nats-py gathers its messages in a
        list of its own; it ends at its own wait, the short one of an active stream.

        A cut never cancels nats-py's fetch: its `next_msg` takes a message off the queue
        in a task of its own, and a cancel that lands after that task took one and before
        the fetch ran again would drop it (back only after the ack wait). The cut withdraws
        the server's interest, then wakes the fetch with a status of its own behind
        whatever arrived, and the fetch ends on its own."""
        if batch > 1:
            cut = ()
        fetching = asyncio.ensure_future(self._sub.fetch(batch=batch, timeout=wait))
        waits = [asyncio.ensure_future(event.wait()) for event in cut]
        try:
            await asyncio.wait([fetching, *waits], return_when=asyncio.FIRST_COMPLETED)
            if not fetching.done():  # cut
                await self._withdraw()
                self._wake()
                done, _ = await asyncio.wait({fetching}, timeout=WITHDRAW_SECONDS)
                if not done:
                    log.warning("a cut fetch did not end when woken; cancelling it")
        finally:
            for waiting in waits:
                waiting.cancel()
            if not fetching.done():  # this call cancelled (or the woken fetch stuck)
                fetching.cancel()
                await asyncio.gather(fetching, return_exceptions=True)
        if fetching.cancelled():
            await self._withdraw()
            return await self._take_pending()
        was_cut = any(event.is_set() for event in cut)
        try:
            msgs = fetching.result()
        except (nats.errors.TimeoutError, TimeoutError):
            msgs = []
        except nats.errors.ConnectionClosedError:
            if not was_cut:
                raise
            msgs = []  # cut by the connection's end (a drain): what it left is taken below
        except nats.js.errors.APIError as exc:
            if not (was_cut and exc.code == CUT_STATUS and exc.description == CUT_DESCRIPTION):
                raise
            msgs = []  # woken by the cut with nothing before it
        if was_cut:
            # what arrived behind the one taken (the wake-up status among it) is handed
            # back too; the caller unsubscribes next
            return [Delivery(m) for m in msgs] + await self._take_pending()
        return [Delivery(m) for m in msgs]

    def _wake(self) -> None:
        """Put the cut's own status at the end of the subscription's queue: nats-py's
        waiting fetch takes what is before it, or ends on it with an APIError (a 408 would
        not do: nats-py waits on after one until its own deadline)."""
        core = getattr(self._sub, "_sub", None)
        queue = getattr(core, "_pending_queue", None)
        if core is None or queue is None:
            return
        status = Msg(_client=core._conn, subject=core._subject, data=b"",
                     headers={api.Header.STATUS: str(CUT_STATUS),
                              api.Header.DESCRIPTION: CUT_DESCRIPTION})  # fmt: skip
        queue.put_nowait(status)

    async def _withdraw(self) -> None:
        """End the server's interest in this subscription and wait one round trip, so
        that whatever the server delivered to the pull before it saw that is in the
        subscription's queue (the server answers a PING after the UNSUB before it, and
        after the UNSUB delivers nothing more here); what it had not delivered stays in
        the stream for the next pull, here or on another node. Without this, a message
        the server sends in the instant between the cut and the unsubscription would
        be dropped by the client and come back only after the ack wait. nats-py's own
        `Subscription.drain` does the same two steps, but then waits for a callback
        that a pull subscription does not have: its private calls are used, as drain's."""
        core = getattr(self._sub, "_sub", None)
        conn = getattr(core, "_conn", None)
        if core is None or conn is None or conn.is_closed or not conn.is_connected:
            return  # the connection is gone: nothing more can arrive
        try:
            await conn._send_unsubscribe(core._id)
            await conn.flush(timeout=WITHDRAW_SECONDS)
        except (nats.errors.Error, TimeoutError) as exc:
            log.debug("withdrawing a cut pull: %s", exc)

    async def _take_pending(self) -> list[Delivery]:
        """What the subscription's queue holds now (delivered to a pull that was cut),
        taken straight from the queue: a fetch would send a new pull request first when
        the queue holds only status messages, and the server could answer that one with
        a job after the subscription is gone. Status messages (the cut pull's end) are
        dropped, as nats-py's fetch drops them."""
        core = getattr(self._sub, "_sub", None)
        queue = getattr(core, "_pending_queue", None)
        taken: list[Delivery] = []
        if core is None or queue is None:
            return taken
        while not queue.empty():
            msg = queue.get_nowait()
            core._pending_size -= len(msg.data)
            queue.task_done()
            if nats.js.client.JetStreamContext.is_status_msg(msg):
                continue
            taken.append(Delivery(msg))
        return taken

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except (nats.errors.Error, TimeoutError) as exc:
            # the connection it belonged to is usually gone already; nothing to undo
            log.debug("unsubscribe: %s", exc)


class JetStreamBus:
    """The manager's long-lived connection: reconnects forever, tells its state.

    `trouble` is why it is not connected now, naming the server and the client's last
    error ("disconnected from nats://nats:4222: unexpected EOF", "cannot connect to
    ..."); `on_change`, when given, hears every change of it as it happens (None once
    connected or reconnected)."""

    def __init__(
        self,
        servers: NatsServers,
        *,
        name: str,
        timeout: float,
        auth: NatsAuth | None = None,
        inbox_prefix: str | None = None,
        on_change: Callable[[str | None], None] | None = None,
        reconnect: ReconnectPolicy | None = None,
        on_attempt: Callable[[int, float], None] | None = None,
    ) -> None:
        self._configured = servers
        self._name = name
        self._timeout = timeout
        self._auth = auth or NatsAuth()
        # None: nats-py's `_INBOX` (the operator's tools, whose user may use every subject)
        self._inbox_prefix = inbox_prefix
        self._nc: Any = None
        self.reconnects = 0
        self.connected = False
        self._closing = False
        self._on_change = on_change
        self.last_error: str | None = None  # the client's last error, for the reasons above
        self._told: str | None = ""  # the last change told ("": none yet)
        # the server's last refusal (credentials or a subject), for a clear error instead of
        # the bare timeout a denied request ends in
        self.refusal: str | None = None
        self._policy = reconnect or ReconnectPolicy()
        # hears each wait before an attempt: (attempt since the loss, 0 first; seconds)
        self._on_attempt = on_attempt
        self._attempt = 0  # attempts since the last connection (or the start)
        self._up_since: float | None = None  # when the connection was made (or re-made)
        self._connecting: asyncio.Task[Any] | None = None  # a first connection's attempt
        self._left: str | None = None  # host:port of the server last connected to
        self._moving: asyncio.Task[None] | None = None  # leaving a lame duck server
        self._leaving = False  # the disconnection to come is the move (told at INFO)
        # set when the connection is lost; a new one for each connection (`lost`)
        self._lost = asyncio.Event()
        self._lost.set()

    @property
    def trouble(self) -> str | None:
        """Why it is not connected now, naming the server and the error; None when it is
        connected, or has not tried yet."""
        return None if self.connected else (self._told or None)

    def _change(self, why: str | None) -> None:
        if why != self._told:
            self._told = why
            if self._on_change is not None:
                self._on_change(why)

    def _servers(self) -> str:
        """The server connected to (last connected to), or the configured ones; never a
        password."""
        url = getattr(self._nc, "connected_url", None) if self._nc is not None else None
        if url is not None and url.hostname:
            return f"{url.scheme}://{url.hostname}:{url.port}"
        return ", ".join(redact_url(server) for server in self._configured.urls)

    @property
    def lost(self) -> asyncio.Event:
        """Set once the current connection is lost (set while there is none): a long wait
        on the connection ends with it."""
        return self._lost

    def _wait_before(self, attempt: int) -> float:
        delay = self._policy.wait(attempt)
        if self._on_attempt is not None:
            self._on_attempt(attempt, delay)
        return delay

    @staticmethod
    def _close_last_attempt(client: Any) -> None:
        """Close the connection of `client`'s last reconnect attempt. nats-py (2.16) keeps
        one transport and, when an attempt's TCP connection was made but its handshake
        failed (the server closed it: at its connection limit, a proxy with nothing behind
        it), connects the next attempt over it without closing the last: that socket
        stays half-closed until a garbage collection finds it. Closing twice is harmless."""
        transport = getattr(client, "_transport", None)  # nats-py keeps it private
        if transport is None:
            return
        try:
            transport.close()
        except (OSError, RuntimeError, AttributeError) as exc:
            log.debug("closing the last reconnect attempt: %s", exc)

    def _next_server(
        self, client: Any, servers: list[Any], _info: dict[str, Any]
    ) -> tuple[Any, float]:
        """nats-py's `reconnect_to_server_handler` of `client`, before every reconnect
        attempt: the server to try (round the pool, the one just lost last) and the
        jittered wait first. Never raises (nats-py would call it again at once)."""
        self._close_last_attempt(client)
        if self._up_since is not None:  # the first attempt after a loss
            if time.monotonic() - self._up_since >= self._policy.cap:
                self._attempt = 0  # it stayed up: a new loss starts from the base again
            self._up_since = None
        attempt = self._attempt
        self._attempt += 1
        try:
            order = sorted(servers, key=lambda server: server.uri.netloc == self._left)
            chosen = order[attempt % len(order)] if order else None
            return chosen, self._wait_before(attempt)
        except Exception as exc:  # a policy or hook that fails must not spin nats-py
            log.debug("reconnect wait: %s", exc)
            return None, self._policy.cap

    def _connected_now(self) -> None:
        url = getattr(self._nc, "connected_url", None) if self._nc is not None else None
        self._left = url.netloc if url is not None else None
        # the attempts are counted on until the connection has stayed up the policy's cap
        # (`_next_server`): a server that drops each connection at once is not retried in
        # the shortest window for ever
        self._up_since = time.monotonic()
        self._lost = asyncio.Event()

    async def _lame_duck(self) -> None:
        """The server announced lame duck mode: leave it after a jittered wait (it stops
        taking connections and closes the remaining ones over its lame duck duration)."""
        if self._moving is None or self._moving.done():
            self._moving = asyncio.create_task(self._leave_lame_duck(), name="nats-lame-duck")

    async def _leave_lame_duck(self) -> None:
        wait = self._policy.lame_duck_wait()
        left = self._left
        log.info("NATS server %s is in lame duck mode; moving on in %.1f s", left, wait)
        await asyncio.sleep(wait)
        nc = self._nc
        if nc is None or self._closing or not self.connected or self._left != left:
            return  # closed, or moved already (the server closed the connection first)
        self._leaving = True
        await nc.force_reconnect()

    async def _on_error(self, exc: Exception) -> None:
        if self._nc is None and not self._closing and asyncio.current_task() is self._connecting:
            # the first connection: nats-py awaits this after each failed attempt, before
            # the next, and has no reconnect handler for it; the wait is the policy's. Only
            # that attempt waits here: nats-py's close() awaits this callback too.
            self._tell_error(exc)
            if self.refusal is not None:
                # refused: no next attempt; connect() cancels the attempt parked here. A
                # next attempt would race that cancel with nats-py's `wait_for` on the
                # server's answer, and Python 3.11's `wait_for` drops a cancel that
                # arrives with the answer, leaving the attempt running.
                await asyncio.Event().wait()
            attempt = self._attempt
            self._attempt += 1
            await asyncio.sleep(self._wait_before(attempt))
            return
        self._tell_error(exc)

    def _tell_error(self, exc: Exception) -> None:
        self.last_error = str(exc).strip() or type(exc).__name__
        if not self.connected and not self._closing:
            verb = "cannot connect to" if self._nc is None else "disconnected from"
            self._change(f"{verb} {self._servers()}: {self.last_error}")
        refused = _refusal(exc)
        if refused is None:
            log.debug("nats: %s", exc)
            return
        if refused != self.refusal:  # once per distinct refusal, not per retry
            log.error("%s", refused)
        self.refusal = refused

    def _refused(self) -> str | None:
        return self.refusal

    def explain(self, exc: BaseException) -> BaseException:
        """`exc` as NatsRefused when the server refused something just before it (a denied
        subject makes a request time out); else `exc` itself."""
        if self.refusal is not None and isinstance(exc, (*BusError,)):
            return NatsRefused(self.refusal)
        return exc

    async def connect(self) -> None:
        async def disconnected() -> None:
            self._lost.set()
            if self.connected and not self._closing:
                moving, self._leaving = self._leaving, False
                log.log(
                    logging.INFO if moving else logging.WARNING,
                    "NATS connection %s; reconnecting",
                    "left (lame duck)" if moving else "lost",
                )
            self.connected = False
            if not self._closing:
                why = self.last_error or "connection closed"
                self._change(f"disconnected from {self._servers()}: {why}")

        async def reconnected() -> None:
            self._connected_now()
            self.reconnects += 1
            self.connected = True
            self.last_error = None
            log.info("NATS reconnected (%d)", self.reconnects)
            self._change(None)

        # A client still reconnecting after a loss (the worker's `prepare` runs again while
        # it is) is replaced, not left reconnecting beside the new one: closed first, so
        # the new client is a first connection, with the policy's waits between attempts.
        previous, self._nc = self._nc, None
        if previous is not None and not previous.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(previous.close(), timeout=self._timeout)
        # The client retries a first connection forever (a server that is not up yet is
        # waited for), also when the server refuses the credentials: that refusal, seen
        # by the error callback, ends the attempt with NatsRefused instead.
        self.refusal = None
        self._attempt = 0
        client: Any = Client()
        self._connecting = connecting = asyncio.create_task(
            client.connect(
                list(self._configured.urls),
                name=self._name,
                connect_timeout=self._timeout,
                max_reconnect_attempts=-1,  # never give up
                # the waits are the policy's: through the error callback for the first
                # connection, the reconnect handler after it (see the module's notes)
                reconnect_time_wait=0,
                allow_reconnect=True,
                error_cb=self._on_error,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                reconnect_to_server_handler=functools.partial(self._next_server, client),
                lame_duck_mode_cb=self._lame_duck,
                **({} if self._inbox_prefix is None else {"inbox_prefix": self._inbox_prefix}),
                **self._auth.options(),
            )
        )
        try:
            while not connecting.done():
                await asyncio.wait({connecting}, timeout=REFUSAL_POLL_SECONDS)
                refused = self._refused()  # set by the error callback meanwhile
                if refused is not None and not connecting.done():
                    await _abandon(connecting, client, self._timeout)
                    raise NatsRefused(refused)
        except asyncio.CancelledError:
            await _abandon(connecting, client, self._timeout)
            raise
        try:
            connecting.result()
        except nats.errors.Error as exc:
            refused = _refusal(exc)
            if refused is not None:
                self.refusal = refused
                raise NatsRefused(refused) from None
            raise
        self._nc = client
        self._connected_now()
        self.connected = True
        self.last_error = None
        self._change(None)

    @property
    def _js(self) -> Any:
        return self._nc.jetstream(timeout=self._timeout)

    @property
    def _server_info(self) -> dict[str, Any]:
        # the INFO of the server connected to (last connected to), which nats-py keeps
        # only privately (nats-py 2.16 has no public accessor for `cluster`/`connect_urls`)
        info = getattr(self._nc, "_server_info", None)
        return info if isinstance(info, dict) else {}

    @property
    def cluster_name(self) -> str | None:
        """The name of the server's cluster; None for a server that is not clustered (its
        INFO has no `cluster`), or before the first connection."""
        name = self._server_info.get("cluster")
        return str(name) if name else None

    @property
    def advertised_servers(self) -> int:
        """How many client URLs the server advertises (`connect_urls`: its cluster's
        members, itself included); 0 for a single server, or a cluster that advertises
        none (`no_advertise`)."""
        urls = self._server_info.get("connect_urls") or []
        return len(urls) if isinstance(urls, list) else 0

    async def stream_replicas(self, name: str) -> int | None:
        """The replica count of the existing stream `name`; None when there is none."""
        try:
            info = await self._js.stream_info(name)
        except nats.js.errors.NotFoundError:
            return None
        return int(info.config.num_replicas or 1)

    async def drain(self, *, within: float | None = None) -> None:
        """Stop subscriptions, flush what is pending, close; within `within` seconds (the
        client's own drain timeout is 30 s, longer than a pod's whole grace period)."""
        self._closing = True
        self._lost.set()
        if self._moving is not None and not self._moving.done():
            self._moving.cancel()
            await asyncio.gather(self._moving, return_exceptions=True)
        if self._nc is not None and not self._nc.is_closed:
            if not self.connected:
                await self._nc.close()  # nothing to flush; draining would wait for a server
                return
            try:
                async with asyncio.timeout(within):
                    await self._nc.drain()
            except (nats.errors.Error, TimeoutError) as exc:
                log.info("nats drain cut short (%s); closing", exc or "out of time")
                await self._nc.close()

    async def ensure_stream(self, spec: StreamSpec) -> str:
        """Create or update a stream to match `spec`; returns created | updated | unchanged.
        A replica count the server refuses ends in ReplicasRefused."""
        try:
            return await self._ensure_stream(spec)
        except nats.js.errors.APIError as exc:
            refused = _replicas_refused(exc, spec.name, spec.replicas)
            if refused is not None:
                raise refused from exc
            raise

    async def _ensure_stream(self, spec: StreamSpec) -> str:
        config = api.StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            retention=api.RetentionPolicy(spec.retention),
            max_age=spec.max_age_seconds,
            duplicate_window=spec.duplicate_window_seconds,
            num_replicas=spec.replicas,
            storage=api.StorageType.FILE,
        )
        try:
            info = await self._js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            await self._js.add_stream(config)
            return "created"
        current = info.config
        if (
            sorted(current.subjects or []) == sorted(spec.subjects)
            and current.max_age == spec.max_age_seconds
            and current.duplicate_window == spec.duplicate_window_seconds
            and current.num_replicas == spec.replicas
            and current.retention == config.retention
        ):
            return "unchanged"
        await self._js.update_stream(config)
        return "updated"

    async def ensure_consumer(self, spec: ConsumerSpec) -> str:
        # named (not only durable): nats-py then creates it on
        # $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>, a subject a tier's permissions
        # can pin down, and the server refuses a body whose filter differs from it
        config = api.ConsumerConfig(
            name=spec.durable,
            durable_name=spec.durable,
            filter_subject=spec.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=spec.ack_wait_seconds,
            max_deliver=spec.max_deliver,
            backoff=list(spec.backoff_seconds) or None,
            max_ack_pending=spec.max_ack_pending,
            max_waiting=spec.max_waiting,
        )
        try:
            info = await self._js.consumer_info(spec.stream, spec.durable)
        except nats.js.errors.NotFoundError:
            await self._js.add_consumer(spec.stream, config)
            return "created"
        current = info.config
        if current.max_waiting is not None and current.max_waiting != spec.max_waiting:
            # nats-server refuses to change it ("max waiting can not be updated"): the
            # consumer keeps its own, and the other settings are still brought in line
            log.warning(
                "consumer %s/%s keeps max_waiting %d (%d wanted): the server cannot change "
                "it; recreate the consumer to apply it (past it, pulls are refused with 409 "
                "Exceeded MaxWaiting)",
                spec.stream, spec.durable, current.max_waiting, spec.max_waiting,
            )  # fmt: skip
            config.max_waiting = current.max_waiting
        if (
            current.filter_subject == spec.filter_subject
            and current.ack_wait == spec.ack_wait_seconds
            and current.max_deliver == spec.max_deliver
            and list(current.backoff or []) == list(spec.backoff_seconds)
            and current.max_ack_pending == spec.max_ack_pending
        ):
            return "unchanged"
        # Creating with the same durable name updates a consumer's mutable settings.
        await self._js.add_consumer(spec.stream, config)
        return "updated"

    async def ensure_key_value(self, bucket: str, *, ttl_seconds: float, replicas: int) -> str:
        """Create the key-value bucket (history 1, entries expire `ttl_seconds` after their
        last write, file storage, direct gets, no rollups) unless it exists; returns
        created | updated | unchanged. An existing bucket is left as it is but for those
        two, which are set (updated) when they differ:
        - direct gets: a read then names its key in the subject
          (`$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>`), which permissions can
          confine, where the other form names it in the body;
        - no rollups: a `Nats-Rollup` header on a key anyone may write would purge that
          key's subject, or the whole stream, and no permission can see a header. The
          ledger writes but never deletes or purges (a KV purge is a rollup).
        A replica count the server refuses ends in ReplicasRefused."""
        try:
            await self._js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            # nats-py creates a bucket's stream with rollups allowed; they are switched off
            # below, before any node has written to it
            try:
                await self._js.create_key_value(
                    api.KeyValueConfig(
                        bucket=bucket, history=1, ttl=ttl_seconds, replicas=replicas,
                        storage=api.StorageType.FILE, direct=True,
                        description="workload manager: job idempotency ledger",
                    )
                )  # fmt: skip
            except nats.js.errors.APIError as exc:
                refused = _replicas_refused(exc, f"KV_{bucket}", replicas)
                if refused is not None:
                    raise refused from exc
                raise
            made = "created"
        else:
            made = "unchanged"
        config = (await self._js.stream_info(f"KV_{bucket}")).config
        if config.allow_direct and not config.allow_rollup_hdrs:
            return made
        await self._js.update_stream(config.evolve(allow_direct=True, allow_rollup_hdrs=False))
        return "updated" if made == "unchanged" else made

    async def key_value(self, bucket: str) -> Any:
        """The existing bucket `bucket`; BucketMissing names the command that makes it (or
        that switches on its direct gets, which a tier's permissions need). A bucket that
        still allows rollups works, but is logged: `init-streams` switches them off."""
        try:
            kv = await self._js.key_value(bucket)
            config = (await self._js.stream_info(f"KV_{bucket}")).config
        except nats.js.errors.BucketNotFoundError:
            raise BucketMissing(
                f"the JetStream key-value bucket {bucket} does not exist: "
                "run `workload-manager init-streams` (or set NATS_AUTO_INIT_STREAMS=true)"
            ) from None
        if not config.allow_direct:
            raise BucketMissing(
                f"the JetStream key-value bucket {bucket} does not allow direct gets: "
                "run `workload-manager init-streams` (or set NATS_AUTO_INIT_STREAMS=true)"
            )
        if config.allow_rollup_hdrs:
            log.warning(
                "the JetStream key-value bucket %s allows rollups, which empty it: run "
                "`workload-manager init-streams` to refuse them",
                bucket,
            )
        return kv

    async def consumer_state(self, stream: str, durable: str) -> dict[str, int]:
        info = await self._js.consumer_info(stream, durable)
        return {
            "pending": int(info.num_pending or 0),
            "ack_pending": int(info.num_ack_pending or 0),
        }

    def room(self, subject: str, msg_id: str | None = None) -> int:
        """The most bytes of body a message to `subject` may have: the server's
        max_payload (it counts the headers too) less the subject and headers, with some
        slack for the client's framing. NATS's default until connected."""
        limit = DEFAULT_MAX_PAYLOAD
        if self._nc is not None and self._nc.is_connected:
            limit = int(self._nc.max_payload)
        headers = len("NATS/1.0\r\nNats-Msg-Id: \r\n\r\n") + len(msg_id or "")
        return max(limit - headers - len(subject) - 64, 0)

    async def subscribe(self, *, stream: str, durable: str) -> PullSubscription:
        sub = await self._js.pull_subscribe_bind(durable=durable, stream=stream)
        return PullSubscription(sub)

    async def publish(
        self,
        subject: str,
        body: dict[str, Any] | bytes,
        *,
        msg_id: str | None = None,
        within: float | None = None,
    ) -> Published:
        """Publish to a stream and wait for its ack, at most `within` seconds (never more
        than the bus's own timeout); `msg_id` deduplicates within the window. `body` is
        a JSON object, or bytes already encoded (see `room`)."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        wait = self._timeout if within is None else min(within, self._timeout)
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        ack = await self._js.publish(subject, data, headers=headers, timeout=wait)
        return Published(seq=int(ack.seq), duplicate=bool(ack.duplicate))
