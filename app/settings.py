"""The manager's configuration: one Settings object, read once from the environment.

Environment names are a public contract (the node CLI and the fleet's manifests set
them), so fields are flat and named after their variables. Secrets are SecretStr and
never leave this module in clear text except through `.get_secret_value()` at the
point of use. `check_production()` turns a missing or placeholder value into one
clear line naming the variable.
"""

from __future__ import annotations

import json
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AliasChoices,
    Field,
    InstanceOf,
    PlainSerializer,
    SecretStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.domain.desired_trust import DEVELOPMENT_PUBLIC_KEY, DesiredKeys
from app.domain.http_targets import AllowedTargets
from app.domain.nats_servers import NatsServers
from app.domain.requirements import CAPABILITY_NAME, LOCATION_NAME, Tier
from app.domain.retrying import RETRY_AFTER_CEILING
from app.domain.rollout import UpdateWindow
from app.domain.updates import VersionFileKey, signature_needs_own_url

# Where the original (Express) service kept the node's key (`Settings.node_config_path`):
# used when neither NODE_PRIVATE_KEY nor NODE_PRIVATE_KEY_FILE is set, NODE_CONFIG_FILE is
# not set either, and the file exists.
NODE_CONFIG_DEFAULT = Path("~/.config/lfgnode/config.yaml")

PLACEHOLDERS = frozenset(
    {"", "changeme", "change-me", "change_me", "placeholder", "todo", "xxx", "secret", "example"}
)


class AppEnv(StrEnum):
    DEVELOPMENT = "development"
    PRODUCTION = "production"


class SettingsError(ValueError):
    """A configuration problem; the message is one line naming the variable."""


def _ranged(default: float, low: float, high: float) -> Any:
    return Field(default=default, ge=low, le=high)


# Values parsed once, into the domain's types, which the components take as they are;
# dumped as the environment gives them (the servers redacted)
ServersSetting = Annotated[InstanceOf[NatsServers], PlainSerializer(str, return_type=str)]
TargetsSetting = Annotated[
    InstanceOf[AllowedTargets], PlainSerializer(AllowedTargets.entries, return_type=list[str])
]
KeySetting = Annotated[InstanceOf[VersionFileKey], PlainSerializer(str, return_type=str)]
DesiredKeysSetting = Annotated[InstanceOf[DesiredKeys], PlainSerializer(str, return_type=str)]
WindowSetting = Annotated[
    InstanceOf[UpdateWindow], PlainSerializer(UpdateWindow.model_dump_json, return_type=str)
]
_NAMES = TypeAdapter(list[str])


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        case_sensitive=False,
        populate_by_name=True,
    )

    # --- process
    app_env: AppEnv = AppEnv.DEVELOPMENT
    host: str = "0.0.0.0"  # pods on the node ping it
    port: Annotated[int, Field(ge=1, le=65535)] = 8080
    log_level: str = "INFO"
    log_format: str = Field(default="auto", pattern="^(auto|json|text)$")
    data_dir: Path = Path(".data")
    shutdown_grace_seconds: float = _ranged(20.0, 0.0, 600.0)
    # a component failing this long (NATS lost, PostgreSQL down) raises one alert, and one
    # when it recovers
    component_down_grace_seconds: float = _ranged(60.0, 1.0, 3_600.0)
    # HTTP server bounds: any pod on the node can connect, so a request head is bounded in
    # size and time, and the connections held at once are capped, for the node and for
    # each client address
    http_max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1024 * 1024)
    http_header_timeout_seconds: float = _ranged(10.0, 0.1, 300.0)
    http_body_timeout_seconds: float = _ranged(10.0, 0.1, 300.0)
    http_keepalive_timeout_seconds: float = _ranged(5.0, 0.1, 300.0)
    http_max_connections: int = Field(default=1_000, ge=8, le=100_000)
    http_max_connections_per_client: int = Field(default=64, ge=1, le=100_000)
    # a second port that answers only /healthz and /readyz, outside those caps: the
    # kubelet's probes are answered while pods hold every connection of PORT (the
    # manifests set it; the NetworkPolicy opens it to no pod)
    probe_port: Annotated[int, Field(ge=1, le=65535)] | None = None

    # --- identity and backend
    node_id: str | None = None
    node_system_endpoint: str | None = None
    node_private_key: SecretStr | None = None
    node_private_key_file: Path | None = None
    node_config_file: Path | None = None  # None: NODE_CONFIG_DEFAULT, if that file exists
    backend_timeout_seconds: float = _ranged(10.0, 0.1, 120.0)
    backend_retry_attempts: int = Field(default=3, ge=1, le=10)
    backend_retry_max_wait_seconds: float = _ranged(5.0, 0.0, 60.0)
    # one call to the backend, all its attempts and waits included, ends within this
    backend_deadline_seconds: float = _ranged(30.0, 0.5, 600.0)
    backend_max_response_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    # the longest a Retry-After (of the backend, or of the version file's server) puts a
    # loop off; a small positive jitter goes on top (docs/backend-api.md)
    retry_after_max_seconds: float = _ranged(3_600.0, 1.0, RETRY_AFTER_CEILING)

    # --- API
    api_token: SecretStr | None = None
    ping_token_secret: SecretStr | None = None
    ping_max_body_bytes: int = Field(default=16 * 1024, ge=256, le=1024 * 1024)
    ping_fast_path: bool = True
    status_page_refresh_seconds: int = Field(default=10, ge=1, le=3_600)
    ping_stale_seconds: float = _ranged(30.0, 1.0, 86_400.0)
    ping_forget_seconds: float = _ranged(3_600.0, 10.0, 7 * 86_400.0)
    max_tracked_workloads: int = Field(default=500, ge=1, le=100_000)

    # --- loops
    report_enabled: bool = True
    report_interval_seconds: float = _ranged(60.0, 0.2, 86_400.0)
    sync_interval_seconds: float = _ranged(600.0, 1.0, 86_400.0)
    # the bounds of the intervals the backend may ask for (X-Report-Interval-Seconds,
    # X-Sync-Interval-Seconds); without the header the loop keeps its interval above
    report_interval_min_seconds: float = _ranged(30.0, 0.2, 86_400.0)
    report_interval_max_seconds: float = _ranged(900.0, 0.2, 86_400.0)
    sync_interval_min_seconds: float = _ranged(60.0, 1.0, 86_400.0)
    sync_interval_max_seconds: float = _ranged(3_600.0, 1.0, 86_400.0)
    # one sync, every backend call and cluster write of it, ends within this
    sync_deadline_seconds: float = _ranged(300.0, 1.0, 86_400.0)
    heartbeat_interval_seconds: float = _ranged(30.0, 0.2, 3_600.0)
    self_update_enabled: bool = True
    self_update_url: str | None = None
    self_update_interval_seconds: float = _ranged(900.0, 1.0, 86_400.0)
    self_image_repository: str = "ghcr.io/node-system/workload-manager"
    self_container_name: str = "manager"
    self_update_allow_prerelease: bool = False
    # `HH:MM-HH:MM` (UTC, every day) or a workload's window as JSON: {"days", "start",
    # "end", "tz"} (app/domain/rollout.py); it gates the start of an update only
    self_update_window: Annotated[WindowSetting | None, NoDecode] = None
    self_update_deadline_seconds: float = _ranged(300.0, 1.0, 3_600.0)
    # once available, the new pod must stay so this long to be confirmed (0: at once)
    self_update_min_healthy_seconds: float = _ranged(60.0, 0.0, 3_600.0)
    self_update_poll_seconds: float = _ranged(5.0, 0.05, 60.0)
    self_update_timeout_seconds: float = _ranged(10.0, 0.1, 120.0)
    # an S3-compatible store for an s3:// SELF_UPDATE_URL (default: AWS's regional endpoint)
    self_update_s3_endpoint: str | None = None
    # an Ed25519 public key (base64 of the 32 raw bytes, or PEM): when set, the version file
    # must carry a valid signature by it, checked before anything is decided
    self_update_public_key: Annotated[KeySetting | None, NoDecode] = None
    # where the signature is, when not beside the file (a presigned SELF_UPDATE_URL)
    self_update_signature_url: str | None = None
    scheduler_jitter_fraction: float = _ranged(0.1, 0.0, 0.5)
    # the first heartbeat, report, sync, self-update check and worker connection each come
    # up to this much later (a random share of it), so a fleet started together spreads
    # its calls; unset: 30 in production, 0 in development (`startup_spread`)
    startup_spread_seconds: float | None = Field(default=None, ge=0.0, le=3_600.0)

    # --- cluster and desired state
    kubeconfig: Path | None = None
    managed_namespace: str = Field(default="workloads", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    desired_state_dir: Path | None = None
    # the backend's Ed25519 public keys (comma-separated; several during a rotation): when
    # set, a desired state is taken only signed by one of them for this node, in serial
    # order, and the last good one is kept on the node and enforced while the backend is
    # away (docs/security.md "The desired state's signature")
    desired_state_public_keys: Annotated[DesiredKeysSetting | None, NoDecode] = None
    # a signed state (the store's form) that seeds an empty store at the first boot
    desired_state_preload: Path | None = None
    # the store's byte budget (a ConfigMap holds 1 MiB, its metadata included)
    desired_state_store_bytes: int = Field(default=900 * 1024, ge=16 * 1024, le=1_000_000)
    sync_enabled: bool = True
    sync_concurrency: int = Field(default=4, ge=1, le=64)
    sync_max_deletes: int = Field(default=5, ge=0, le=10_000)
    sync_max_delete_percent: float = _ranged(50.0, 0.0, 100.0)
    cluster_refresh_seconds: float = _ranged(15.0, 1.0, 3_600.0)
    # safe rollout of workload updates (app/domain/rollout.py): the defaults a desired
    # workload's `update` overrides, and how often an update in flight is looked at
    workload_update_judge: Literal["auto", "pings", "rollout", "off"] = "auto"
    workload_update_min_healthy_seconds: float = _ranged(60.0, 2.0, 3_600.0)
    workload_update_deadline_seconds: float = _ranged(600.0, 10.0, 86_400.0)
    workload_update_unhealthy_seconds: float = _ranged(60.0, 1.0, 86_400.0)
    workload_update_revert: bool = True
    # when workload updates may start: `HH:MM-HH:MM` (UTC) or the JSON window object
    workload_update_window: Annotated[WindowSetting | None, NoDecode] = None
    update_defer_max_seconds: float = _ranged(3_600.0, 0.0, 7 * 86_400.0)
    update_defer_step_seconds: float = _ranged(600.0, 1.0, 86_400.0)
    update_judge_interval_seconds: float = _ranged(5.0, 0.2, 300.0)
    # uptime management: rollout restarts of managed workloads that stay bad
    uptime_restart_enabled: bool = True
    uptime_restart_after_seconds: float = _ranged(180.0, 10.0, 86_400.0)
    uptime_restart_backoff_seconds: float = _ranged(300.0, 10.0, 86_400.0)
    uptime_restart_backoff_max_seconds: float = _ranged(3_600.0, 10.0, 86_400.0)
    uptime_restarts_per_workload_per_hour: int = Field(default=3, ge=0, le=100)
    uptime_restarts_per_node_per_hour: int = Field(default=10, ge=0, le=1_000)
    kube_timeout_seconds: float = _ranged(10.0, 0.1, 120.0)
    manager_url: str = "http://workload-manager.workload-manager.svc:8080"
    self_deployment_name: str = "workload-manager"
    pod_namespace: str | None = None
    allow_privileged: bool = False
    allow_host_namespaces: bool = False
    allow_host_path: bool = False
    allow_host_ports: bool = False
    # the Pod Security Standard every manifest must meet: baseline, or restricted (opt-in)
    manifest_policy: str = Field(default="baseline", pattern="^(baseline|restricted)$")
    manifest_max_replicas: int = Field(default=10, ge=1, le=1_000)
    manifest_max_bytes: int = Field(default=64 * 1024, ge=1024, le=1024 * 1024)
    max_desired_workloads: int = Field(default=200, ge=1, le=10_000)

    # --- data plane
    database_url: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("DATABASE_URL", "CAPABILITY_REGISTRY")
    )
    # what `migrate` connects to instead, when set: straight to PostgreSQL past a pooler
    # (a migration is one long DDL transaction that may wait minutes on the advisory lock
    # for the other nodes' migrators: a pooler's timeouts, its pool shared with the fleet's
    # heartbeats and prepared statements in transaction mode are in its way)
    database_migrate_url: SecretStr | None = None
    # what DATABASE_URL reaches: PostgreSQL itself, or PgBouncer in transaction mode (each
    # transaction may run on another server connection: asyncpg's statement cache off, and
    # nothing kept in a session; `migrate` then needs DATABASE_MIGRATE_URL)
    database_pooler: Literal["none", "pgbouncer-transaction"] = "none"
    database_timeout_seconds: float = _ranged(5.0, 0.1, 120.0)
    database_pool_size: int = Field(default=4, ge=1, le=100)
    migrate_on_start: bool | None = None
    migrations_dir: Path | None = None
    # one server, or several comma-separated
    nats_url: Annotated[ServersSetting | None, NoDecode] = None
    # NATS credentials besides a user:password or token in NATS_URL: a creds file (JWT and
    # nkey seed), an nkey seed file, and TLS (a CA to trust, a client certificate and key)
    nats_creds_file: Path | None = None
    nats_nkey_seed_file: Path | None = None
    nats_tls_ca_file: Path | None = None
    nats_tls_cert_file: Path | None = None
    nats_tls_key_file: Path | None = None
    embedded_services: bool = True
    # reconnecting: before attempt n a wait drawn from [0, min(max, base x 2^n)) (full
    # jitter), forever; a server in lame duck mode is left after a draw from [0, spread)
    nats_reconnect_base_seconds: float = _ranged(1.0, 0.01, 60.0)
    nats_reconnect_max_seconds: float = _ranged(30.0, 0.1, 600.0)
    nats_lame_duck_spread_seconds: float = _ranged(10.0, 0.0, 600.0)

    # --- job worker (NATS JetStream)
    worker_enabled: bool = True
    worker_concurrency: int = Field(default=4, ge=1, le=256)
    job_fetch_batch: int = Field(default=10, ge=1, le=256)
    # how long an idle stream's pull waits on the server for a job (one arriving is
    # delivered at once, whatever the wait; the stop and a lost connection cut it short)
    worker_pull_wait_seconds: float = _ranged(30.0, 1.0, 300.0)
    job_ack_wait_seconds: float = _ranged(30.0, 1.0, 3_600.0)
    # the retry budget: attempts at running a job (claims counted by the ledger), not
    # JetStream deliveries, which hand-ons to capable nodes and outages also spend
    job_max_attempts: int = Field(
        default=5, ge=1, le=1_000,
        validation_alias=AliasChoices("JOB_MAX_ATTEMPTS", "JOB_MAX_DELIVER"),
    )  # fmt: skip
    # the bound on deliveries of one message, whatever they were spent on: past it the job
    # is dead-lettered (a job no node can take would otherwise circulate until max age)
    job_max_deliveries: int = Field(default=1_000, ge=10, le=100_000)
    job_backoff_seconds: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5.0, 30.0, 120.0, 600.0]
    )
    job_max_ack_pending: int = Field(default=1_000, ge=1, le=1_000_000)
    # pull requests a tier's consumer lets wait at once: every idle node of the tier keeps
    # one waiting (JetStream's default, 512, refuses the 513th with 409); fixed when the
    # consumer is made (nats-server cannot change it)
    job_consumer_max_waiting: int = Field(default=20_000, ge=1, le=1_000_000)
    job_not_here_delay_seconds: float = _ranged(2.0, 0.1, 3_600.0)
    job_held_delay_seconds: float = _ranged(10.0, 0.1, 3_600.0)
    job_timeout_seconds: float = _ranged(600.0, 0.1, 86_400.0)
    job_stream_retention: str = Field(default="workqueue", pattern="^(workqueue|limits)$")
    # where the idempotency ledger lives: PostgreSQL when there is a database (auto), else
    # the tier's JetStream bucket JOB_LEDGER_<tier>; every node of a tier must use the same one
    job_ledger: str = Field(default="auto", pattern="^(auto|postgres|jetstream)$")
    # how long the JetStream ledger remembers a finished key (default: the streams' max age,
    # after which no delivery of the job can come)
    job_ledger_ttl_seconds: float | None = Field(default=None, ge=60.0, le=365 * 86_400.0)
    # the streams' and buckets' replicas for `init-streams`; unset: from the server (1 on a
    # single server, the cluster's size up to 3; an existing stream keeps its own)
    nats_stream_replicas: int | None = Field(default=None, ge=1, le=5)
    nats_stream_max_age_seconds: float = _ranged(7 * 86_400.0, 60.0, 365 * 86_400.0)
    nats_duplicate_window_seconds: float = _ranged(120.0, 1.0, 86_400.0)
    nats_auto_init_streams: bool | None = None
    # what the `http` job handler may call: `<namespace>` (any Service in it) or
    # `<service>.<namespace>` (that one), comma-separated; empty (None): MANAGED_NAMESPACE only
    http_job_allowed_targets: Annotated[TargetsSetting | None, NoDecode] = None
    http_job_timeout_seconds: float = _ranged(30.0, 0.1, 3_600.0)

    # --- capability registry
    registry_enabled: bool = True
    node_tier: Tier | None = Field(default=None, validation_alias=AliasChoices("NODE_TIER", "TIER"))
    # the names a job's requirements may use (LOCATION_NAME), within the registry's columns
    node_region: str | None = Field(default=None, max_length=50, pattern=LOCATION_NAME)
    node_trust_zone: str | None = Field(default=None, max_length=50, pattern=LOCATION_NAME)
    node_capabilities: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # settings whose plain http:// production accepts, each a named risk (PLAIN_HTTP_RISKS)
    allow_plain_http: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # --- observability
    sentry_dsn: SecretStr | None = None
    sentry_traces_sample_rate: float = _ranged(0.0, 0.0, 1.0)
    matrix_homeserver: str | None = None
    matrix_room_id: str | None = None
    matrix_access_token: SecretStr | None = None
    alert_window_seconds: float = _ranged(900.0, 1.0, 86_400.0)

    @field_validator("*", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        """`NAME=` (as in .env.example) means "not set" for every optional setting."""
        if isinstance(value, str) and not value.strip() and info.field_name is not None:
            if cls.model_fields[info.field_name].default is None:
                return None
        return value

    @field_validator(
        "node_system_endpoint", "matrix_homeserver", "manager_url", "self_update_s3_endpoint"
    )
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value)

    @field_validator("self_update_public_key", mode="before")
    @classmethod
    def _version_file_key(cls, value: Any) -> Any:
        """Parsed once, into the key the version file is checked with (its ValueError
        names what is expected, never the value); `SELF_UPDATE_PUBLIC_KEY=` is not set."""
        if isinstance(value, str):
            return VersionFileKey.parse(value) if value.strip() else None
        return value

    @field_validator("desired_state_public_keys", mode="before")
    @classmethod
    def _desired_keys(cls, value: Any) -> Any:
        """Parsed once (`DesiredKeys.parse`, never quoting the value); empty is not set."""
        if isinstance(value, str):
            return DesiredKeys.parse(value) if value.strip() else None
        return value

    @field_validator("self_update_window", "workload_update_window", mode="before")
    @classmethod
    def _update_window(cls, value: Any) -> Any:
        """Parsed once (`UpdateWindow.from_setting`); the first problem, on one line."""
        if not isinstance(value, str):
            return value
        if not value.strip():
            return None  # `SELF_UPDATE_WINDOW=` is not set
        try:
            return UpdateWindow.from_setting(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            if first["type"] == "json_invalid":
                what = "is not a JSON object"
            else:
                msg = first["msg"].removeprefix("Value error, ")
                what = f"{where}: {msg}" if where else msg
            raise ValueError(
                f"{what} (expected HH:MM-HH:MM, UTC, or "
                '{"days": [...], "start": "HH:MM", "end": "HH:MM", "tz": "Area/City"})'
            ) from None

    @field_validator("self_update_url", "self_update_signature_url")
    @classmethod
    def _version_file_url(cls, value: str | None) -> str | None:
        """An http(s) URL, or s3://bucket/key (read with AWS credentials)."""
        if value is None:
            return None
        if not value.startswith("s3://"):
            return _http_url(value, also="or s3://bucket/key")
        bucket, _, key = value.removeprefix("s3://").partition("/")
        if not S3_BUCKET.match(bucket) or ".." in bucket or not key:
            raise ValueError(
                "must be s3://bucket/key (a bucket name of 3-63 lowercase letters, digits, "
                "dots and hyphens, and the object's key)"
            )
        return value

    @model_validator(mode="after")
    def _interval_bounds_in_order(self) -> Settings:
        for what in ("report", "sync"):
            low = getattr(self, f"{what}_interval_min_seconds")
            high = getattr(self, f"{what}_interval_max_seconds")
            if low > high:
                name = what.upper()
                raise ValueError(
                    f"{name}_INTERVAL_MIN_SECONDS ({low:g}) is above "
                    f"{name}_INTERVAL_MAX_SECONDS ({high:g})"
                )
        return self

    @model_validator(mode="after")
    def _probe_port_of_its_own(self) -> Settings:
        if self.probe_port is not None and self.probe_port == self.port:
            raise ValueError(
                f"PROBE_PORT is PORT ({self.port}): the probes need a port of their own"
            )
        return self

    @model_validator(mode="after")
    def _pooler_needs_a_database(self) -> Settings:
        if self.database_pooler == "none":
            return self
        if self.database_url is None:
            raise ValueError(
                f"DATABASE_POOLER={self.database_pooler} is set but DATABASE_URL is not: the "
                "pooler describes the way to DATABASE_URL (an embedded PostgreSQL has none)"
            )
        if self.migrates_on_start and self.migrate_through_pooler:
            raise ValueError(
                f"migrations at start (MIGRATE_ON_START, on by default outside production) "
                f"would go through DATABASE_POOLER={self.database_pooler}: set "
                "DATABASE_MIGRATE_URL straight to PostgreSQL, or MIGRATE_ON_START=false"
            )
        return self

    @model_validator(mode="after")
    def _reconnect_cap_above_base(self) -> Settings:
        if self.nats_reconnect_max_seconds < self.nats_reconnect_base_seconds:
            raise ValueError(
                f"NATS_RECONNECT_MAX_SECONDS ({self.nats_reconnect_max_seconds:g}) is below "
                f"NATS_RECONNECT_BASE_SECONDS ({self.nats_reconnect_base_seconds:g})"
            )
        return self

    @model_validator(mode="after")
    def _s3_endpoint_needs_s3(self) -> Settings:
        urls = (self.self_update_url or "", self.self_update_signature_url or "")
        s3_url = any(url.startswith("s3://") for url in urls)
        if self.self_update_s3_endpoint is not None and not s3_url:
            raise ValueError(
                "SELF_UPDATE_S3_ENDPOINT is set but SELF_UPDATE_URL is not s3:// (nor is "
                "SELF_UPDATE_SIGNATURE_URL)"
            )
        return self

    @model_validator(mode="after")
    def _signature_location(self) -> Settings:
        url, own = self.self_update_url, self.self_update_signature_url
        if own is not None and url is None:
            raise ValueError("SELF_UPDATE_SIGNATURE_URL is set but SELF_UPDATE_URL is not")
        if own is not None and self.self_update_public_key is None:
            raise ValueError(
                "SELF_UPDATE_SIGNATURE_URL is set but SELF_UPDATE_PUBLIC_KEY is not: no "
                "signature would be checked"
            )
        if url is not None and own is None and self.self_update_public_key is not None:
            if signature_needs_own_url(url):
                raise ValueError(
                    "SELF_UPDATE_PUBLIC_KEY is set and SELF_UPDATE_URL has a query (a "
                    "presigned URL, which covers its own path only): set "
                    "SELF_UPDATE_SIGNATURE_URL to the signature's own URL"
                )
        return self

    @field_validator("node_capabilities", mode="before")
    @classmethod
    def _capabilities(cls, value: Any) -> Any:
        # `NODE_CAPABILITIES=` (blank) means none; otherwise a JSON list of strings
        if not isinstance(value, str):
            return value
        if not value.strip():
            return []
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError('must be a JSON list of names, e.g. ["embeddings"]') from None

    @field_validator("node_capabilities")
    @classmethod
    def _capability_names(cls, value: list[str]) -> list[str]:
        for item in value:
            if not re.fullmatch(CAPABILITY_NAME, item):
                raise ValueError(
                    f"{item!r} is not a capability name (ASCII letters, digits, -_.:, at most 64)"
                )
        return sorted(set(value))

    @field_validator("allow_plain_http")
    @classmethod
    def _plain_http_names(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(PLAIN_HTTP_RISKS))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: only {', '.join(PLAIN_HTTP_RISKS)} may be named"
            )
        return value

    @field_validator("sentry_dsn")
    @classmethod
    def _sentry_dsn(cls, value: SecretStr | None) -> SecretStr | None:
        """What sentry-sdk accepts: http(s)://<public key>@<host>[:port]/[path/]<project id>."""
        if value is None:
            return None
        parts = urlsplit(value.get_secret_value())
        try:
            parts.port  # noqa: B018 - parsing it is the check
        except ValueError:
            raise ValueError("not a DSN: its port is not a number") from None
        project = parts.path.rsplit("/", 1)[-1]
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.username:
            raise ValueError("not a DSN: want http(s)://<public key>@<host>/<project id>")
        if not project.isdigit():
            raise ValueError("not a DSN: its path does not end in a project id (a number)")
        return value

    @field_validator("job_backoff_seconds", "allow_plain_http", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        return _comma_values(value)

    @field_validator("http_job_allowed_targets", mode="before")
    @classmethod
    def _http_job_targets(cls, value: Any) -> Any:
        """Parsed once, into what the `http` job may call; no entry: None."""
        entries = _comma_values(value)
        if not isinstance(entries, list | tuple):
            return entries
        names = _NAMES.validate_python(entries)  # its errors name the entry's index
        # its ValueError names the entry and the form
        return AllowedTargets.parse(names) if names else None

    @model_validator(mode="before")
    @classmethod
    def _no_http_job_suffixes(cls, data: Any) -> Any:
        """HTTP_JOB_ALLOWED_SUFFIXES (gone) let the `http` job call any Service of any
        namespace; a node still configured with it is stopped rather than silently given
        the much narrower default. Read from the environment and from `.env` (whose
        unknown names reach this validator)."""
        former = "HTTP_JOB_ALLOWED_SUFFIXES"
        given = list(data.items()) if isinstance(data, dict) else []
        if any(
            str(name).upper() == former and isinstance(value, str) and value.strip()
            for name, value in [*given, *os.environ.items()]
        ):
            raise ValueError(
                f"{former} is no longer read: set HTTP_JOB_ALLOWED_TARGETS instead, the "
                "namespaces (<namespace>) and Services (<service>.<namespace>) the http job "
                "may call, comma-separated (empty: MANAGED_NAMESPACE only)"
            )
        return data

    @field_validator("nats_url", mode="before")
    @classmethod
    def _nats_url(cls, value: Any) -> Any:
        """Parsed once, into the servers the bus takes (its ValueError names the server,
        redacted); `NATS_URL=` is not set."""
        if isinstance(value, str):
            return NatsServers.parse(value) if value.strip() else None
        return value

    @field_validator("job_backoff_seconds")
    @classmethod
    def _backoff(cls, value: list[float]) -> list[float]:
        if any(step <= 0 for step in value):
            raise ValueError("every backoff step must be positive")
        return value

    @field_validator(
        "nats_creds_file", "nats_nkey_seed_file", "nats_tls_ca_file", "nats_tls_cert_file",
        "nats_tls_key_file", "node_config_file",
    )  # fmt: skip
    @classmethod
    def _readable_file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"{value} is not a file")
        return value

    @model_validator(mode="after")
    def _client_certificate_pairs(self) -> Settings:
        if (self.nats_tls_cert_file is None) != (self.nats_tls_key_file is None):
            raise ValueError("NATS_TLS_CERT_FILE and NATS_TLS_KEY_FILE go together")
        return self

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        upper = value.upper()
        if upper not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return upper

    @property
    def is_production(self) -> bool:
        return self.app_env is AppEnv.PRODUCTION

    @property
    def tier(self) -> Tier:
        """NODE_TIER, or tier C for development (production requires NODE_TIER wherever a
        tier is used: jobs and the registry)."""
        return self.node_tier or Tier.C

    @property
    def json_logs(self) -> bool:
        if self.log_format == "auto":
            return self.is_production
        return self.log_format == "json"

    @property
    def update_window(self) -> UpdateWindow | None:
        return self.self_update_window

    @property
    def startup_spread(self) -> float:
        """STARTUP_SPREAD_SECONDS, or 30 s in production and none in development."""
        if self.startup_spread_seconds is None:
            return 30.0 if self.is_production else 0.0
        return self.startup_spread_seconds

    @property
    def auto_init_streams(self) -> bool:
        if self.nats_auto_init_streams is None:
            return not self.is_production
        return self.nats_auto_init_streams

    @property
    def migrates_on_start(self) -> bool:
        if self.migrate_on_start is None:
            return not self.is_production
        return self.migrate_on_start

    @property
    def migrate_url(self) -> SecretStr | None:
        """Where `migrate` applies the migrations: DATABASE_MIGRATE_URL, else DATABASE_URL."""
        return self.database_migrate_url or self.database_url

    @property
    def transaction_pooler(self) -> bool:
        """DATABASE_URL goes through a pooler that hands each transaction to any server
        connection (PgBouncer in transaction mode)."""
        return self.database_pooler == "pgbouncer-transaction"

    @property
    def migrate_through_pooler(self) -> bool:
        """`migrate` would reach PostgreSQL through the transaction pooler: no
        DATABASE_MIGRATE_URL beside a pooled DATABASE_URL."""
        return self.transaction_pooler and self.database_migrate_url is None

    @property
    def ledger_ttl_seconds(self) -> float:
        return self.job_ledger_ttl_seconds or self.nats_stream_max_age_seconds

    @property
    def node_config_path(self) -> Path | None:
        """The original service's config file to take the key from when neither
        NODE_PRIVATE_KEY nor NODE_PRIVATE_KEY_FILE is set: NODE_CONFIG_FILE (checked to
        exist), else ~/.config/lfgnode/config.yaml when there is such a file."""
        if self.node_config_file is not None:
            return self.node_config_file
        try:
            default = NODE_CONFIG_DEFAULT.expanduser()
            return default if default.is_file() else None
        except (RuntimeError, OSError):  # no home directory, or one this user cannot search
            return None

    @property
    def worker_only(self) -> bool:
        """A node that neither syncs nor reports: no backend endpoint, no desired-state
        folder. It needs no API_TOKEN (its protected routes stay closed without one), no
        ping secret and no database (the ledger lives in JetStream)."""
        return self.node_system_endpoint is None and self.desired_state_dir is None

    def check_production(self) -> None:
        """Refuse to run in production with a missing or placeholder required setting."""
        if not self.is_production:
            return
        runs_jobs = self.worker_enabled and self.nats_url is not None
        if self.worker_only and not runs_jobs:
            raise SettingsError(
                "nothing to run when APP_ENV=production: set NODE_SYSTEM_ENDPOINT (or "
                "DESIRED_STATE_DIR) to sync and report, or NATS_URL for a worker-only node"
            )
        required: list[tuple[str, str | None]] = []
        if not self.worker_only:
            required.append(("API_TOKEN", _reveal(self.api_token)))
            required.append(("PING_TOKEN_SECRET", _reveal(self.ping_token_secret)))
        if runs_jobs or (self.registry_enabled and self.database_url is not None):
            required.append(("NODE_TIER", self.node_tier.value if self.node_tier else None))
        if self.job_ledger == "postgres" and runs_jobs:
            required.append(("DATABASE_URL", _reveal(self.database_url)))
        if self.report_enabled and self.node_system_endpoint is not None:
            if self.node_private_key_file is None and self.node_config_path is None:
                required.append(("NODE_PRIVATE_KEY", _reveal(self.node_private_key)))
        keys = self.desired_state_public_keys
        if keys is not None and DEVELOPMENT_PUBLIC_KEY in keys.keys:
            raise SettingsError(
                "DESIRED_STATE_PUBLIC_KEYS holds the local backend's development key (from "
                ".env.example) when APP_ENV=production: set the backend's own key"
            )
        for name, value in required:
            if value is None or value.strip().lower() in PLACEHOLDERS:
                raise SettingsError(
                    f"{name} is required when APP_ENV=production "
                    f"({'missing' if value is None else 'placeholder value'})"
                )
        if self.node_private_key_file is not None and not self.node_private_key_file.is_file():
            raise SettingsError(
                f"NODE_PRIVATE_KEY_FILE points to {self.node_private_key_file}, which is not a file"
            )
        for name in self.plain_http():
            if name not in self.allow_plain_http:
                raise SettingsError(
                    f"{name} is plain http:// in production: {PLAIN_HTTP_RISKS[name]}; use "
                    f"https://{PLAIN_HTTP_FIX[name]}, or accept the risk with "
                    f"ALLOW_PLAIN_HTTP={name}"
                )

    def plain_http(self) -> list[str]:
        """The settings that would send this node's trust over plain http:// (a loopback
        address has no path to tamper on)."""
        found = []
        if _plain(self.node_system_endpoint) and (self.sync_enabled or self.report_enabled):
            found.append("NODE_SYSTEM_ENDPOINT")
        if (
            self.self_update_enabled
            and _plain(self.self_update_url)
            and self.self_update_public_key is None
        ):
            found.append("SELF_UPDATE_URL")
        return found


# what a plain http:// setting gives whoever is on the path between the node and the server
PLAIN_HTTP_RISKS = {
    "NODE_SYSTEM_ENDPOINT": "anyone on the path can change the desired state, and so what "
    "this node runs (the answers are not signed)",
    "SELF_UPDATE_URL": "anyone on the path can pick the manager's own image (no "
    "SELF_UPDATE_PUBLIC_KEY checks the version file)",
}
PLAIN_HTTP_FIX = {
    "NODE_SYSTEM_ENDPOINT": "",
    "SELF_UPDATE_URL": " (or set SELF_UPDATE_PUBLIC_KEY, which checks the version file)",
}


def _plain(url: str | None) -> bool:
    """A plain http:// URL to anything but a loopback address."""
    if url is None:
        return False
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    loopback = host == "localhost" or host.startswith("127.") or host == "::1"
    return parts.scheme == "http" and not loopback


def _http_url(value: str, *, also: str = "") -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(" ".join(("must be an http(s) URL", also)).strip())
    return value.rstrip("/")


def _reveal(secret: SecretStr | None) -> str | None:
    return None if secret is None else secret.get_secret_value()


S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def _comma_values(value: Any) -> Any:
    """`5,30,120` or a JSON list, as a list; any other value as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError("must be a JSON list or comma-separated values") from None
    return [part.strip() for part in text.split(",") if part.strip()]


def load_settings(*, _check_production: bool = True, **overrides: Any) -> Settings:
    """Read the environment (and `.env`), turning validation errors into one line each.

    One-shot commands that need only part of the configuration (`migrate`) skip the
    production completeness check; `serve` never does.
    """
    from pydantic import ValidationError

    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]).upper() or "settings"
        raise SettingsError(f"{field}: {first['msg']}") from None
    if _check_production:
        settings.check_production()
    return settings
