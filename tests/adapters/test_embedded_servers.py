"""Embedded PostgreSQL and nats-server: they start, answer, stop and come back."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from app.adapters import bus, registry
from app.adapters.embedded import EmbeddedError, EmbeddedNats, EmbeddedPostgres
from app.domain.nats_servers import NatsServers
from app.main import create_app
from tests.conftest import SettingsFactory, running
from tests.support.ci_skips import cannot_run_here


async def test_postgres_answers_and_survives_a_restart(tmp_path: Path) -> None:
    server = EmbeddedPostgres(tmp_path / "pg").start()
    try:
        assert (
            (await registry.server_version(server.url, connect_timeout=5)).split(".")[0].isdigit()
        )
        port = server.port
        server.stop()
        assert not server.running
        with pytest.raises(OSError):
            await registry.server_version(server.url, connect_timeout=2)
        server.start()
        assert server.port == port
        assert await registry.server_version(server.url, connect_timeout=5)
    finally:
        server.stop()


async def test_nats_answers_with_jetstream(nats_server: EmbeddedNats) -> None:
    info = await bus.server_info(nats_server.servers, connect_timeout=5)
    assert info["jetstream"] is True
    assert str(info["version"]).startswith("2.")


async def test_unreachable_servers_raise_within_the_timeout() -> None:
    with pytest.raises(OSError):
        await registry.server_version(
            "postgresql://postgres@127.0.0.1:9/postgres", connect_timeout=1
        )
    with pytest.raises(Exception, match=r"(?i)connect|refused|no servers"):
        await bus.server_info(NatsServers.parse("nats://127.0.0.1:9"), connect_timeout=1)


async def test_development_run_starts_and_stops_embedded_servers(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(embedded_services=True)
    app = create_app(settings)
    async with running(app) as client:
        components = (await client.get("/v1/status")).json()["components"]
        for name in ("postgres", "nats"):
            assert components[name]["state"] == "ok", components[name]
            assert components[name]["detail"]["embedded"] is True
        pg_pid = components["postgres"]["detail"]["pid"]
        nats_pid = components["nats"]["detail"]["pid"]
        assert components["nats"]["detail"]["jetstream"] is True
    for pid in (pg_pid, nats_pid):
        assert not _alive(pid), f"embedded server {pid} still running after shutdown"
    assert (settings.data_dir / "postgres" / "PG_VERSION").exists()


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not yet reaped) counts as gone
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


async def test_production_never_starts_embedded_servers(make_settings: SettingsFactory) -> None:
    settings = make_settings(embedded_services=True, app_env="production", api_token="op")
    app = create_app(settings)
    async with running(app) as client:
        answer = await client.get("/v1/status", headers={"Authorization": "Bearer op"})
        components = answer.json()["components"]
    assert components["postgres"]["enabled"] is False
    assert components["nats"]["enabled"] is False
    assert not (settings.data_dir / "postgres").exists()


def test_servers_left_behind_by_a_killed_run_are_replaced(tmp_path: Path) -> None:
    import os
    import signal as signals

    pg = EmbeddedPostgres(tmp_path / "pg").start()
    nats = EmbeddedNats(tmp_path / "nats").start()
    old = (pg.pid, nats.pid)
    # the manager dies without stopping them: a new process knows nothing of the handles
    handles = [pg._proc, nats._proc]
    pg._proc = None
    nats._proc = None
    fresh_pg = EmbeddedPostgres(tmp_path / "pg").start()
    fresh_nats = EmbeddedNats(tmp_path / "nats").start()
    try:
        assert fresh_pg.running and fresh_nats.running
        for pid in old:
            assert pid is not None and not _alive(pid)
    finally:
        fresh_pg.stop()
        fresh_nats.stop()
        for handle in handles:
            assert handle is not None
            if handle.poll() is None:
                os.kill(handle.pid, signals.SIGKILL)
            handle.wait(timeout=10)


AS_ROOT_ONLY = cannot_run_here("as root only: PostgreSQL runs as a system user")


def modes(paths: list[Path]) -> dict[Path, str]:
    return {path: stat.filemode(path.stat().st_mode) for path in paths}


@pytest.mark.skipif(os.geteuid() != 0, reason=AS_ROOT_ONLY)
async def test_starting_as_root_changes_no_parent_directory(tmp_path: Path) -> None:
    """The server runs as an unprivileged user; the data directory is given to it, and
    nothing else changes: no directory above it (here one the user may not even search),
    nothing of the PostgreSQL installation."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    data = locked / "pg"
    install = EmbeddedPostgres._bin("postgres").parent.parent
    watched = [*data.parents, install, *install.parents, install / "bin" / "postgres"]
    before = modes(watched)
    assert before[locked] == "drwx------"
    server = EmbeddedPostgres(data).start()
    try:
        assert await registry.server_version(server.url, connect_timeout=5)
        assert modes(watched) == before
        assert stat.filemode(data.stat().st_mode) == "drwx------"
        assert data.stat().st_uid != 0 and (data / "PG_VERSION").exists()
        server.stop()
        server.start()  # and again, on the cluster it made
        assert await registry.server_version(server.url, connect_timeout=5)
        assert modes(watched) == before
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason=AS_ROOT_ONLY)
def test_an_installation_the_server_user_cannot_reach_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's programs under a directory the server user may not search (as when
    the virtualenv is under /root): start says which directory and what to do, and
    changes its mode no more than any other."""
    locked = tmp_path / "locked"
    (locked / "pginstall" / "bin").mkdir(parents=True)
    locked.chmod(0o700)
    real = EmbeddedPostgres._bin
    for name in ("initdb", "postgres", "pg_isready"):
        (locked / "pginstall" / "bin" / name).symlink_to(real(name))
    monkeypatch.setattr(
        EmbeddedPostgres, "_bin", staticmethod(lambda name: locked / "pginstall" / "bin" / name)
    )
    watched = [*locked.parents, locked]
    before = modes(watched)
    server = EmbeddedPostgres(tmp_path / "data")
    try:
        with pytest.raises(EmbeddedError) as caught:
            server.start()
    finally:
        server.stop()
    # the first directory on the way that is closed to others: `locked`, or one above it
    # (pytest's own base directory is mode 0700 too)
    closed = next(d for d in [*reversed(locked.parents), locked] if not d.stat().st_mode & 0o001)
    message = str(caught.value)
    assert f"cannot reach {locked / 'pginstall' / 'bin' / 'initdb'}" in message
    assert f"{closed} is {before[closed]} root:root" in message
    assert f"chmod o+x {closed})" in message
    assert modes(watched) == before
