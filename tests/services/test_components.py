"""Which components run, decided once from the settings: a table of settings and what each
component is (on or off) and why. Nothing is opened here."""

from __future__ import annotations

from typing import Any

import pytest

from app.services.components import decide_components
from tests.conftest import SettingsFactory

ENDPOINT = "https://backend.example/api"
DB = "postgresql://wm@db.example/wm"
NATS = "nats://nats.example:4222"
MATRIX = {
    "matrix_homeserver": "https://matrix.example",
    "matrix_room_id": "!room:example",
    "matrix_access_token": "syt_secret",
}

ROWS: list[tuple[str, dict[str, Any], bool, str, str, bool]] = [
    # (case, settings, can sign, component, reason contains, enabled)
    ("report without endpoint", {}, False, "report", "reports go to the log", True),
    ("report switched off", {"report_enabled": False}, True, "report", "REPORT_ENABLED=false",
     False),
    ("report without a key", {"node_system_endpoint": ENDPOINT}, False, "report",
     "no NODE_PRIVATE_KEY", False),
    ("report signed", {"node_system_endpoint": ENDPOINT}, True, "report", "signed reports to",
     True),
    ("sync from the backend", {"node_system_endpoint": ENDPOINT}, True, "sync",
     "desired state from https://backend.example", True),
    ("sync without a source", {}, False, "sync", "no NODE_SYSTEM_ENDPOINT (with a key)", False),
    ("sync from a folder", {"desired_state_dir": "/srv/desired"}, False, "sync",
     "from folder /srv/desired", True),
    ("sync switched off", {"sync_enabled": False, "desired_state_dir": "/srv"}, False, "sync",
     "SYNC_ENABLED=false", False),
    ("uptime follows the sync setting", {"sync_enabled": False}, False, "uptime",
     "needs the sync's cluster access", False),
    ("uptime switched off", {"uptime_restart_enabled": False}, False, "uptime",
     "UPTIME_RESTART_ENABLED=false", False),
    ("the uptime record is kept without restarts", {"uptime_restart_enabled": False}, False,
     "uptime_record", "saved every 300 s", True),
    ("postgres from the url", {"database_url": DB}, False, "postgres", "DATABASE_URL is set",
     True),
    ("postgres embedded", {"embedded_services": True}, False, "postgres", "embedded server",
     True),
    ("postgres absent", {}, False, "postgres", "embedded servers are off", False),
    ("registry without database", {}, False, "registry", "capabilities are not registered",
     False),
    ("registry development tier", {"database_url": DB}, False, "registry",
     "NODE_TIER unset: tier C", True),
    ("registry tier A", {"database_url": DB, "node_tier": "A"}, False, "registry",
     "tier A in worker_capabilities", True),
    ("worker without NATS", {}, False, "worker", "no NATS_URL set", False),
    ("worker on the JetStream ledger", {"nats_url": NATS, "node_tier": "B"}, False, "worker",
     "consumer wm-B on MM_ONLINE, MM_OFFLINE, MM_WRITE; 4 job(s) at a time; ledger in the "
     "JetStream bucket JOB_LEDGER_B", True),
    ("worker on the PostgreSQL ledger", {"nats_url": NATS, "database_url": DB}, False,
     "worker", "ledger in PostgreSQL", True),
    ("worker needs its postgres ledger", {"nats_url": NATS, "job_ledger": "postgres"}, False,
     "worker", "JOB_LEDGER=postgres but there is no registry database", False),
    ("self-update without url", {}, False, "self_update", "no SELF_UPDATE_URL set", False),
    ("self-update outside a cluster", {"self_update_url": "https://releases.example/v.json"},
     False, "self_update", "not running in a cluster", False),
    ("self-update in a cluster", {"self_update_url": "https://releases.example/v.json",
     "pod_namespace": "workload-manager"}, False, "self_update",
     "-> workload-manager/workload-manager", True),
    ("alerts without a room", {}, False, "alerts",
     "MATRIX_HOMESERVER, MATRIX_ROOM_ID, MATRIX_ACCESS_TOKEN not set", False),
    ("alerts to a room", MATRIX, False, "alerts", "Matrix room !room:example on", True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "can_sign", "name", "reason", "enabled"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_each_component_is_decided_once_from_the_settings(
    make_settings: SettingsFactory,
    settings: dict[str, Any],
    can_sign: bool,
    name: str,
    reason: str,
    enabled: bool,
) -> None:
    component = decide_components(make_settings(**settings), can_sign=can_sign)[name]
    assert (component.enabled, reason in component.reason) == (enabled, True), component.reason


def test_every_component_is_decided_and_the_api_and_scheduler_are_critical(
    make_settings: SettingsFactory,
) -> None:
    components = decide_components(make_settings(), can_sign=False)
    assert sorted(components) == sorted(
        ["api", "scheduler", "report", "postgres", "nats", "sync", "registry", "worker",
         "uptime", "uptime_record", "self_update", "alerts"]
    )  # fmt: skip
    assert {n for n, c in components.items() if c.critical} == {"api", "scheduler"}
    assert all(c.name == n for n, c in components.items())
