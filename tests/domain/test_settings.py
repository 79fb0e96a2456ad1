"""Settings: public environment names, production refusals, secrets kept secret."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from app.domain.desired_trust import DEVELOPMENT_PUBLIC_KEY
from app.domain.nats_servers import NatsServers
from app.domain.redaction import redact_url
from app.settings import Settings, SettingsError, load_settings
from standins.backend import development_signer

PRODUCTION_OK = {
    "APP_ENV": "production",
    "API_TOKEN": "t0k3n-for-operators",
    "PING_TOKEN_SECRET": "s3cret-for-pings",
    "NODE_SYSTEM_ENDPOINT": "https://backend.example.net",
    "NODE_PRIVATE_KEY": "A" * 43 + "=",
    "DATABASE_URL": "postgresql://registry:pw@db.example:5432/registry",
    "NODE_TIER": "A",
}


def set_env(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_defaults_match_the_documented_contract() -> None:
    s = Settings(_env_file=None)
    assert s.app_env == "development"
    assert s.port == 8080
    assert s.ping_stale_seconds == 30
    assert s.report_interval_seconds == 60
    assert s.sync_interval_seconds == 600
    assert s.heartbeat_interval_seconds == 30


def test_environment_names_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(
        monkeypatch,
        {
            "PORT": "9000",
            "NODE_ID": "n-7",
            "MANAGED_NAMESPACE": "apps",
            "PING_STALE_SECONDS": "12",
            "CAPABILITY_REGISTRY": "postgresql://u:pw@db:5432/reg",
            "KUBECONFIG": "/tmp/kc",
        },
    )
    s = load_settings(_env_file=None)
    assert (s.port, s.node_id, s.managed_namespace, s.ping_stale_seconds) == (
        9000,
        "n-7",
        "apps",
        12,
    )
    assert s.database_url is not None
    assert s.database_url.get_secret_value() == "postgresql://u:pw@db:5432/reg"
    assert s.kubeconfig == Path("/tmp/kc")


def test_production_with_everything_set_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, PRODUCTION_OK)
    assert load_settings(_env_file=None).is_production


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("API_TOKEN", None, "API_TOKEN is required when APP_ENV=production (missing)"),
        ("API_TOKEN", "changeme", "API_TOKEN is required when APP_ENV=production (placeholder"),
        ("PING_TOKEN_SECRET", None, "PING_TOKEN_SECRET is required"),
        ("PING_TOKEN_SECRET", "placeholder", "PING_TOKEN_SECRET is required"),
        ("NODE_PRIVATE_KEY", None, "NODE_PRIVATE_KEY is required"),
        ("NODE_PRIVATE_KEY", "change-me", "NODE_PRIVATE_KEY is required"),
        ("NODE_TIER", None, "NODE_TIER is required"),
    ],
)
def test_production_refuses_missing_or_placeholder(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str | None, says: str
) -> None:
    set_env(monkeypatch, PRODUCTION_OK)
    if value is None:
        monkeypatch.delenv(variable)
    else:
        monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings(_env_file=None)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_production_refuses_the_development_desired_state_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(monkeypatch, PRODUCTION_OK)
    other = base64.b64encode(bytes(range(32))).decode()
    monkeypatch.setenv("DESIRED_STATE_PUBLIC_KEYS", other)
    assert load_settings(_env_file=None).desired_state_public_keys is not None
    development = public_of(development_signer())
    monkeypatch.setenv("DESIRED_STATE_PUBLIC_KEYS", f"{other}, {development}")
    with pytest.raises(SettingsError, match="development key"):
        load_settings(_env_file=None)


def test_desired_state_keys_are_parsed_once_and_never_quoted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    development = public_of(development_signer())
    keys = Settings(_env_file=None, desired_state_public_keys=development)
    assert keys.desired_state_public_keys is not None
    assert keys.desired_state_public_keys.keys == (DEVELOPMENT_PUBLIC_KEY,)
    monkeypatch.setenv("DESIRED_STATE_PUBLIC_KEYS", f"{development},c2VjcmV0")
    with pytest.raises(SettingsError, match="key 2: expected an Ed25519 public key") as caught:
        load_settings(_env_file=None)
    assert "c2VjcmV0" not in str(caught.value)


def public_of(key: Ed25519PrivateKey) -> str:
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


WORKER_ONLY = {"APP_ENV": "production", "NODE_ID": "node-2", "TIER": "C",
               "NATS_URL": "nats://nats.example:4222"}  # fmt: skip


def test_a_worker_only_node_needs_three_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet's worker specification: NODE_ID, TIER and NATS_URL, nothing else."""
    set_env(monkeypatch, WORKER_ONLY)
    settings = load_settings(_env_file=None)
    assert settings.worker_only and settings.node_tier is not None
    assert (settings.node_id, settings.node_tier.value) == ("node-2", "C")
    assert settings.api_token is None and settings.database_url is None


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"TIER": None}, "NODE_TIER is required"),
        ({"NATS_URL": None}, "nothing to run when APP_ENV=production"),
        ({"JOB_LEDGER": "postgres"}, "DATABASE_URL is required"),
        ({"NODE_SYSTEM_ENDPOINT": "https://backend.example.net"}, "API_TOKEN is required"),
        ({"DESIRED_STATE_DIR": "/srv/desired"}, "API_TOKEN is required"),
        ({"JOB_LEDGER": "redis"}, "JOB_LEDGER"),
    ],
)
def test_a_worker_only_node_still_refuses_what_it_cannot_run_with(
    monkeypatch: pytest.MonkeyPatch, changes: dict[str, str | None], says: str
) -> None:
    set_env(monkeypatch, WORKER_ONLY)
    for variable, value in changes.items():
        if value is None:
            monkeypatch.delenv(variable)
        else:
            monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=says):
        load_settings(_env_file=None)


def test_production_accepts_a_key_file_instead(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key_file = tmp_path / "node.key"
    key_file.write_text("A" * 43 + "=")
    set_env(monkeypatch, PRODUCTION_OK)
    monkeypatch.delenv("NODE_PRIVATE_KEY")
    monkeypatch.setenv("NODE_PRIVATE_KEY_FILE", str(key_file))
    assert load_settings(_env_file=None).node_private_key_file == key_file
    monkeypatch.setenv("NODE_PRIVATE_KEY_FILE", str(tmp_path / "absent.key"))
    with pytest.raises(SettingsError, match="NODE_PRIVATE_KEY_FILE points to"):
        load_settings(_env_file=None)


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("PORT", "eighty", "PORT"),
        ("PORT", "70000", "PORT"),
        ("APP_ENV", "staging", "APP_ENV"),
        ("NODE_SYSTEM_ENDPOINT", "ftp://x", "NODE_SYSTEM_ENDPOINT"),
        ("PING_STALE_SECONDS", "0", "PING_STALE_SECONDS"),
        ("NODE_TIER", "D", "NODE_TIER"),
        ("NODE_CAPABILITIES", "not json", "NODE_CAPABILITIES"),
        ("NODE_CAPABILITIES", '["ok", "bad name"]', "NODE_CAPABILITIES"),
        # ASCII only, as the fleet route's documented pattern (Python's isalnum takes any letter)
        ("NODE_CAPABILITIES", '["gp\\u0443"]', "NODE_CAPABILITIES"),
        # what a job's requirements may name (a zone no requirement can match is a typo)
        ("NODE_REGION", "eu west", "NODE_REGION"),
        ("NODE_TRUST_ZONE", "z1\u00e9", "NODE_TRUST_ZONE"),
        ("NATS_URL", "nats://a:4222,http://b:4222", "NATS_URL"),
        ("NATS_URL", "nats://a:port", "NATS_URL"),
        ("NATS_URL", " , ", "NATS_URL"),
        ("SELF_UPDATE_URL", "ftp://x/version", "SELF_UPDATE_URL"),
        ("SELF_UPDATE_URL", "s3://bucket", "SELF_UPDATE_URL"),
        ("SELF_UPDATE_URL", "s3://Bucket_Name/version", "SELF_UPDATE_URL"),
        ("SELF_UPDATE_S3_ENDPOINT", "minio:9000", "SELF_UPDATE_S3_ENDPOINT"),
    ],
)
def test_invalid_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings(_env_file=None)
    assert str(caught.value).startswith(f"{field}:")


def test_secrets_are_masked_in_repr_and_dumps(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {
        "NODE_PRIVATE_KEY": "Zm9vYmFyYmF6cXV4cXV1eGZvb2JhcmJhenF1eHF1dXg=",
        "API_TOKEN": "api-token-value-123",
        "PING_TOKEN_SECRET": "ping-secret-value-456",
        "SENTRY_DSN": "https://abcdef0123@sentry.example/1",
        "MATRIX_ACCESS_TOKEN": "syt_matrix_token_789",
        "DATABASE_URL": "postgresql://reg:db-password-000@db/reg",
    }
    set_env(monkeypatch, secrets)
    s = load_settings(_env_file=None)
    rendered = repr(s) + str(s) + s.model_dump_json()
    for value in secrets.values():
        assert value not in rendered


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:pw@db:5432/x", "postgresql://u:***@db:5432/x"),
        # a bare user name is hidden too: NATS reads it as a token
        ("postgresql://u@db/x", "postgresql://***@db/x"),
        ("nats://t0k3n@nats:4222", "nats://***@nats:4222"),
        ("nats://tok:en@nats:4222", "nats://tok:***@nats:4222"),
        # several NATS servers, each redacted
        ("nats://t@a:4222,nats://u:p@b:4222", "nats://***@a:4222,nats://u:***@b:4222"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize(
    ("value", "servers"),
    [
        ("nats://a:4222", ["nats://a:4222"]),
        ("nats://a:4222, tls://b:4222,nats://c", ["nats://a:4222", "tls://b:4222", "nats://c"]),
    ],
)
def test_nats_url_takes_several_servers(
    monkeypatch: pytest.MonkeyPatch, value: str, servers: list[str]
) -> None:
    """Parsed once, by the settings, into the servers the bus takes as they are."""
    monkeypatch.setenv("NATS_URL", value)
    assert load_settings(_env_file=None).nats_url == NatsServers(tuple(servers))


@pytest.mark.parametrize("value", ["", "  "])
def test_a_blank_nats_url_is_unset(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NATS_URL", value)
    assert load_settings(_env_file=None).nats_url is None


FORM = "nats|tls|ws|wss://host:port, comma-separated for several"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (" , ", "no server given (nats://host:port, comma-separated for several)"),
        ("nats://a:4222,http://b:4222", f"'http://b:4222' is not a NATS server URL ({FORM})"),
        ("nats://a:port", f"'nats://a:port' is not a NATS server URL ({FORM})"),
        ("nats://u:pw@a,ftp://u:pw@b", f"'ftp://u:***@b' is not a NATS server URL ({FORM})"),
    ],
)
def test_nats_url_refusals_are_the_parsers_in_one_line(
    monkeypatch: pytest.MonkeyPatch, value: str, error: str
) -> None:
    monkeypatch.setenv("NATS_URL", value)
    with pytest.raises(SettingsError) as caught:
        load_settings(_env_file=None)
    assert str(caught.value) == f"NATS_URL: Value error, {error}"


def test_parsed_values_are_dumped_as_given_with_secrets_redacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(
        monkeypatch,
        {"NATS_URL": "nats://u:natsPw@a:4222,nats://b:4222", "HTTP_JOB_ALLOWED_TARGETS": "w,api.o"},
    )
    s = load_settings(_env_file=None)
    dumped = s.model_dump(mode="json")
    assert dumped["nats_url"] == "nats://u:***@a:4222,nats://b:4222"
    assert dumped["http_job_allowed_targets"] == ["w", "api.o"]
    assert "natsPw" not in repr(s) + str(s) + s.model_dump_json()


def test_registry_can_be_switched_off_in_production(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, PRODUCTION_OK)
    monkeypatch.delenv("DATABASE_URL")
    monkeypatch.delenv("NODE_TIER")
    monkeypatch.setenv("REGISTRY_ENABLED", "false")
    assert load_settings(_env_file=None).registry_enabled is False


def test_worker_daemonset_names_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {"TIER": "B", "CAPABILITY_REGISTRY": "postgresql://r@db/reg"})
    s = load_settings(_env_file=None)
    assert s.node_tier == "B"
    assert s.database_url is not None


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("NATS_CREDS_FILE", "/nonexistent/user.creds", "NATS_CREDS_FILE"),
        ("NATS_NKEY_SEED_FILE", "/nonexistent/seed.nk", "is not a file"),
        ("NATS_TLS_CERT_FILE", "{file}", "NATS_TLS_CERT_FILE and NATS_TLS_KEY_FILE go together"),
    ],
)
def test_nats_credential_files_must_exist_and_pair(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str, value: str, says: str
) -> None:
    present = tmp_path / "present"
    present.write_text("x")
    monkeypatch.setenv(variable, value.format(file=present))
    with pytest.raises(SettingsError, match=says):
        load_settings(_env_file=None)


def test_the_version_file_may_be_an_s3_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELF_UPDATE_URL", "s3://wm.releases/manager/version.json")
    monkeypatch.setenv("SELF_UPDATE_S3_ENDPOINT", "http://minio.storage:9000/")
    settings = load_settings(_env_file=None)
    assert settings.self_update_url == "s3://wm.releases/manager/version.json"
    assert settings.self_update_s3_endpoint == "http://minio.storage:9000"


def test_an_s3_endpoint_needs_an_s3_version_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELF_UPDATE_URL", "https://releases.example/version.json")
    monkeypatch.setenv("SELF_UPDATE_S3_ENDPOINT", "http://minio.storage:9000")
    with pytest.raises(SettingsError, match="SELF_UPDATE_S3_ENDPOINT is set but SELF_UPDATE_URL"):
        load_settings(_env_file=None)


def test_the_development_key_in_env_example_is_the_local_backends() -> None:
    text = (Path(__file__).resolve().parents[2] / ".env.example").read_text()
    (named,) = re.findall(r"^#\s+DESIRED_STATE_PUBLIC_KEYS=(\S+)$", text, re.MULTILINE)
    assert named == public_of(development_signer())
    assert base64.b64decode(named) == DEVELOPMENT_PUBLIC_KEY
