"""Which components run, decided once from the settings: a table of settings and what each
component is (on or off) and why, a table of the configs the openers get, and the
worker's ledger as the start decides it. Nothing is opened here."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from app.domain.http_targets import AllowedTargets
from app.domain.rollout import UpdateWindow
from app.services.features import FEATURES, Plan, decide
from app.services.features.base import Off, On
from app.services.features.deps import Deps
from app.services.features.sync import BackendSourceConfig, FolderSourceConfig
from app.services.features.worker import WORKER, WorkerPlan, choose_ledger, worker_reason
from app.settings import Settings
from tests.conftest import SettingsFactory


def decide_components(settings: Settings, *, can_sign: bool) -> dict[str, Any]:
    return decide(settings, can_sign=can_sign).components()


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
    ("uptime follows the sync's source", {}, False, "uptime",
     "the sync is off (no NODE_SYSTEM_ENDPOINT (with a key) and no DESIRED_STATE_DIR", False),
    ("uptime with a sync", {"desired_state_dir": "/srv"}, False, "uptime",
     "rollout-restarts managed workloads", True),
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
    ("sync over plain http names the risk", {"node_system_endpoint": "http://backend.example"},
     True, "sync", "NODE_SYSTEM_ENDPOINT is plain http: anyone on the path can change the "
     "desired state", True),
    ("report over plain http, accepted", {"node_system_endpoint": "http://backend.example",
     "allow_plain_http": "NODE_SYSTEM_ENDPOINT"}, True, "report",
     "NODE_SYSTEM_ENDPOINT is plain http (accepted by ALLOW_PLAIN_HTTP)", True),
    ("a loopback backend over http is no risk", {"node_system_endpoint": "http://127.0.0.1:8"},
     True, "sync", "desired state from http://127.0.0.1:8", True),
    ("self-update over plain http without a key names the risk",
     {"self_update_url": "http://releases.example/v.json", "pod_namespace": "wm"}, False,
     "self_update", "anyone on the path can pick the manager's own image", True),
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


def test_readiness_includes_the_connections_the_settings_turn_on(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(database_url=DB, nats_url=NATS, desired_state_dir="/srv", **MATRIX)
    components = decide_components(settings, can_sign=True)
    critical = {n for n, c in components.items() if c.critical}
    assert critical == {"api", "scheduler", "postgres", "registry", "nats", "worker"}
    assert all(c.name == n for n, c in components.items())


SELF_UPDATE = {"self_update_url": "https://releases.example/v.json", "pod_namespace": "wm"}

CONFIGS: list[tuple[str, dict[str, Any], bool, str, Any]] = [
    # (case, settings, can sign, what of the plan, expected)
    ("the backend is the source when it can be signed for",
     {"node_system_endpoint": ENDPOINT, "desired_state_dir": "/srv"}, True,
     "sync.config.source", BackendSourceConfig(ENDPOINT)),
    ("the folder when the backend cannot be signed for",
     {"node_system_endpoint": ENDPOINT, "desired_state_dir": "/srv"}, False,
     "sync.config.source", FolderSourceConfig(Path("/srv"))),
    ("no backend client without a key", {"node_system_endpoint": ENDPOINT}, False,
     "backend", None),
    ("the own Deployment is protected among the workloads", {"desired_state_dir": "/srv"},
     False, "sync.config.policy.protected", frozenset({"workload-manager"})),
    ("and not when the manager lives elsewhere",
     {"desired_state_dir": "/srv", "pod_namespace": "workload-manager"}, False,
     "sync.config.policy.protected", frozenset()),
    ("the manifest policy's level", {"desired_state_dir": "/srv",
     "manifest_policy": "restricted"}, False, "sync.config.manifest_policy.level", "restricted"),
    ("reports to the log without an endpoint", {}, False, "report.config.to_backend", False),
    ("reports to the backend", {"node_system_endpoint": ENDPOINT}, True,
     "report.config.to_backend", True),
    ("PostgreSQL's ledger with a database", {"nats_url": NATS, "database_url": DB}, False,
     "worker.config.ledger", "postgres"),
    ("auto may fall back", {"nats_url": NATS, "database_url": DB}, False,
     "worker.config.ledger_fallback", True),
    ("postgres may not", {"nats_url": NATS, "database_url": DB, "job_ledger": "postgres"},
     False, "worker.config.ledger_fallback", False),
    ("JetStream's ledger when asked", {"nats_url": NATS, "database_url": DB,
     "job_ledger": "jetstream"}, False, "worker.config.ledger", "jetstream"),
    ("JetStream's ledger without a database", {"nats_url": NATS}, False,
     "worker.config.ledger", "jetstream"),
    ("the worker's tier", {"nats_url": NATS, "node_tier": "A"}, False,
     "worker.config.worker.tier", "A"),
    ("HTTP jobs reach the managed namespace by default", {"nats_url": NATS}, False,
     "worker.config.http_allowed_targets", AllowedTargets.namespace("workloads")),
    ("the topology's ledger TTL follows the stream's age", {"nats_url": NATS,
     "nats_stream_max_age_seconds": 3600}, False, "worker.config.topology.ledger_ttl_seconds",
     3600.0),
    ("streams are made in development", {"nats_url": NATS}, False,
     "worker.config.auto_init_streams", True),
    ("migrations run in development", {"database_url": DB}, False,
     "registry.config.migrate_on_start", True),
    ("and not when switched off", {"database_url": DB, "migrate_on_start": False}, False,
     "registry.config.migrate_on_start", False),
    ("the self-update's namespace", SELF_UPDATE, False, "self_update.config.namespace", "wm"),
    ("the self-update's window", {**SELF_UPDATE, "self_update_window": "02:00-04:00"}, False,
     "self_update.config.policy.window", UpdateWindow(start="02:00", end="04:00")),
    ("the self-update's window in a workload's form", {**SELF_UPDATE, "self_update_window":
     '{"days": ["sun"], "start": "02:00", "end": "04:00", "tz": "Europe/Kyiv"}'}, False,
     "self_update.config.policy.window",
     UpdateWindow(days=("sun",), start="02:00", end="04:00", tz="Europe/Kyiv")),
    ("the uptime record's ConfigMap namespace", {"pod_namespace": "wm"}, False,
     "uptime_record.config.config_map_namespace", "wm"),
    ("the book is watched at half the stale time", {"ping_stale_seconds": 10}, False,
     "watch_every", 5.0),
    ("at most every 15 s", {}, False, "watch_every", 15.0),
    ("the matrix token", MATRIX, False, "alerts.config.token.get_secret_value", "syt_secret"),
]  # fmt: skip


BY_NAME = {spec.name: spec for spec in FEATURES}


def _path(plan: Plan, path: str) -> Any:
    """A feature's decision by its name, or what the features share, and a path in it."""
    first, *rest = path.split(".")
    value: Any = plan.of(BY_NAME[first]) if first in BY_NAME else getattr(plan.shared, first)
    for part in rest:
        value = getattr(value, part)
    return value() if callable(value) else value


@pytest.mark.parametrize(
    ("settings", "can_sign", "path", "expected"),
    [row[1:] for row in CONFIGS],
    ids=[row[0] for row in CONFIGS],
)
def test_each_component_gets_its_config_from_the_decision(
    make_settings: SettingsFactory, settings: dict[str, Any], can_sign: bool, path: str,
    expected: Any,
) -> None:  # fmt: skip
    assert _path(decide(make_settings(**settings), can_sign=can_sign), path) == expected


LEDGERS: list[tuple[str, str, bool, bool, str]] = [
    # (case, planned home, may fall back, registry running, chosen: home or "off")
    ("postgres with the registry", "postgres", True, True, "postgres"),
    ("auto falls back to JetStream without it", "postgres", True, False, "jetstream"),
    ("JOB_LEDGER=postgres without it is off", "postgres", False, False, "off"),
    ("JetStream whatever runs", "jetstream", True, True, "jetstream"),
    ("JetStream without a registry", "jetstream", False, False, "jetstream"),
]


@pytest.mark.parametrize(
    ("home", "fallback", "running", "chosen"),
    [row[1:] for row in LEDGERS],
    ids=[row[0] for row in LEDGERS],
)
def test_the_worker_s_ledger_as_the_start_finds_the_registry(
    make_settings: SettingsFactory, home: str, fallback: bool, running: bool, chosen: str
) -> None:
    decision = decide(make_settings(nats_url=NATS, database_url=DB), can_sign=False).of(WORKER)
    assert isinstance(decision, On)
    plan: WorkerPlan = decision.config
    plan = WorkerPlan(**{**plan.__dict__, "ledger": home, "ledger_fallback": fallback})
    result = choose_ledger(plan, registry_running=running)
    assert (result.reason if isinstance(result, Off) else result) == (
        "JOB_LEDGER=postgres but the registry is not running" if chosen == "off" else chosen
    )


def test_no_feature_is_opened_with_the_settings() -> None:
    """Each feature is opened with its config and what the others provide; the settings
    are read once, by `decide`, so no component can be switched on twice."""
    assert len(FEATURES) >= 10
    for spec in FEATURES:
        signature = inspect.signature(spec.open)
        annotations = [str(p.annotation) for p in signature.parameters.values()]
        assert not [a for a in annotations if "Settings" in a], spec.name
    fields = [str(f.type) for f in dataclasses.fields(Deps)]
    assert not [f for f in fields if "Settings" in f]


def test_a_worker_that_fell_back_says_where_its_ledger_is(make_settings: SettingsFactory) -> None:
    decision = decide(make_settings(nats_url=NATS, database_url=DB), can_sign=False).of(WORKER)
    assert isinstance(decision, On)
    assert decision.reason.endswith("ledger in PostgreSQL")
    fell_back = worker_reason(decision.config, "jetstream")
    assert fell_back.endswith(
        "ledger in the JetStream bucket JOB_LEDGER_C (JOB_LEDGER=auto, and the registry is "
        "not running)"
    )
