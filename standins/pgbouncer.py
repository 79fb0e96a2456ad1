"""A real PgBouncer (Debian's `pgbouncer`) in transaction mode in front of a PostgreSQL.

Its `[pgbouncer]` section is the central one the repository ships
(`k8s/central/pgbouncer.ini`: pool mode, pool sizes, timeouts), with only what cannot be
the same here replaced: it listens on a free loopback port, trusts the local `postgres`
user (the embedded PostgreSQL trusts it too), logs to its own file, and forwards every
database name to the one server (`* =`), so a test's fresh database is pooled as it comes.
PgBouncer refuses to run as root: under root it drops to PostgreSQL's system user
(`-u`) once it has read its files.
"""

from __future__ import annotations

import configparser
import os
import pwd
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from app.adapters.embedded import (
    PG_SYSTEM_USER,
    EmbeddedError,
    EmbeddedPostgres,
    _ChildServer,
    _stop,
)

CENTRAL_CONFIG = Path(__file__).resolve().parents[1] / "k8s" / "central" / "pgbouncer.ini"
USER = "postgres"  # the embedded PostgreSQL's superuser, trusted on loopback
ADMIN_DATABASE = "pgbouncer"  # the admin console's virtual database

# What the tests' PgBouncer cannot take from the central file: its address, how clients
# authenticate, who may use the admin console, where it logs (and no pid file: it is a
# child process, not a daemon).
_LOCAL = {
    "listen_addr": "127.0.0.1",
    "unix_socket_dir": "",
    "auth_type": "trust",
    "admin_users": USER,
    "stats_users": USER,
    "logfile": "",
    "pidfile": "",
}


def central_settings(path: Path = CENTRAL_CONFIG) -> dict[str, str]:
    """The `[pgbouncer]` section of a PgBouncer configuration file."""
    parser = configparser.ConfigParser(
        interpolation=None, comment_prefixes=(";", "#"), inline_comment_prefixes=None
    )
    parser.read_string(path.read_text())
    return dict(parser["pgbouncer"])


def binary() -> str:
    """The `pgbouncer` program (Debian installs it in /usr/sbin)."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")
    if found is None:
        raise EmbeddedError(
            "pgbouncer not found: install Debian's pgbouncer (tools/debian-packages.sh "
            "pgbouncer; `make test-deps` does)"
        )
    return found


@dataclass
class PgBouncer(_ChildServer):
    """PgBouncer on 127.0.0.1:`port`, its files in `data_dir`, in front of `upstream`;
    `overrides` replace settings of the central file (a smaller pool, a shorter wait)."""

    upstream_host: str = "127.0.0.1"
    upstream_port: int = 5432
    overrides: dict[str, str] = field(default_factory=dict)

    @classmethod
    def before(cls, server: EmbeddedPostgres, data_dir: Path, **overrides: Any) -> PgBouncer:
        return cls(
            data_dir,
            upstream_host=server.host,
            upstream_port=server.port,
            overrides={k: str(v) for k, v in overrides.items()},
        )

    @property
    def settings(self) -> dict[str, str]:
        """The `[pgbouncer]` section it runs with."""
        return {
            **central_settings(),
            **_LOCAL,
            "listen_port": str(self.port),
            "auth_file": str(self.data_dir / "userlist.txt"),
            **self.overrides,
        }

    def url(self, database_url: str) -> str:
        """`database_url` (a URL of the upstream server) through the pooler."""
        parts = urlsplit(database_url)
        user = parts.netloc.rpartition("@")[0]
        netloc = f"{user}@{self.host}:{self.port}" if user else f"{self.host}:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def start(self) -> PgBouncer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._claim_port()
        (self.data_dir / "userlist.txt").write_text(f'"{USER}" ""\n')
        lines = ["[databases]", f"* = host={self.upstream_host} port={self.upstream_port}", ""]
        lines += ["[pgbouncer]", *(f"{k} = {v}" for k, v in self.settings.items())]
        config = self.data_dir / "pgbouncer.ini"
        config.write_text("\n".join(lines) + "\n")
        as_user = []
        if os.geteuid() == 0:
            pwd.getpwnam(PG_SYSTEM_USER)  # made by the PostgreSQL it stands in front of
            as_user = ["-u", PG_SYSTEM_USER]  # it reads its files as root, then drops
        self._launch("PgBouncer", [binary(), *as_user, str(config)])
        return self

    def admin(self, command: str) -> list[dict[str, str]]:
        """A command of the admin console (`SHOW POOLS`, …), its rows by column name. The
        console speaks the simple query protocol only, which psql uses."""
        result = subprocess.run(
            [str(EmbeddedPostgres._bin("psql")), "-h", self.host, "-p", str(self.port),
             "-U", USER, "-d", ADMIN_DATABASE, "-X", "-A", "-F", "\t", "-P", "footer=off",
             "-c", command],
            capture_output=True, text=True, timeout=10, check=False,
            env={**os.environ, "PGCONNECT_TIMEOUT": "5"},
        )  # fmt: skip
        if result.returncode != 0:
            raise EmbeddedError(f"PgBouncer's console refused {command!r}: {result.stderr}")
        header, *rows = result.stdout.splitlines()
        names = header.split("\t")
        return [dict(zip(names, row.split("\t"), strict=True)) for row in rows]

    def stop(self) -> None:
        """Immediate shutdown (SIGTERM): clients are disconnected, the port freed."""
        _stop(self._proc, signal.SIGTERM, timeout=15)
        self._proc = None
