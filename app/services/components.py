"""The components of the manager, decided once from the settings: each is on, with what it
will do, or off, with why (`/v1/status` shows both). The composition root
(`app/services/runtime.py`) opens what is on; table-tested in tests/services/test_components.py.
"""

from __future__ import annotations

from app.domain.components import Component, ComponentState
from app.domain.redaction import redact_url
from app.domain.uptime import SAVE_EVERY_SECONDS
from app.settings import Settings


def decide_components(settings: Settings, *, can_sign: bool) -> dict[str, Component]:
    """Every component, on or off, and why, from the settings alone (and whether there is
    a node key to sign with). What happens at start (a cluster that cannot be reached, a
    registry that is not running) may switch an enabled one off later, with its reason."""
    report_reason: str
    report_enabled = settings.report_enabled
    if not settings.report_enabled:
        report_reason = "switched off by REPORT_ENABLED=false"
    elif settings.node_system_endpoint is None:
        report_reason = "no NODE_SYSTEM_ENDPOINT: reports go to the log and /v1/status"
    elif not can_sign:
        report_enabled = False
        report_reason = (
            "NODE_SYSTEM_ENDPOINT is set but there is no NODE_PRIVATE_KEY, "
            "NODE_PRIVATE_KEY_FILE or ~/.config/lfgnode/config.yaml (NODE_CONFIG_FILE) "
            "to sign with"
        )
    else:
        report_reason = f"signed reports to {redact_url(settings.node_system_endpoint)}"
    embedded = settings.embedded_services and not settings.is_production

    def data_service(name: str, configured: str | None, variable: str) -> Component:
        if configured is not None:
            return Component(name, True, f"{variable} is set")
        if embedded:
            return Component(name, True, f"embedded server (no {variable} set)")
        return Component(name, False, f"no {variable} set and embedded servers are off")

    database = settings.database_url.get_secret_value() if settings.database_url else None
    return {
        "api": Component("api", True, "serving", critical=True, state=ComponentState.OK),
        "scheduler": Component("scheduler", True, "runs the periodic loops", critical=True),
        "report": Component("report", report_enabled, report_reason),
        "postgres": data_service("postgres", database, "DATABASE_URL"),
        "nats": data_service("nats", settings.nats_url, "NATS_URL"),
        "sync": _sync_component(settings, can_sign=can_sign),
        "registry": _registry_component(settings, database, embedded),
        "worker": _worker_component(settings, database, embedded),
        "uptime": _uptime_component(settings),
        "uptime_record": _uptime_record_component(),
        "self_update": _self_update_component(settings),
        "alerts": _alerts_component(settings),
    }


def _alerts_component(settings: Settings) -> Component:
    missing = [
        name
        for name, value in (
            ("MATRIX_HOMESERVER", settings.matrix_homeserver),
            ("MATRIX_ROOM_ID", settings.matrix_room_id),
            ("MATRIX_ACCESS_TOKEN", settings.matrix_access_token),
        )
        if value is None
    ]
    if missing:
        return Component("alerts", False, f"{', '.join(missing)} not set: alerts go to the log")
    return Component(
        "alerts",
        True,
        f"Matrix room {settings.matrix_room_id} on {redact_url(settings.matrix_homeserver or '')}",
    )


def _registry_component(settings: Settings, database: str | None, embedded: bool) -> Component:
    if not settings.registry_enabled:
        return Component("registry", False, "switched off by REGISTRY_ENABLED=false")
    if database is None and not embedded:
        return Component(
            "registry", False,
            "no DATABASE_URL (or CAPABILITY_REGISTRY) set: capabilities are not registered; "
            "jobs are matched against this node's own profile",
        )  # fmt: skip
    tier = settings.tier
    reason = f"tier {tier.value} in worker_capabilities, heartbeat every "
    reason += f"{settings.heartbeat_interval_seconds:g} s"
    if settings.node_tier is None:
        reason += " (NODE_TIER unset: tier C for development)"
    return Component("registry", True, reason)


def _worker_component(settings: Settings, database: str | None, embedded: bool) -> Component:
    if not settings.worker_enabled:
        return Component("worker", False, "switched off by WORKER_ENABLED=false")
    if settings.nats_url is None and not embedded:
        return Component("worker", False, "no NATS_URL set")
    has_database = settings.registry_enabled and (database is not None or embedded)
    if settings.job_ledger == "postgres" and not has_database:
        return Component("worker", False, "JOB_LEDGER=postgres but there is no registry database")
    on_postgres = has_database and settings.job_ledger != "jetstream"
    tier = settings.tier.value
    ledger = (
        "ledger in PostgreSQL"
        if on_postgres
        else f"ledger in the JetStream bucket JOB_LEDGER_{tier}"
    )
    return Component(
        "worker",
        True,
        f"consumer wm-{tier} on MM_ONLINE, MM_OFFLINE, MM_WRITE; "
        f"{settings.worker_concurrency} job(s) at a time; {ledger}",
    )


def _self_update_component(settings: Settings) -> Component:
    if not settings.self_update_enabled:
        return Component("self_update", False, "switched off by SELF_UPDATE_ENABLED=false")
    if settings.self_update_url is None:
        return Component("self_update", False, "no SELF_UPDATE_URL set")
    if settings.pod_namespace is None:
        return Component(
            "self_update",
            False,
            "not running in a cluster (no POD_NAMESPACE from the downward API)",
        )
    return Component(
        "self_update",
        True,
        f"{redact_url(settings.self_update_url)} -> "
        f"{settings.pod_namespace}/{settings.self_deployment_name}",
    )


def _sync_component(settings: Settings, *, can_sign: bool) -> Component:
    if not settings.sync_enabled:
        return Component("sync", False, "switched off by SYNC_ENABLED=false")
    if settings.node_system_endpoint and can_sign:
        source = redact_url(settings.node_system_endpoint)
        return Component("sync", True, f"desired state from {source}")
    if settings.desired_state_dir is not None:
        return Component("sync", True, f"desired state from folder {settings.desired_state_dir}")
    return Component(
        "sync", False, "no NODE_SYSTEM_ENDPOINT (with a key) and no DESIRED_STATE_DIR to sync from"
    )


def _uptime_record_component() -> Component:
    return Component(
        "uptime_record",
        True,
        "counts each workload's share of time healthy (24 h, 7 d), saved every "
        f"{SAVE_EVERY_SECONDS:.0f} s and at shutdown",
    )


def _uptime_component(settings: Settings) -> Component:
    if not settings.uptime_restart_enabled:
        return Component("uptime", False, "switched off by UPTIME_RESTART_ENABLED=false")
    return Component(
        "uptime", settings.sync_enabled,
        "rollout-restarts managed workloads unhealthy or stale for longer than "
        f"{settings.uptime_restart_after_seconds:.0f} s" if settings.sync_enabled
        else "needs the sync's cluster access (SYNC_ENABLED=false)",
    )  # fmt: skip
