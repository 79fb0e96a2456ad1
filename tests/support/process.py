"""The real manager as a child process (`python -m app serve`), for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from app.adapters.embedded import free_port


class ManagerProcess:
    def __init__(self, *, env: Mapping[str, str], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "manager.log"
        self._env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", str(workdir)),
            "PORT": str(self.port),
            "HOST": "127.0.0.1",
            "DATA_DIR": str(workdir / "data"),
            "EMBEDDED_SERVICES": "false",
            "LOG_LEVEL": "INFO",
            # a process test's first runs come at once: the start-up spread (30 s in
            # production) is the subject of its own tests (tests/services/
            # test_startup_spread.py, and the node's, which spread over 3 s); a test may
            # set it again in `env`
            "STARTUP_SPREAD_SECONDS": "0",
            # the child imports the same `app` as the tests (a checkout on PYTHONPATH)
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
            **env,
        }
        self._workdir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    def start(
        self, *, wait_ready: bool = True, timeout: float = 30.0, sigint_ignored: bool = False
    ) -> ManagerProcess:
        """`sigint_ignored`: started as a background job of a script is (SIGINT ignored);
        otherwise with SIGINT's default, whatever this process inherited."""
        disposition = signal.SIG_IGN if sigint_ignored else signal.SIG_DFL
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "app", "serve"],
                cwd=self._workdir,
                env=self._env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
            )
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"manager exited with {self._proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"manager not ready within {timeout} s:\n{self.log()}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        self._proc.send_signal(sig)

    def wait(self, *, timeout: float) -> int:
        assert self._proc is not None
        return self._proc.wait(timeout=timeout)

    def stop(self, *, timeout: float = 20.0) -> int:
        """SIGTERM, as the kubelet sends it; returns the exit code."""
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                raise
        return self._proc.returncode


@contextmanager
def manager(*, env: Mapping[str, str], workdir: Path) -> Iterator[ManagerProcess]:
    proc = ManagerProcess(env=env, workdir=workdir).start()
    try:
        yield proc
    finally:
        proc.stop()
