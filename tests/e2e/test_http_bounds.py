"""One connection cannot take the manager down: raw sockets against the real process.

Any pod on the node can open connections to the manager, so the request head is bounded in
size (431 before it is buffered) and in time, idle kept-alive connections are closed, and
the connections held at once are capped, for the node and for each client address, while
pings keep being answered. Every refusal is counted on /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from app.adapters.embedded import free_port
from tests.support.polling import eventually
from tests.support.process import ManagerProcess, manager

pytestmark = pytest.mark.e2e

MAX_HEADER = 16 * 1024
# Linux routes all of 127.0.0.0/8 to lo: a socket bound to another loopback address is
# another client to the manager listening on 127.0.0.1
CLIENT = "127.0.0.1"
OTHER_CLIENT = "127.0.0.2"
PING_BODY = b'{"status":"healthy","version":"1.0.0"}'
HALF_HEAD = b"POST /v1/workloads/api/health HTTP/1.1\r\nhost: manager\r\n"

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def ping_request(name: str = "api") -> bytes:
    head = (
        f"POST /v1/workloads/{name}/health HTTP/1.1\r\nhost: manager\r\n"
        f"content-type: application/json\r\ncontent-length: {len(PING_BODY)}\r\n\r\n"
    )
    return head.encode() + PING_BODY


@contextmanager
def running(tmp_path: Path, **settings: str) -> Iterator[ManagerProcess]:
    env = {"HTTP_MAX_HEADER_BYTES": str(MAX_HEADER), **settings}
    with manager(env=env, workdir=tmp_path) as m:
        yield m


@asynccontextmanager
async def connections(
    m: ManagerProcess, count: int, source: str = CLIENT
) -> AsyncIterator[list[Stream]]:
    opened: list[Stream] = []
    try:
        for _ in range(count):
            opened.append(
                await asyncio.open_connection("127.0.0.1", m.port, local_addr=(source, 0))
            )
        yield opened
    finally:
        for _, writer in opened:
            writer.close()
        for _, writer in opened:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of one response; (0, b"") when the server closed instead."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0, b""
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection (a reset ends it too)."""
    received = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            received += chunk
    return received


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    await read_to_end(reader)
    return True


async def all_closed(streams: list[Stream], within: float) -> int:
    """How many of `streams` the server closed within `within` seconds."""
    return len(await answers_on_close(streams, within))


async def answers_on_close(streams: list[Stream], within: float) -> list[bytes]:
    """What the server sent on each of `streams` it closed within `within` seconds."""
    tasks = [asyncio.create_task(read_to_end(reader)) for reader, _ in streams]
    done, pending = await asyncio.wait(tasks, timeout=within)
    for task in pending:
        task.cancel()
    return [task.result() for task in done]


async def ping_once(m: ManagerProcess, source: str = CLIENT) -> int:
    """One ping on a new raw connection from `source`: its status, 0 when the connection was
    refused."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", m.port, local_addr=(source, 0))
    except ConnectionError:
        return 0
    try:
        writer.write(ping_request())
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        status, _ = await asyncio.wait_for(read_response(reader), timeout=10)
        return status
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def refusals_counted(m: ManagerProcess, reason: str) -> float:
    """`workload_manager_http_refusals_total{reason}` on /metrics (read from another client
    address than the tests' connections, so their cap does not refuse it)."""
    transport = httpx.AsyncHTTPTransport(local_address=OTHER_CLIENT)
    async with httpx.AsyncClient(base_url=m.url, transport=transport, timeout=10) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    sample = f'workload_manager_http_refusals_total{{reason="{reason}"}} '
    for line in response.text.splitlines():
        if line.startswith(sample):
            return float(line.removeprefix(sample))
    return 0.0


def peak_rss_reset(pid: int) -> None:
    """Reset the kernel's peak RSS of the process (VmHWM), so it measures what follows."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


async def flood(
    m: ManagerProcess, prefix: bytes, size: int, suffix: bytes
) -> tuple[bool, int, int]:
    """Send `prefix`, `size` bytes of "a", then `suffix` on one connection. Returns whether
    the server cut the connection while it was sent, the status of its answer (0: none)
    and how much the process's peak RSS grew meanwhile, from a baseline taken once the
    process has served a few pings (its first requests allocate too) and is idle."""
    process = psutil.Process(m.pid)
    for _ in range(3):
        assert await ping_once(m) == 204
    peak_rss_reset(m.pid)
    before = process.memory_info().rss
    reader, writer = await asyncio.open_connection("127.0.0.1", m.port)
    cut = False
    try:
        writer.write(prefix)
        chunk = b"a" * (1024 * 1024)
        for _ in range(size // len(chunk)):
            writer.write(chunk)
            await writer.drain()
        writer.write(suffix)
        await writer.drain()
    except ConnectionError:
        cut = True
    status, _ = await asyncio.wait_for(read_response(reader), timeout=30)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return cut, status, max(peak_rss(m.pid), process.memory_info().rss) - before


async def test_a_huge_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    attack = 16 * 1024 * 1024
    with running(tmp_path) as m:
        head = ping_request().split(b"\r\n\r\n")[0] + b"\r\nx-big: "
        cut, status, grown = await flood(m, head, attack, b"\r\n\r\n" + PING_BODY)
        # the header read whole would grow it by twice the attack
        assert grown < 8 * 1024 * 1024, f"RSS grew by {grown} bytes on a {attack} byte header"
        assert status in (0, 431), f"a {attack} byte header was answered {status}"
        assert cut or status == 431
        assert await ping_once(m) == 204
        assert await refusals_counted(m, "header-too-large") == 1


async def test_huge_trailers_are_refused_before_they_are_read(tmp_path: Path) -> None:
    attack = 16 * 1024 * 1024
    with running(tmp_path) as m:
        head = (
            ping_request()
            .split(b"\r\n\r\n")[0]
            .replace(f"content-length: {len(PING_BODY)}".encode(), b"transfer-encoding: chunked")
        )
        chunked = b"%x\r\n" % len(PING_BODY) + PING_BODY + b"\r\n0\r\nx-trailer: "
        cut, status, grown = await flood(m, head + b"\r\n\r\n" + chunked, attack, b"\r\n\r\n")
        assert grown < 8 * 1024 * 1024, f"RSS grew by {grown} bytes on a {attack} byte trailer"
        assert cut, f"a {attack} byte trailer was read whole and answered {status}"
        assert await ping_once(m) == 204
        assert await refusals_counted(m, "trailer-too-large") == 1


async def test_a_head_just_over_the_limit_gets_431(tmp_path: Path) -> None:
    with running(tmp_path) as m:
        async with connections(m, 1) as [(reader, writer)]:
            padding = b"x-pad: " + b"a" * MAX_HEADER + b"\r\n"
            writer.write(HALF_HEAD + padding + b"\r\n")
            await writer.drain()
            status, body = await asyncio.wait_for(read_response(reader), timeout=10)
            assert (status, body) == (431, b"Request Header Fields Too Large")
            assert await closed_by_server(reader)
        async with connections(m, 1) as [(reader, writer)]:
            # a long request line counts too
            writer.write(b"GET /" + b"a" * MAX_HEADER + b" HTTP/1.1\r\nhost: manager\r\n\r\n")
            await writer.drain()
            assert (await asyncio.wait_for(read_response(reader), timeout=10))[0] == 431
        assert await ping_once(m) == 204
        assert await refusals_counted(m, "header-too-large") == 2


def padded_ping(head_size: int) -> bytes:
    """A ping whose head (request line, headers, the blank line) is `head_size` bytes."""
    head, _, body = ping_request().partition(b"\r\n\r\n")
    padding = head_size - len(head) - len(b"\r\nx-pad: \r\n\r\n")
    return head + b"\r\nx-pad: " + b"a" * padding + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    ("head_size", "status"), [(MAX_HEADER - 1, 204), (MAX_HEADER, 204), (MAX_HEADER + 1, 431)]
)
async def test_the_head_limit_is_exact(tmp_path: Path, head_size: int, status: int) -> None:
    with running(tmp_path) as m:
        async with connections(m, 1) as [(reader, writer)]:
            request = padded_ping(head_size)
            assert request.index(b"\r\n\r\n") + 4 == head_size
            writer.write(request)
            await writer.drain()
            assert (await asyncio.wait_for(read_response(reader), timeout=10))[0] == status


async def test_pipelined_pings_are_answered_and_a_large_head_behind_them_refused(
    tmp_path: Path,
) -> None:
    with running(tmp_path) as m:
        async with connections(m, 1) as [(reader, writer)]:
            # in one write: the parser meets the second head inside the first read
            writer.write(ping_request() * 3 + padded_ping(MAX_HEADER + 1))
            await writer.drain()
            statuses = [(await asyncio.wait_for(read_response(reader), timeout=10))[0]]
            while statuses[-1] == 204:
                statuses.append((await asyncio.wait_for(read_response(reader), timeout=10))[0])
            assert statuses == [204, 204, 204, 431]
            assert await closed_by_server(reader)


async def test_valid_pings_are_answered_by_the_server_itself(tmp_path: Path) -> None:
    """`app serve` hands its protocol the ping fast path: valid pings get the request ids
    it makes (one prefix per process, then a counter; the framework's are random)."""
    with running(tmp_path) as m:
        ids = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{m.port}") as client:
            for _ in range(3):
                response = await client.post("/v1/workloads/api/health", content=PING_BODY)
                assert response.status_code == 204
                ids.append(response.headers["x-request-id"])
        prefixes = {rid[:6] for rid in ids}
        counters = [int(rid[6:], 16) for rid in ids]
        assert len(prefixes) == 1 and counters == [counters[0] + i for i in range(3)], ids


async def test_pipelined_requests_of_every_framing_are_answered_in_order(tmp_path: Path) -> None:
    """A sized body, a chunked one, none, and a sized one again, in one write: the parser is
    fed one request at a time, each answered in turn, nothing lost between them."""
    head = ping_request().split(b"\r\n\r\n")[0]
    chunked = (
        head.replace(f"content-length: {len(PING_BODY)}".encode(), b"transfer-encoding: chunked")
        + b"\r\n\r\n%x\r\n" % len(PING_BODY)
        + PING_BODY
        + b"\r\n0\r\n\r\n"
    )
    probe = b"GET /healthz HTTP/1.1\r\nhost: manager\r\n\r\n"
    with running(tmp_path) as m:
        async with connections(m, 1) as [(reader, writer)]:
            writer.write(ping_request("a") + chunked + probe + ping_request("b"))
            await writer.drain()
            statuses = [
                (await asyncio.wait_for(read_response(reader), timeout=10))[0] for _ in range(4)
            ]
            assert statuses == [204, 204, 200, 204]


async def test_half_sent_heads_are_closed_after_the_header_timeout(tmp_path: Path) -> None:
    with running(tmp_path, HTTP_HEADER_TIMEOUT_SECONDS="1") as m:
        async with connections(m, 50) as streams:
            for _, writer in streams[:25]:
                writer.write(HALF_HEAD)
            # the other 25 send nothing at all
            answers = await answers_on_close(streams, within=15)
            assert len(answers) == len(streams), f"{len(answers)} of {len(streams)} closed"
            assert sorted(answer[:12] for answer in answers) == [b""] * 25 + [b"HTTP/1.1 408"] * 25
        assert await ping_once(m) == 204
        assert await refusals_counted(m, "header-timeout") == 50


async def test_a_head_trickled_byte_by_byte_is_closed_at_the_deadline(tmp_path: Path) -> None:
    with running(tmp_path, HTTP_HEADER_TIMEOUT_SECONDS="1") as m:
        async with connections(m, 1) as [(reader, writer)]:
            reading = asyncio.create_task(read_to_end(reader))
            head = HALF_HEAD + b"x-slow: " + b"a" * 200
            for byte in head:
                if reading.done():
                    break
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:
                    break
                await asyncio.wait([reading], timeout=0.1)  # the pace of a slow client
            assert reading.done(), "a head trickled byte by byte was read to its end"
            assert reading.result().startswith(b"HTTP/1.1 408 Request Timeout\r\n")


async def test_pings_are_answered_while_300_slow_connections_are_open(tmp_path: Path) -> None:
    per_source = 60
    sources = ("127.0.0.10", "127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14")
    env = {
        "HTTP_HEADER_TIMEOUT_SECONDS": "60",
        "HTTP_MAX_CONNECTIONS_PER_CLIENT": str(per_source),
    }
    with running(tmp_path, **env) as m:
        async with contextlib.AsyncExitStack() as stack:
            # from five addresses, each at its per-client cap
            slow = [
                stream
                for source in sources
                for stream in await stack.enter_async_context(
                    connections(m, per_source, source=source)
                )
            ]
            for _, writer in slow:
                writer.write(HALF_HEAD)
                await writer.drain()
            limits = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=m.url, timeout=5, limits=limits) as client:
                for _ in range(30):
                    response = await client.post("/v1/workloads/api/health", content=PING_BODY)
                    assert response.status_code == 204
            # the attack was still in place: the server still held every slow connection,
            # so each address is still at its cap
            for source in sources:
                assert await ping_once(m, source=source) in (0, 503), source
            assert await refusals_counted(m, "too-many-connections-from-client") == len(sources)
            assert await refusals_counted(m, "header-timeout") == 0


async def test_connections_beyond_the_cap_are_refused_until_others_go(tmp_path: Path) -> None:
    cap = 16
    env = {"HTTP_MAX_CONNECTIONS": str(cap), "HTTP_HEADER_TIMEOUT_SECONDS": "60"}
    with running(tmp_path, **env) as m:
        async with connections(m, cap) as held:
            for _, writer in held:
                writer.write(HALF_HEAD)
                await writer.drain()

            async def refused() -> bool:
                return await ping_once(m) in (0, 503)

            await eventually(refused, within=10)
        # the held connections are gone: new ones are served again

        async def served() -> bool:
            return await ping_once(m) == 204

        await eventually(served, within=10)
        assert await refusals_counted(m, "too-many-connections") >= 1
        assert await refusals_counted(m, "too-many-connections-from-client") == 0


async def test_one_client_beyond_its_cap_is_refused_while_others_are_served(
    tmp_path: Path,
) -> None:
    cap = 8
    env = {
        "HTTP_MAX_CONNECTIONS_PER_CLIENT": str(cap),
        "HTTP_MAX_CONNECTIONS": "1000",
        "HTTP_HEADER_TIMEOUT_SECONDS": "60",
    }
    with running(tmp_path, **env) as m:
        async with connections(m, cap, source=CLIENT) as held:  # idle: they send nothing
            # one more from the same address: 503, before anything of it is read
            async with connections(m, 1, source=CLIENT) as extra:
                answers = await answers_on_close(extra, within=10)
                assert [answer[:12] for answer in answers] == [b"HTTP/1.1 503"], answers
            # another address is still served, and the held connections are still open
            assert await ping_once(m, source=OTHER_CLIENT) == 204
            assert await all_closed(held, within=0.2) == 0
            assert await refusals_counted(m, "too-many-connections-from-client") == 1
            # two of the held connections go: the address is served again
            for _, writer in held[:2]:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

            async def served() -> bool:
                return await ping_once(m, source=CLIENT) == 204

            await eventually(served, within=10)
        assert await refusals_counted(m, "too-many-connections") == 0


async def test_an_idle_kept_alive_connection_is_closed(tmp_path: Path) -> None:
    env = {"HTTP_KEEPALIVE_TIMEOUT_SECONDS": "1", "HTTP_HEADER_TIMEOUT_SECONDS": "60"}
    with running(tmp_path, **env) as m:
        async with connections(m, 1) as [(reader, writer)]:
            writer.write(ping_request())
            await writer.drain()
            assert (await asyncio.wait_for(read_response(reader), timeout=10))[0] == 204
            # the default keep-alive (5 s) would outlast this
            assert await all_closed([(reader, writer)], within=4) == 1


async def test_a_busy_kept_alive_connection_outlives_the_header_timeout(tmp_path: Path) -> None:
    env = {"HTTP_KEEPALIVE_TIMEOUT_SECONDS": "2", "HTTP_HEADER_TIMEOUT_SECONDS": "1"}
    with running(tmp_path, **env) as m:
        async with connections(m, 1) as [(reader, writer)]:
            loop = asyncio.get_running_loop()
            started = loop.time()
            sent = started
            # until a request sent three header timeouts after the connection opened is
            # answered, on the same connection: each head is sent in time, and each gap
            # between them is well within the keep-alive timeout
            while sent - started < 3:
                sent = loop.time()
                writer.write(ping_request())
                await writer.drain()
                assert (await asyncio.wait_for(read_response(reader), timeout=10))[0] == 204, (
                    f"not answered {sent - started:.2f} s after the connection opened"
                )
                await asyncio.sleep(0.2)  # the pace of a pinging workload


def ping_head(content_length: int) -> bytes:
    """The head of a ping that announces a body of `content_length` bytes."""
    head = ping_request().split(b"\r\n\r\n")[0]
    declared = f"content-length: {len(PING_BODY)}".encode()
    return head.replace(declared, f"content-length: {content_length}".encode()) + b"\r\n\r\n"


async def test_stalled_bodies_are_closed_after_the_body_timeout(tmp_path: Path) -> None:
    cap = 8
    env = {
        "HTTP_MAX_CONNECTIONS_PER_CLIENT": str(cap),
        "HTTP_BODY_TIMEOUT_SECONDS": "1",
        "HTTP_HEADER_TIMEOUT_SECONDS": "60",
        "HTTP_KEEPALIVE_TIMEOUT_SECONDS": "60",
    }
    with running(tmp_path, **env) as m:
        loop = asyncio.get_running_loop()
        async with connections(m, cap, source=CLIENT) as stalled:
            # a whole head announcing 500 bytes of body, one byte of it, then nothing
            for _, writer in stalled:
                writer.write(ping_head(500) + b"{")
                await writer.drain()
            sent = loop.time()
            # the attack is in place: the address is at its cap
            assert await ping_once(m, source=CLIENT) in (0, 503)
            closing = [asyncio.create_task(read_to_end(reader)) for reader, _ in stalled]
            done, _ = await asyncio.wait(closing, timeout=15)
            assert len(done) == cap, f"{len(done)} of {cap} stalled bodies closed in 15 s"
            waited = loop.time() - sent
            assert waited >= 0.9, f"stalled bodies closed after {waited:.2f} s, before 1 s"
            # the application was reading the body: there is nothing to answer
            assert [task.result() for task in closing] == [b""] * cap
        # the stalled connections left the address's count: it is served again
        assert await ping_once(m, source=CLIENT) == 204
        assert await refusals_counted(m, "body-timeout") == cap
        assert "request body not complete in time" in m.log()
        # a client gone mid-body is no application error (no traceback, no Sentry event)
        assert "Exception in ASGI application" not in m.log()
        assert "ClientDisconnect" not in m.log()


async def test_a_body_trickled_within_the_body_timeout_is_answered(tmp_path: Path) -> None:
    # the body takes longer than the head timeout, and less than the body timeout
    env = {"HTTP_HEADER_TIMEOUT_SECONDS": "1", "HTTP_BODY_TIMEOUT_SECONDS": "6"}
    with running(tmp_path, **env) as m:
        async with connections(m, 1) as [(reader, writer)]:
            loop = asyncio.get_running_loop()
            reading = asyncio.create_task(read_response(reader))
            writer.write(ping_head(len(PING_BODY)))
            await writer.drain()
            started = loop.time()
            for start in range(0, len(PING_BODY), 5):
                assert not reading.done(), f"answered before the body was complete: {reading}"
                writer.write(PING_BODY[start : start + 5])
                await writer.drain()
                await asyncio.wait([reading], timeout=0.25)  # the pace of a slow client
            assert loop.time() - started > 1, "the body was not slower than the head timeout"
            assert (await asyncio.wait_for(reading, timeout=10))[0] == 204
            # the deadline ended with the body: the connection serves the next request
            writer.write(ping_request())
            await writer.drain()
            assert (await asyncio.wait_for(read_response(reader), timeout=10))[0] == 204
        assert await refusals_counted(m, "body-timeout") == 0
        assert await refusals_counted(m, "header-timeout") == 0


def unread_bytes(port: int) -> int:
    """Bytes the kernel holds for the process listening on `port` that it has not read yet
    (the receive queues of its accepted sockets, /proc/net/tcp)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, queues = fields[1], fields[4]
        if int(local.split(":")[1], 16) == port:
            total += int(queues.split(":")[1], 16)
    return total


TINY = b"GET /x HTTP/1.1\r\n\r\n"  # 20 bytes: the cheapest request to pipeline


@pytest.mark.parametrize(
    ("addresses", "pipelined"),
    [
        pytest.param((CLIENT,), TINY, id="one-address"),
        pytest.param((CLIENT, OTHER_CLIENT), TINY, id="two-addresses"),
        pytest.param((CLIENT, OTHER_CLIENT), ping_request(), id="two-addresses-valid-pings"),
    ],
)
async def test_pipelined_requests_stay_unparsed_while_one_is_answered(
    tmp_path: Path, addresses: tuple[str, ...], pipelined: bytes
) -> None:
    """Each address at its connection cap, each connection sending 16,000 bytes of tiny
    pipelined requests and never reading an answer: parsed a whole read at a time, each
    request would cost ~2 KiB of the manager's memory (+113 MiB per address, past the pod's
    limit for two); held unparsed until the answer before them is written, they cost the
    bytes alone. Valid pings are answered by the server as they are parsed, until the
    connection's write buffer is full; the next waits for it to drain like any request."""
    cap = 64
    env = {"HTTP_MAX_CONNECTIONS_PER_CLIENT": str(cap), "HTTP_HEADER_TIMEOUT_SECONDS": "60"}
    attack = pipelined * (16_000 // len(pipelined))
    with running(tmp_path, **env) as m:
        process = psutil.Process(m.pid)
        for _ in range(3):
            assert await ping_once(m) == 204
        peak_rss_reset(m.pid)
        before = process.memory_info().rss
        async with contextlib.AsyncExitStack() as stack:
            for source in addresses:
                streams = await stack.enter_async_context(connections(m, cap, source=source))
                for _, writer in streams:
                    writer.write(attack)
                    await writer.drain()

            async def all_read() -> bool:
                return unread_bytes(m.port) == 0

            await eventually(all_read, within=30)
            # a ping from a third address is still answered, once the loop has run past
            # every read
            assert await ping_once(m, source="127.0.0.3") == 204
            grown = max(peak_rss(m.pid), process.memory_info().rss) - before
        total = len(addresses) * cap * len(attack)
        assert grown < 16 * 1024 * 1024, f"RSS grew by {grown >> 20} MiB on {total} bytes"


async def test_valid_pings_pipelined_never_read_are_answered_until_the_write_buffer_is_full(
    tmp_path: Path,
) -> None:
    """One connection pipelines 8 MiB of valid pings and never reads an answer. The server
    answers pings as it parses them, which costs the manager nothing while the kernel
    takes the answers; once the connection's write buffer is full the next ping waits for
    it to drain like any request, and what follows stays unread in the kernel (not in the
    manager): its memory grows by the buffer, not with the ~50,000 answers (uvicorn's
    keep-alive timer, armed per answer, left 20 MiB of cancelled timers behind; it is
    armed once a read)."""
    ping = ping_request()
    attack = ping * (8 * 1024 * 1024 // len(ping))
    with running(tmp_path, HTTP_HEADER_TIMEOUT_SECONDS="60") as m:
        process = psutil.Process(m.pid)
        for _ in range(3):
            assert await ping_once(m) == 204
        peak_rss_reset(m.pid)
        before = process.memory_info().rss
        async with connections(m, 1) as [(_, writer)]:
            writer.write(attack)  # buffered by the client's transport; never drained here

            async def held() -> bool:
                return unread_bytes(m.port) > 0

            await eventually(held, within=30)
            assert await ping_once(m, source=OTHER_CLIENT) == 204
            grown = max(peak_rss(m.pid), process.memory_info().rss) - before
        assert grown < 8 * 1024 * 1024, f"RSS grew by {grown >> 20} MiB"


async def probe(port: int, path: str) -> int:
    """GET `path` on a connection of its own, as the kubelet probes (0: refused or cut)."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            return (await client.get(f"http://127.0.0.1:{port}{path}")).status_code
    except httpx.HTTPError:
        return 0


async def test_the_probes_are_answered_while_pods_hold_every_connection(tmp_path: Path) -> None:
    """Two addresses at their per-client cap hold all the port's connections (kept alive,
    as pods that ping every few seconds do): a ping is refused there, and the kubelet's
    liveness and readiness probes on the probe port are still answered, six of six; the
    probe port answers nothing else."""
    cap = 8
    probes = free_port()
    env = {
        "HTTP_MAX_CONNECTIONS": str(2 * cap), "HTTP_MAX_CONNECTIONS_PER_CLIENT": str(cap),
        "HTTP_HEADER_TIMEOUT_SECONDS": "60", "PROBE_PORT": str(probes),
    }  # fmt: skip
    with running(tmp_path, **env) as m:
        async with (
            connections(m, cap, source=CLIENT) as first,
            connections(m, cap, source=OTHER_CLIENT) as second,
        ):
            for _, writer in first + second:
                writer.write(HALF_HEAD)
                await writer.drain()
            assert await ping_once(m, source="127.0.0.3") in (0, 503)
            assert [await probe(probes, "/healthz") for _ in range(6)] == [200] * 6
            assert [await probe(probes, "/readyz") for _ in range(6)] == [200] * 6
            assert await probe(probes, "/v1/status") == 404
            assert await probe(probes, "/metrics") == 404
            assert await all_closed(first + second, within=0.2) == 0
        assert await refusals_counted(m, "too-many-connections") >= 1


def nested_details_ping(limit: int = 16 * 1024) -> bytes:
    """A ping whose `details` is as many small nested objects as fit the body limit."""
    parts: list[str] = []
    size = len(b'{"status":"healthy","details":{}}')
    while size + 16 < limit:
        part = f'"k{len(parts)}":{{"v":{{}}}}'
        parts.append(part)
        size += len(part) + 1
    body = '{"status":"healthy","details":{' + ",".join(parts) + "}}"
    assert len(body) <= limit
    return body.encode()


async def test_the_details_of_pings_are_not_kept(tmp_path: Path) -> None:
    """100 workloads, each pinging once with 16 KiB of small nested objects in `details`:
    kept as parsed objects they cost ~370 KiB each (+36 MiB); not kept, next to nothing."""
    body = nested_details_ping()
    with running(tmp_path) as m:
        process = psutil.Process(m.pid)
        for _ in range(3):
            assert await ping_once(m) == 204
        peak_rss_reset(m.pid)
        before = process.memory_info().rss
        async with httpx.AsyncClient(base_url=m.url, timeout=10) as client:
            for i in range(100):
                answer = await client.post(
                    f"/v1/workloads/w{i}/health", content=body,
                    headers={"content-type": "application/json"},
                )  # fmt: skip
                assert answer.status_code == 204, answer.text
        grown = max(peak_rss(m.pid), process.memory_info().rss) - before
        assert grown < 8 * 1024 * 1024, f"RSS grew by {grown >> 20} MiB on 100 pings"
