"""Headless Chromium driven over the DevTools protocol, to check a page as a person sees it.

Debian's `chromium` (installed by .ci/run) runs with a fresh profile and every background
connection off (this machine's network is closed; without those flags Chromium keeps
trying to reach Google's hosts). A small CDP client over `websockets` is enough: load a
URL, evaluate an expression, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

FLAGS = (
    "--headless",
    "--no-sandbox",  # runs as root in CI
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--window-size=1280,900",
)


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Page:
    """One tab: navigate, evaluate, screenshot."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await asyncio.wait_for(self._ws.recv(), timeout=30))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result
            self._events.append(message)

    async def _event(self, method: str, within: float) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    return self._events.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {method} within {within} s")
            self._events.append(json.loads(await asyncio.wait_for(self._ws.recv(), left)))

    async def goto(self, url: str, *, within: float = 20.0) -> None:
        self._events.clear()
        result = await self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise RuntimeError(f"navigating to {url}: {result['errorText']}")
        await self._event("Page.loadEventFired", within)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def text(self) -> str:
        """What a person can read: the rendered, visible text of the page."""
        # empty while the page reloads itself (between two documents there is no body)
        value = await self.evaluate("document.body ? document.body.innerText : ''")
        return str(value)

    async def screenshot(self) -> bytes:
        """The viewport as a PNG."""
        data = (await self.call("Page.captureScreenshot", format="png"))["data"]
        return base64.b64decode(data)


@asynccontextmanager
async def browser(*, start_within: float = 30.0) -> AsyncIterator[Page]:
    """A headless Chromium with one blank tab; the process and its profile go at the end."""
    executable = chromium_path()
    if executable is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    # Chromium's helper processes (zygote, crashpad) may still write to the profile for a
    # moment after the browser exits, most of all on a busy machine: the whole process
    # group is ended, and what they still write does not fail the test
    with tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile:
        proc = await asyncio.create_subprocess_exec(
            executable,
            *FLAGS,
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "HOME": profile},
            start_new_session=True,
        )
        try:
            port = await _devtools_port(Path(profile), proc, start_within)
            async with httpx.AsyncClient(timeout=5) as client:
                targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
            (tab,) = [t for t in targets if t["type"] == "page"][:1]
            async with connect(tab["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                yield page
        finally:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
            _signal_group(proc.pid, signal.SIGKILL)  # helpers left behind


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _devtools_port(profile: Path, proc: asyncio.subprocess.Process, within: float) -> int:
    """Chromium writes the port it chose (port 0 asked for any) into the profile."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} before it listened")
        if marker.exists():
            first = marker.read_text().splitlines()[:1]
            if first and first[0].isdigit():
                return int(first[0])
        await asyncio.sleep(0.05)
    raise TimeoutError(f"chromium did not open its DevTools port within {within} s")
