"""What only the start can tell switches a decided component off, with its reason: here an
embedded PostgreSQL that does not start. The registry says so instead of staying
`starting`, and the worker, planned on PostgreSQL's ledger, says where its ledger went."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.adapters.embedded import EmbeddedNats
from app.main import create_app
from app.settings import Settings
from tests.conftest import SettingsFactory, running, runtime_of, worker_of
from tests.support.polling import eventually


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server.url
    server.stop()


def unstartable_postgres(make_settings: SettingsFactory, nats_url: str, **extra: Any) -> Settings:
    settings = make_settings(embedded_services=True, nats_url=nats_url, **extra)
    settings.data_dir.mkdir(parents=True)
    (settings.data_dir / "postgres").write_text("not a data directory\n")
    return settings


async def test_an_embedded_postgres_that_does_not_start_switches_the_registry_off_and_the_worker_to_jetstream(  # noqa: E501
    make_settings: SettingsFactory, nats_url: str
) -> None:
    app = create_app(unstartable_postgres(make_settings, nats_url))
    async with running(app):
        components = runtime_of(app).components
        assert components["postgres"].state == "failing"
        assert "embedded PostgreSQL" in (components["postgres"].last_error or "")
        registry = components["registry"]
        assert (registry.enabled, registry.reason) == (
            False, "PostgreSQL is not running (see the postgres component)",
        )  # fmt: skip
        worker = components["worker"]
        assert worker.enabled
        assert worker.reason.endswith(
            "ledger in the JetStream bucket JOB_LEDGER_C (JOB_LEDGER=auto, and the registry "
            "is not running)"
        ), worker.reason
        assert worker.detail["ledger"] == "jetstream bucket JOB_LEDGER_C"

        # and it runs on that ledger: connected, its topology made
        async def connected() -> bool:
            return worker.state == "ok"

        await eventually(connected, within=30)


async def test_with_job_ledger_postgres_the_worker_is_off_when_postgres_does_not_start(
    make_settings: SettingsFactory, nats_url: str
) -> None:
    app = create_app(unstartable_postgres(make_settings, nats_url, job_ledger="postgres"))
    async with running(app):
        worker = runtime_of(app).components["worker"]
        assert (worker.enabled, worker.reason) == (
            False, "JOB_LEDGER=postgres but the registry is not running",
        )  # fmt: skip
        assert worker_of(app) is None
