"""The production setup exactly as k8s/README.md documents it starts.

For the manager (`k8s/`) and the job worker (`k8s/overlays/worker/`), the test reads the
README's section: its shell blocks make the node key (`... keygen ... > node.key`) and
create the `workload-manager` Secret and ConfigMap (`kubectl create ...`, run by bash as
an operator's shell runs it, with `--dry-run=client -o json` added so kubectl prints the
object instead of sending it; a YAML block holding a Secret or ConfigMap counts too), and
its `kubectl apply -k <dir>` names the kustomization to render. The pod's environment
is then put together as the kubelet does: the image's ENV (Dockerfile), `envFrom`, then
`env` (downward-API fields, Secret and ConfigMap keys; a missing required source or key
is a pod that never starts). The init containers run first (`migrate`), then the manager
in production (`python -m app serve`). It must answer /readyz, have its first signed report
accepted by the backend, and get its registry and worker (and, for the manager, sync)
components to `ok`, once the fleet's job streams exist (`init-streams`, which the operator
runs once for the fleet: k8s/nats/README.md).

Only what must point at this machine is replaced: the database, NATS and backend URLs
(the session's PostgreSQL and nats-server, a local backend that checks every signature
with the documented key), the listen port, the data and migrations folders, the
downward-API values, and, for the manager, the in-cluster ServiceAccount token (a
kubeconfig with the manager's ServiceAccount token on the session's control plane).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.adapters.signing import node_id_for, parse_private_key
from standins.backend import LocalBackend
from standins.control_plane import FAKE_NODE
from standins.databases import fresh_database_sync
from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "k8s" / "README.md"
NAME = NAMESPACE = "workload-manager"
POD_FIELDS = {
    "metadata.name": "workload-manager-documented-0",
    "metadata.namespace": NAMESPACE,
    "spec.nodeName": FAKE_NODE,
}
# What points at this machine instead of the fleet's servers (the values are the test's).
DATABASE_KEYS = ("DATABASE_URL", "CAPABILITY_REGISTRY")

Object = dict[str, Any]


# --- what the README documents -----------------------------------------------------------


def section(title: str) -> str:
    """The README's text under the heading starting with `title`, up to the next heading."""
    parts = re.split(r"^(#{1,6} .*)$", README.read_text(), flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if heading.lstrip("#").strip().startswith(title):
            return body
    raise AssertionError(f"k8s/README.md has no section {title!r}")


def fenced(text: str) -> Iterator[tuple[str, str]]:
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        yield match.group(1), match.group(2)


def shell_commands(block: str) -> list[str]:
    """One string per command: continuation lines joined, comments and blank lines gone."""
    joined = re.sub(r"\\\n", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and line.strip()[0] != "#"]


@dataclass
class Setup:
    """The documented `workload-manager` Secret and ConfigMap (None: not documented) and
    the kustomization the section applies."""

    workdir: Path
    secret: dict[str, str] | None = None
    configmap: dict[str, str] | None = None
    kustomization: Path | None = None

    def take(self, obj: Object) -> None:
        kind, meta = obj.get("kind"), obj.get("metadata", {})
        if kind not in ("Secret", "ConfigMap"):
            return
        assert (meta.get("name"), meta.get("namespace")) == (NAME, NAMESPACE), meta
        data: dict[str, str] = dict(obj.get("data") or {})
        if kind == "Secret":  # base64 in `data`, plain in `stringData`
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data |= obj.get("stringData") or {}
        attribute = "secret" if kind == "Secret" else "configmap"
        assert getattr(self, attribute) is None, f"the section creates the {kind} twice"
        setattr(self, attribute, data)

    def run_keygen(self, tokens: list[str]) -> None:
        """`... keygen [args] > file`, whichever program the README runs it with."""
        after = tokens[tokens.index("keygen") + 1 :]
        assert ">" in after, f"keygen output goes nowhere: {shlex.join(tokens)}"
        args, target = after[: after.index(">")], after[after.index(">") + 1]
        made = subprocess.run(
            [sys.executable, "-m", "app", "keygen", *args],
            env={"PATH": os.environ.get("PATH", ""), "HOME": str(self.workdir)},
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        (self.workdir / target).write_text(made.stdout)

    def run_kubectl_create(self, command: str) -> None:
        """The command as the operator's shell runs it (`$(openssl ...)` and all); the
        flags go right after `kubectl`, where a trailing comment cannot swallow them."""
        assert command.startswith("kubectl "), command
        dry_run = "kubectl --dry-run=client -o json " + command.removeprefix("kubectl ")
        done = subprocess.run(
            ["bash", "-c", dry_run],
            cwd=self.workdir,
            env={"PATH": os.environ.get("PATH", ""), "HOME": str(self.workdir),
                 "KUBECONFIG": os.devnull},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stderr}"
        self.take(json.loads(done.stdout))


def documented(title: str, workdir: Path) -> Setup:
    setup = Setup(workdir)
    for language, block in fenced(section(title)):
        if language in ("yaml", "yml"):
            for obj in yaml.safe_load_all(block):
                if isinstance(obj, dict):
                    setup.take(obj)
            continue
        if language not in ("sh", "shell", "bash", "console"):
            continue
        for command in shell_commands(block):
            tokens = shlex.split(command, comments=True)
            if "keygen" in tokens:
                setup.run_keygen(tokens)
            elif tokens[0] == "kubectl" and "create" in tokens:
                if {"secret", "configmap"} & set(tokens):
                    setup.run_kubectl_create(command)
            elif tokens[0] == "kubectl" and "apply" in tokens and "-k" in tokens:
                setup.kustomization = ROOT / tokens[tokens.index("-k") + 1]
    assert setup.secret is not None, f"section {title!r} documents no Secret {NAME}"
    assert setup.kustomization is not None, f"section {title!r} applies no kustomization"
    return setup


def placeholders(values: dict[str, str]) -> list[str]:
    return [k for k, v in values.items() if re.search(r"<[^>]+>", v)]


# --- what the kubelet would run ----------------------------------------------------------


def image_env() -> dict[str, str]:
    """The ENV of the Dockerfile's final stage (PATH aside)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final = re.split(r"^FROM ", text, flags=re.MULTILINE)[-1]
    env: dict[str, str] = {}
    for line in final.splitlines():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                name, _, value = pair.partition("=")
                env[name] = value
    env.pop("PATH", None)
    return env


def workload(kustomization: Path, kind: str) -> Object:
    """The pod template of the one `kind` that `kubectl apply -k` would send."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(kustomization)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    found = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] == kind]
    assert len(found) == 1, f"{kustomization}: {len(found)} {kind}s"
    template: Object = found[0]["spec"]["template"]
    return template


def container_env(container: Object, setup: Setup) -> dict[str, str]:
    sources = {"configMap": setup.configmap, "secret": setup.secret}
    env = image_env()
    for source in container.get("envFrom", []):
        (kind_ref, ref), *_ = [(k, v) for k, v in source.items() if k.endswith("Ref")]
        kind = kind_ref.removesuffix("Ref")
        assert ref["name"] == NAME, ref
        data = sources[kind]
        if data is None:
            assert ref.get("optional"), f"{container['name']}: no {kind} {NAME} documented"
            continue
        env |= {source.get("prefix", "") + k: v for k, v in data.items()}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        value_from = item["valueFrom"]
        if "fieldRef" in value_from:
            env[item["name"]] = POD_FIELDS[value_from["fieldRef"]["fieldPath"]]
            continue
        (kind_ref, ref), *_ = [(k, v) for k, v in value_from.items() if k.endswith("KeyRef")]
        data = sources[kind_ref.removesuffix("KeyRef")] or {}
        assert ref["name"] == NAME, ref
        if ref["key"] in data:
            env[item["name"]] = data[ref["key"]]
        else:
            assert ref.get("optional"), (
                f"{container['name']}: {item['name']} needs key {ref['key']} of "
                f"{kind_ref.removesuffix('KeyRef')} {NAME}, which the README does not set: "
                "the pod would not start"
            )
    return env


def local(env: dict[str, str], workdir: Path, **servers: str) -> dict[str, str]:
    """The pod's environment on this machine: its folders here, the servers the test's."""
    env = dict(env)
    env.pop("PORT", None)  # ManagerProcess listens on a free port
    env["DATA_DIR"] = str(workdir / "data")
    env["MIGRATIONS_DIR"] = str(ROOT / "migrations")  # the image copies them to /app
    env["HOME"] = str(workdir)  # no ~/.kube/config or ~/.config/lfgnode of the developer's
    for name, value in servers.items():
        if name in env:
            env[name] = value
    return env


def run_init_containers(template: Object, setup: Setup, workdir: Path, **servers: str) -> None:
    for container in template["spec"].get("initContainers", []):
        env = local(container_env(container, setup), workdir, **servers)
        done = subprocess.run(
            [sys.executable, "-m", "app", *container["args"]],
            env={"PATH": os.environ.get("PATH", ""), **env},
            cwd=workdir, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (
            f"init container {container['name']} exited with {done.returncode}: {done.stderr}"
        )


def start_manager(
    template: Object, setup: Setup, workdir: Path, extra: dict[str, str], **servers: str
) -> ManagerProcess:
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "manager"]
    assert container["args"] == ["serve"], container["args"]
    env = local(container_env(container, setup), workdir, **servers) | extra
    assert env["APP_ENV"] == "production"
    process = ManagerProcess(env=env, workdir=workdir)
    try:
        process.start(timeout=60)
    except (RuntimeError, TimeoutError):
        process.stop()
        raise
    return process


# --- the tests ---------------------------------------------------------------------------


@pytest.fixture
def registry(postgres_server: EmbeddedPostgres) -> Iterator[str]:
    with fresh_database_sync(postgres_server.url) as url:
        yield url


def backend_for(setup: Setup, node_id: str | None) -> LocalBackend:
    assert setup.secret is not None
    key = parse_private_key(setup.secret["NODE_PRIVATE_KEY"])
    return LocalBackend(node_id or node_id_for(key.public_key()), key.public_key())


def status(process: ManagerProcess, setup: Setup) -> Object:
    assert setup.secret is not None
    token = setup.secret["API_TOKEN"]
    answer = httpx.get(
        f"{process.url}/v1/status", headers={"authorization": f"Bearer {token}"}, timeout=5
    )
    assert answer.status_code == 200, answer.text
    body: Object = answer.json()
    return body


def fleet_streams(nats_url: str, workdir: Path) -> None:
    """The fleet's job streams, made once for all nodes by `init-streams` (k8s/nats/README.md);
    production managers do not make them."""
    done = subprocess.run(
        [sys.executable, "-m", "app", "init-streams"],
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), "NATS_URL": nats_url},
        cwd=workdir, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def components_ok(process: ManagerProcess, setup: Setup, names: tuple[str, ...]) -> Object:
    """/v1/status once the named components are ok (they start with the manager)."""
    deadline = time.monotonic() + 30
    while True:
        body = status(process, setup)
        states = {name: body["components"][name] for name in names}
        if all(c["state"] == "ok" for c in states.values()):
            return body
        assert time.monotonic() < deadline, states
        time.sleep(0.2)


def check_started(process: ManagerProcess, setup: Setup, backend: LocalBackend) -> Object:
    """Ready, its first signed report accepted, and nothing secret in its log."""
    assert httpx.get(f"{process.url}/readyz", timeout=5).status_code == 200
    backend.wait_for_reports(1, timeout=30)
    assert backend.rejected == [], [r.rejected_reason for r in backend.rejected]
    assert all(r.verified for r in backend.requests)
    body = status(process, setup)
    assert body["node"]["env"] == "production"
    assert body["components"]["report"]["state"] == "ok", body["components"]["report"]
    assert setup.secret is not None
    seed = setup.secret["NODE_PRIVATE_KEY"].splitlines()[1]  # a line of the PEM's body
    assert seed not in process.log() and seed not in json.dumps(body)
    return body


def test_the_documented_manager_setup_starts(
    tmp_path: Path,
    registry: str,
    nats_server: EmbeddedNats,
    manager_kubeconfig: Path,
) -> None:
    setup = documented("Base: the manager", tmp_path)
    assert setup.secret is not None
    assert placeholders(setup.secret | (setup.configmap or {})) == []
    template = workload(setup.kustomization or ROOT, "Deployment")
    backend = backend_for(setup, node_id=None)
    with backend.serve() as server:
        servers = {"NODE_SYSTEM_ENDPOINT": server.url, "NATS_URL": nats_server.url}
        servers |= dict.fromkeys(DATABASE_KEYS, registry)
        run_init_containers(template, setup, tmp_path, **servers)
        fleet_streams(nats_server.url, tmp_path)
        # in the pod: the ServiceAccount's token; here: the same account's, as a kubeconfig
        extra = {"KUBECONFIG": str(manager_kubeconfig)}
        process = start_manager(template, setup, tmp_path, extra, **servers)
        try:
            check_started(process, setup, backend)
            body = components_ok(process, setup, ("sync", "registry", "worker"))
            assert body["node"]["id"] == backend.node_id
        finally:
            process.stop()


def test_the_documented_worker_setup_starts(
    tmp_path: Path, registry: str, nats_server: EmbeddedNats
) -> None:
    setup = documented("Overlay: job worker", tmp_path)
    assert setup.secret is not None
    assert placeholders(setup.secret | (setup.configmap or {})) == []
    template = workload(setup.kustomization or ROOT, "DaemonSet")
    assert template["spec"]["serviceAccountName"] == "workload-manager-worker"
    backend = backend_for(setup, node_id=FAKE_NODE)  # NODE_ID comes from spec.nodeName
    with backend.serve() as server:
        servers = {"NODE_SYSTEM_ENDPOINT": server.url, "NATS_URL": nats_server.url}
        servers |= dict.fromkeys(DATABASE_KEYS, registry)
        run_init_containers(template, setup, tmp_path, **servers)
        fleet_streams(nats_server.url, tmp_path)
        process = start_manager(template, setup, tmp_path, {}, **servers)
        try:
            check_started(process, setup, backend)
            body = components_ok(process, setup, ("registry", "worker"))
            assert body["node"]["id"] == FAKE_NODE
            assert not body["components"]["sync"]["enabled"], body["components"]["sync"]
        finally:
            process.stop()
