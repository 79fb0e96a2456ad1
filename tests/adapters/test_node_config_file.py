"""The node key from the original service's config file (~/.config/lfgnode/config.yaml):
what it reads, how a malformed file is refused (file and field named, the key never
quoted), its place after NODE_PRIVATE_KEY and NODE_PRIVATE_KEY_FILE, and production."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import app.settings
from app.adapters.signing import InvalidKeyError, load_config_file
from app.services.runtime import build_runtime
from app.settings import Settings, SettingsError, load_settings

# the real default, before the autouse fixture hides the developer's own file
REAL_DEFAULT = app.settings.NODE_CONFIG_DEFAULT

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(100, 132)))
RAW = KEY.private_bytes(
    serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
)
SEED = base64.b64encode(RAW).decode()
PEM = KEY.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()
PEM_BLOCK = "private_key: |\n" + "".join(f"  {line}\n" for line in PEM.splitlines())
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER_SEED = base64.b64encode(
    OTHER.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
).decode()
EC_PEM = (
    ec.generate_private_key(ec.SECP256R1())
    .private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    .decode()
)

# what must never appear in an error, not even in part: the seed, its hex, the PEM's body
SECRETS = (SEED, RAW.hex(), PEM.splitlines()[1])


def leaks(text: str) -> bool:
    """Any 12 characters in a row of a secret (a YAML error's snippet shows part of a line)."""
    return any(s[i : i + 12] in text for s in SECRETS for i in range(len(s) - 11))


PRODUCTION = {
    "APP_ENV": "production",
    "API_TOKEN": "t0k3n-for-operators",
    "PING_TOKEN_SECRET": "s3cret-for-pings",
    "NODE_SYSTEM_ENDPOINT": "https://backend.example.net",
}


def public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "node_id"),
    [
        pytest.param(f"private_key: {SEED}\n", None, id="base64 seed"),
        pytest.param(f'private_key: "{SEED}"\nnode_id: node-7\n', "node-7", id="quoted, node_id"),
        pytest.param(PEM_BLOCK, None, id="PEM block scalar"),
        pytest.param(f"private_key: {RAW.hex()}\n", None, id="hex seed"),
        pytest.param(
            f"# the Express service's file\nnode_id: ' lfg-3 '\nbackend: https://x.example\n"
            f"port: 3000\nprivate_key: {SEED}\n",
            "lfg-3",
            id="other keys ignored",
        ),
        pytest.param(f"private_key: {SEED}\nnode_id:\n", None, id="empty node_id is none"),
    ],
)
def test_a_good_file_gives_its_key_and_node_id(
    tmp_path: Path, text: str, node_id: str | None
) -> None:
    got = load_config_file(write(tmp_path / "config.yaml", text))
    assert public(got.key) == public(KEY)
    assert got.node_id == node_id
    assert not leaks(repr(got))


@pytest.mark.parametrize(
    ("content", "field", "says"),
    [
        pytest.param(
            f"private_key: {SEED}: oops\n", "private_key", "not valid YAML at line 1",
            id="not YAML (the snippet would show the key)",
        ),
        pytest.param(
            f'node_id: n1\nprivate_key: "{SEED}\n', "private_key", "not valid YAML",
            id="unterminated quote",
        ),
        pytest.param(f"- {SEED}\n", "private_key", "found a YAML list", id="a list"),
        pytest.param(
            f"{SEED}\n", "private_key",
            "(a file holding only the key goes in NODE_PRIVATE_KEY_FILE)", id="a bare key",
        ),
        pytest.param("", "private_key", "found an empty file", id="empty file"),
        pytest.param(
            f"node_id: n1\nprivateKey: {SEED}\n", "private_key", "private_key is missing",
            id="missing",
        ),
        pytest.param("private_key:\n", "private_key", "missing or empty", id="null"),
        pytest.param("private_key: 12345\n", "private_key", "not a YAML int", id="a number"),
        pytest.param(
            f"private_key:\n  seed: {SEED}\n", "private_key", "not a YAML dict", id="a mapping"
        ),
        pytest.param(
            f"private_key: {SEED[:20]}\n", "private_key: expected a PKCS#8 PEM or a 32-byte seed",
            "base64 or hex", id="short seed",
        ),
        pytest.param(
            f"private_key: {SEED}AAAA\n", "private_key: expected a PKCS#8 PEM or a 32-byte seed",
            "base64 or hex", id="long seed",
        ),
        pytest.param(
            'private_key: "not base64 !!"\n', "private_key: expected", "32-byte seed",
            id="not base64",
        ),
        pytest.param(
            "private_key: |\n  -----BEGIN PRIVATE KEY-----\n  garbage\n"
            "  -----END PRIVATE KEY-----\n",
            "private_key: not a readable", "PKCS#8 PEM", id="bad PEM",
        ),
        pytest.param(
            "private_key: |\n" + "".join(f"  {line}\n" for line in EC_PEM.splitlines()),
            "private_key: the PEM key", "not an Ed25519 key", id="not Ed25519",
        ),
        pytest.param(
            f"private_key: {SEED}\nnode_id: 42\n", "node_id", "must be a non-empty string",
            id="numeric node_id",
        ),
        pytest.param(
            f'private_key: {SEED}\nnode_id: "  "\n', "node_id", "must be a non-empty string",
            id="blank node_id",
        ),
        pytest.param(
            b"private_key: \xff\xfe" + SEED.encode() + b"\n", "private_key", "not UTF-8 text",
            id="not UTF-8",
        ),
    ],
)  # fmt: skip
def test_a_malformed_file_names_the_file_and_the_field_never_the_key(
    tmp_path: Path, content: str | bytes, field: str, says: str
) -> None:
    path = write(tmp_path / "lfgnode" / "config.yaml", content)
    with pytest.raises(InvalidKeyError) as caught:
        load_config_file(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    assert field in message and says in message, message
    assert "\n" not in message
    assert not leaks(message), message
    # no chained exception (a YAML error's snippet, a decoder's input) travels with it
    error = caught.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_a_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "config.yaml"
    folder.mkdir()
    with pytest.raises(InvalidKeyError, match=f"^{folder}: cannot read private_key: "):
        load_config_file(folder)


# --- settings and runtime: where the file is looked for, precedence, production


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME in a temp dir, with the real default path (~/.config/lfgnode/config.yaml)."""
    assert Path("~/.config/lfgnode/config.yaml") == REAL_DEFAULT
    monkeypatch.setattr(app.settings, "NODE_CONFIG_DEFAULT", REAL_DEFAULT)
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("HOME", str(path))
    return path


def default_file(home: Path, text: str) -> Path:
    return write(home / ".config" / "lfgnode" / "config.yaml", text)


def test_production_loads_with_only_the_config_file(
    monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    for name, value in PRODUCTION.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match="NODE_PRIVATE_KEY is required"):
        load_settings(_env_file=None)
    path = default_file(home, f"node_id: lfg-node-1\nprivate_key: {SEED}\n")
    settings = load_settings(_env_file=None)
    assert settings.is_production and settings.node_config_path == path
    rt = build_runtime(settings)
    assert rt.signer is not None and public(rt.signer._key) == public(KEY)
    assert rt.node_id == "lfg-node-1"
    assert rt.components["report"].enabled
    rendered = repr(settings) + settings.model_dump_json() + repr(rt.signer)
    assert not leaks(rendered)


def test_no_file_at_the_default_path_is_not_an_error(home: Path) -> None:
    settings = Settings(_env_file=None, node_system_endpoint="https://backend.example.net")
    assert settings.node_config_path is None
    rt = build_runtime(settings)
    assert rt.signer is None
    assert "~/.config/lfgnode/config.yaml" in rt.components["report"].reason


def test_a_malformed_file_at_the_default_path_stops_the_start(home: Path) -> None:
    path = default_file(home, f"private_key: {SEED[:30]}\n")
    with pytest.raises(InvalidKeyError) as caught:
        build_runtime(Settings(_env_file=None))
    assert str(caught.value).startswith(f"{path}: private_key: ")
    assert not leaks(str(caught.value))


def test_a_named_file_must_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NODE_CONFIG_FILE", str(tmp_path / "absent.yaml"))
    with pytest.raises(SettingsError) as caught:
        load_settings(_env_file=None)
    assert str(caught.value).startswith("NODE_CONFIG_FILE:")
    assert "absent.yaml is not a file" in str(caught.value)
    named = write(tmp_path / "lfg.yaml", f"private_key: {SEED}\n")
    monkeypatch.setenv("NODE_CONFIG_FILE", str(named))
    rt = build_runtime(load_settings(_env_file=None))
    assert rt.signer is not None and public(rt.signer._key) == public(KEY)


@pytest.mark.parametrize(
    ("inline", "key_file", "node_id", "want_key", "want_node"),
    [
        pytest.param(None, False, None, KEY, "from-file", id="file only"),
        pytest.param(None, False, "env-node", KEY, "env-node", id="NODE_ID beats node_id"),
        pytest.param(OTHER_SEED, False, None, OTHER, None, id="NODE_PRIVATE_KEY beats the file"),
        pytest.param(None, True, None, OTHER, None, id="NODE_PRIVATE_KEY_FILE beats the file"),
    ],
)  # fmt: skip
def test_precedence(
    home: Path,
    inline: str | None,
    key_file: bool,
    node_id: str | None,
    want_key: Ed25519PrivateKey,
    want_node: str | None,
) -> None:
    """NODE_PRIVATE_KEY > NODE_PRIVATE_KEY_FILE > the config file; the file's node_id is
    taken only with its key, and NODE_ID wins over it."""
    default_file(home, f"node_id: from-file\nprivate_key: {SEED}\n")
    key_path = write(home / "node.key", OTHER_SEED) if key_file else None
    settings = Settings(
        _env_file=None,
        node_private_key=inline,
        node_private_key_file=key_path,
        node_id=node_id,
    )
    rt = build_runtime(settings)
    assert rt.signer is not None and public(rt.signer._key) == public(want_key)
    derived = "node-"  # the id derived from the public key when none is given
    assert rt.node_id == want_node if want_node else rt.node_id.startswith(derived)
