"""The tests' own TCP listener (tests/support/listener.py) leaves nothing behind it: a
handler still running when it ends is cancelled and waited for, and every connection,
the accepted one and one the handler opened itself, is closed while the loop runs."""

from __future__ import annotations

import asyncio

from tests.support.listener import Listener, listening


async def test_a_handler_cut_mid_way_leaves_no_connection_open() -> None:
    ends: list[str] = []
    opened: list[asyncio.StreamWriter] = []
    up = asyncio.Event()

    async def upstream(_: asyncio.StreamReader, __: asyncio.StreamWriter, ___: Listener) -> None:
        await asyncio.Event().wait()

    async with listening(upstream) as far:

        async def hold(_: asyncio.StreamReader, __: asyncio.StreamWriter, me: Listener) -> None:
            _up_reader, up_writer = await asyncio.open_connection("127.0.0.1", far.port)
            opened.append(me.own(up_writer))
            up.set()
            try:
                await asyncio.Event().wait()  # until the listener ends
            finally:
                ends.append("cancelled")

        async with listening(hold) as near:
            reader, writer = await asyncio.open_connection("127.0.0.1", near.port)
            await asyncio.wait_for(up.wait(), timeout=5)
            assert near.handlers == 1
        try:
            assert ends == ["cancelled"] and near.handlers == 0
            assert opened[0].is_closing()
            assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # closed by it
        finally:
            writer.close()
            await writer.wait_closed()
