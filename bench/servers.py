"""Servers under test as child processes on 127.0.0.1: start, wait until ready, stop.

A server can be pinned to a set of cores (the affinity is set in the child before exec,
so every thread it starts inherits it). It imports this checkout's code (PYTHONPATH),
whatever the virtualenv has installed. Its memory map tells which event loop and HTTP
parser it really loaded.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.adapters.embedded import free_port

HOST = "127.0.0.1"
__all__ = ["HOST", "ServerProcess", "ServerSpec", "free_port", "running"]
REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


@dataclass(frozen=True)
class ServerSpec:
    label: str
    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: Path
    ready_path: str  # GET this until it answers with a status in ready_statuses
    ready_statuses: frozenset[int] = frozenset({200})


class ServerProcess:
    def __init__(self, spec: ServerSpec, *, port: int, cpus: set[int] | None, log: Path) -> None:
        self.spec = spec
        self.port = port
        self.cpus = cpus
        self.log_path = log
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._popen is not None
        return self._popen.pid

    def start(self) -> None:
        cpus = self.cpus

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                list(self.spec.argv),
                cwd=self.spec.cwd,
                env={**self.spec.env, "PYTHONPATH": str(REPO)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=pin,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        last = "no answer"
        while time.monotonic() < deadline:
            assert self._popen is not None
            if self._popen.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.label} exited with {self._popen.returncode}:\n{self.log()}"
                )
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            try:
                conn.request("GET", self.spec.ready_path)
                status = conn.getresponse().status
                if status in self.spec.ready_statuses:
                    return
                last = f"HTTP {status}"
            except OSError as exc:
                last = f"{type(exc).__name__}: {exc}"
            finally:
                conn.close()
            time.sleep(0.1)
        raise TimeoutError(
            f"{self.spec.label} not ready in {READY_TIMEOUT} s ({last}):\n{self.log()}"
        )

    def poll(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it does not go within STOP_TIMEOUT; returns the exit code."""
        return None if self._popen is None else stop_process(self._popen)

    def loaded_extensions(self, *names: str) -> dict[str, bool]:
        """Which of these packages have a shared object mapped in the process."""
        maps = Path(f"/proc/{self.pid}/maps").read_text()
        return {name: f"/{name}/" in maps for name in names}


@contextmanager
def running(
    spec: ServerSpec, *, port: int, cpus: set[int] | None, log: Path
) -> Iterator[ServerProcess]:
    server = ServerProcess(spec, port=port, cpus=cpus, log=log)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def stop_process(popen: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM, then SIGKILL if it does not go within STOP_TIMEOUT; returns the exit code."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=STOP_TIMEOUT)
    return popen.returncode
