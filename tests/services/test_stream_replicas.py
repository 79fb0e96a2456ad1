"""How many replicas `init-streams` gives the streams and buckets: NATS_STREAM_REPLICAS
when set, else what the server reports (1 on a single server, the cluster's size up to
3 on a cluster), and never a change to a stream that exists. A server that refuses the
count ends in an error naming NATS_STREAM_REPLICAS."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from app.adapters.bus import JetStreamBus, ReplicasRefused
from app.adapters.kv_ledger import bucket as ledger_bucket
from app.cli import main
from app.domain.jobs import EVENTS_STREAM, STREAMS
from app.domain.nats_servers import NatsServers
from app.services.streams import derive_replicas, init_streams
from app.settings import Settings
from tests.support.jobs_world import own_nats
from tests.support.nats_cluster import has_meta_leader, running_cluster
from tests.support.polling import eventually

NOT_CLUSTERED = "replicas > 1 not supported in non-clustered mode"
ALL_STREAMS = [*STREAMS.values(), EVENTS_STREAM, f"KV_{ledger_bucket('free')}"]


@pytest.mark.parametrize(
    ("setting", "cluster", "advertised", "existing", "expected"),
    [
        (None, None, 0, None, 1),  # a single server
        (None, "wm", 3, None, 3),  # a three-server cluster
        (None, "wm", 2, None, 2),  # the small fleet's two
        (None, "wm", 5, None, 3),  # at most 3
        (None, "wm", 1, None, 1),
        (None, "wm", 0, None, 3),  # a cluster that advertises no URLs (no_advertise)
        (None, "wm", 1, 3, 3),  # derivation never lowers an existing stream
        (None, "wm", 3, 1, 1),  # ... nor changes it at all
        (None, None, 0, 2, 2),
        (3, None, 0, None, 3),  # the setting wins, also where the server will refuse it
        (2, "wm", 3, 3, 2),  # ... and changes an existing stream
        (5, "wm", 3, 1, 5),
    ],
)
def test_derive_replicas(
    setting: int | None, cluster: str | None, advertised: int, existing: int | None, expected: int
) -> None:
    got = derive_replicas(setting, cluster=cluster, advertised=advertised, existing=existing)
    assert got == expected


async def _replicas(bus: JetStreamBus) -> dict[str, int]:
    return {name: (await bus._js.stream_info(name)).config.num_replicas for name in ALL_STREAMS}


async def test_production_settings_on_a_single_server_make_r1_streams(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, app_env="production")
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(NatsServers.parse(server.url), name="test-single-r1", timeout=5)
        await bus.connect()
        try:
            assert (bus.cluster_name, bus.advertised_servers) == (None, 0)
            made = dict(await init_streams(bus, settings, tiers=("free",)))
            assert set(made.values()) == {"created"}
            assert set((await _replicas(bus)).values()) == {1}
            again = dict(await init_streams(bus, settings, tiers=("free",)))
            assert set(again.values()) == {"unchanged"}
        finally:
            await bus.drain()


async def test_replicas_a_single_server_refuses_name_the_setting(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, app_env="production", nats_stream_replicas=3)
    with own_nats(tmp_path / "nats") as server:
        bus = JetStreamBus(NatsServers.parse(server.url), name="test-single-r3", timeout=5)
        await bus.connect()
        try:
            with pytest.raises(ReplicasRefused) as refused:
                await init_streams(bus, settings, tiers=("free",))
        finally:
            await bus.drain()
    message = str(refused.value)
    assert "NATS_STREAM_REPLICAS" in message and NOT_CLUSTERED in message, message
    assert "3 replicas" in message, message


def test_init_streams_cli_in_production_on_a_single_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no .env
    monkeypatch.setenv("APP_ENV", "production")
    with own_nats(tmp_path / "nats") as server:
        monkeypatch.setenv("NATS_URL", server.url)
        assert main(["init-streams", "--tier", "C"]) == 0, capsys.readouterr().err
        assert "created    stream MM_WRITE" in capsys.readouterr().out
        monkeypatch.setenv("NATS_STREAM_REPLICAS", "3")  # now the streams exist with R1
        assert main(["init-streams", "--tier", "C"]) == 1
    err = capsys.readouterr().err
    assert "NATS_STREAM_REPLICAS" in err and NOT_CLUSTERED in err, err
    assert "Traceback" not in err


async def test_a_three_server_cluster_gets_three_replicas_and_keeps_existing_ones(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path / "nats") as cluster:
        await eventually(functools.partial(has_meta_leader, cluster.urls), within=60)
        bus = JetStreamBus(NatsServers.parse(cluster.url), name="test-cluster-r3", timeout=10)
        await bus.connect()
        try:
            assert (bus.cluster_name, bus.advertised_servers) == ("wm-test", 3)
            settings = Settings(_env_file=None, app_env="production")
            await init_streams(bus, settings, tiers=("free",))
            assert set((await _replicas(bus)).values()) == {3}
            # set lower by the operator: derivation leaves it so, the setting changes it
            lowered = settings.model_copy(update={"nats_stream_replicas": 2})
            await init_streams(bus, lowered, tiers=("free",))
            write = STREAMS["write"]
            assert (await _replicas(bus))[write] == 2
            again = dict(await init_streams(bus, settings, tiers=("free",)))
            assert again[f"stream {write}"] == "unchanged"
            assert (await _replicas(bus))[write] == 2
        finally:
            await bus.drain()
