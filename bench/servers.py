"""The servers the benchmarks start: child processes on 127.0.0.1 (the manager, the bare
floor), PostgreSQL and nats-server, and the environment they run with.

A child gets only the environment given here, imports this checkout (PYTHONPATH) and can be
pinned to cores (set before exec, so every thread it starts inherits it).
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from app.settings import Settings

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 60.0  # seconds to be ready; a third of it to stop on SIGTERM before SIGKILL


def base_env(**values: str) -> dict[str, str]:
    """PATH, LANG and HOME from this environment, then `values`: nothing else."""
    home = {"HOME": os.environ["HOME"]} if "HOME" in os.environ else {}
    return {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", **home, **values}


def overridden(explicit: frozenset[str]) -> list[str]:
    """Settings this environment sets beyond those a benchmark passes explicitly."""
    fields = Settings.model_fields
    return sorted(k for k in os.environ if k.lower() in fields and k.lower() not in explicit)


@contextmanager
def data_servers(workdir: Path) -> Iterator[tuple[EmbeddedPostgres, EmbeddedNats]]:
    """PostgreSQL and nats-server under `workdir`, stopped on the way out."""
    with ExitStack() as stack:
        servers = EmbeddedPostgres(workdir / "postgres"), EmbeddedNats(workdir / "nats")
        for server in servers:
            stack.callback(server.stop)
            server.start()
        yield servers


@dataclass(frozen=True)
class ServerSpec:
    label: str
    argv: Sequence[str]
    env: Mapping[str, str]  # PORT is added
    cwd: Path  # the manager's is not the repo: a developer's .env must not change a thing
    ready_path: str = "/readyz"  # GET this until it answers with one of ready_statuses
    ready_statuses: frozenset[int] = frozenset({200})


def manager_spec(env: Mapping[str, str], cwd: Path, ready_path: str = "/readyz") -> ServerSpec:
    return ServerSpec("manager", (sys.executable, "-m", "app", "serve"), env, cwd, ready_path)


class ServerProcess:
    """A server on a free port: `start` returns once it answers as ready."""

    def __init__(self, spec: ServerSpec, *, log: Path, cpus: set[int] | None = None) -> None:
        self.spec, self.log_path, self.cpus, self.port = spec, log, cpus, free_port()
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._popen is not None
        return self._popen.pid

    def start(self) -> None:
        cpus, spec = self.cpus, self.spec
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                list(spec.argv), cwd=spec.cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=pin,
                env={**spec.env, "PORT": str(self.port), "PYTHONPATH": str(REPO)},
            )  # fmt: skip
        deadline, last = time.monotonic() + TIMEOUT, "no answer"
        while time.monotonic() < deadline:
            if (code := self.poll()) is not None:
                raise RuntimeError(f"{spec.label} exited with {code}:\n{self.log()}")
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            try:
                conn.request("GET", spec.ready_path)
                if (status := conn.getresponse().status) in spec.ready_statuses:
                    return
                last = f"HTTP {status}"
            except OSError as exc:
                last = f"{type(exc).__name__}: {exc}"
            finally:
                conn.close()
            time.sleep(0.1)
        raise TimeoutError(f"{spec.label} not ready in {TIMEOUT} s ({last}):\n{self.log()}")

    def poll(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it does not go in time; returns the exit code."""
        if (popen := self._popen) is not None and popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=TIMEOUT / 3)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(timeout=TIMEOUT / 3)
        return None if popen is None else popen.returncode

    def loaded_extensions(self, *names: str) -> dict[str, bool]:
        """Which of these packages have a shared object mapped in the process."""
        maps = Path(f"/proc/{self.pid}/maps").read_text()
        return {name: f"/{name}/" in maps for name in names}


@contextmanager
def running(
    spec: ServerSpec, *, log: Path, cpus: set[int] | None = None
) -> Iterator[ServerProcess]:
    server = ServerProcess(spec, log=log, cpus=cpus)
    try:
        server.start()
        yield server
    finally:
        server.stop()
