"""DATABASE_POOLER: PostgreSQL straight (`none`), or PgBouncer in transaction mode, which
needs a DATABASE_URL to describe and a DATABASE_MIGRATE_URL for migrations."""

from __future__ import annotations

import pytest

from app.settings import Settings, SettingsError, load_settings

POOLED = "postgresql://registry:pw@pgbouncer.registry:6432/registry"
DIRECT = "postgresql://registry:pw@postgres.registry:5432/registry"


def test_none_is_the_default() -> None:
    settings = Settings(_env_file=None)
    assert settings.database_pooler == "none"
    assert not settings.transaction_pooler
    assert not settings.migrate_through_pooler


def test_an_unknown_pooler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_POOLER", "pgbouncer-session")
    with pytest.raises(SettingsError, match="DATABASE_POOLER"):
        load_settings(_env_file=None)


def test_a_pooler_without_a_database_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_POOLER", "pgbouncer-transaction")
    with pytest.raises(SettingsError, match="DATABASE_POOLER=pgbouncer-transaction is set but"):
        load_settings(_env_file=None)


def test_migrations_at_start_through_the_pooler_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Development migrates at start by default: through a transaction pooler it needs a
    way past it."""
    monkeypatch.setenv("DATABASE_POOLER", "pgbouncer-transaction")
    monkeypatch.setenv("DATABASE_URL", POOLED)
    with pytest.raises(SettingsError, match="set DATABASE_MIGRATE_URL straight to PostgreSQL"):
        load_settings(_env_file=None)
    monkeypatch.setenv("MIGRATE_ON_START", "false")
    settings = load_settings(_env_file=None)
    assert settings.transaction_pooler and settings.migrate_through_pooler


def test_production_with_a_direct_migrate_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_ENV", "production")
    monkeypatch.setenv("NATS_URL", "nats://nats:4222")
    monkeypatch.setenv("NODE_TIER", "A")
    monkeypatch.setenv("DATABASE_POOLER", "pgbouncer-transaction")
    monkeypatch.setenv("DATABASE_URL", POOLED)
    settings = load_settings(_env_file=None)
    assert settings.transaction_pooler and settings.migrate_through_pooler  # `migrate` refuses
    monkeypatch.setenv("DATABASE_MIGRATE_URL", DIRECT)
    settings = load_settings(_env_file=None)
    assert not settings.migrate_through_pooler
    assert settings.migrate_url is not None and settings.migrate_url.get_secret_value() == DIRECT
    # the URL still carries its password only as a secret
    assert "pw" not in repr(settings)
