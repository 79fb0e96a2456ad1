"""A real Kubernetes control plane for the tests: etcd, kube-apiserver (RBAC, ServiceAccount
tokens), kube-controller-manager, kube-scheduler and kwok (nodes and pod lifecycles without
a kubelet), all on loopback ports, from the binaries `make control-plane` builds
(tools/control-plane/build.sh, cached outside the repo).

`ControlPlane.start(workdir)` returns once a fake node is Ready and the controllers run;
`stop()` ends every process. Each process logs to `workdir/<name>.log`, kept with the
test run. The tests act as an admin (a client certificate in `system:masters`); the
manager under test gets a ServiceAccount token of its own (`token_for`), so RBAC decides
what it may do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.adapters.embedded import free_port

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "tools" / "control-plane" / "build.sh"
SERVICE_CIDR = "10.96.0.0/16"
FAKE_NODE = "kwok-node-0"

_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = placeholder
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,\
DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.96.0.1{extra_sans}
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
"""

_NODE = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {
        "name": FAKE_NODE,
        "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        "labels": {
            "kubernetes.io/hostname": FAKE_NODE,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
        },
    },
    "status": {
        "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "2000"},
        "capacity": {"cpu": "64", "memory": "256Gi", "pods": "2000"},
    },
}

MANAGER_ACCOUNT = ("workload-manager", "workload-manager")  # namespace, ServiceAccount


# A pod whose first container's image tag ends with `never-ready` or `rc666` (a version the
# self-update accepts, such as `0.3.0rc666`) is never made Ready by kwok: a rollout of it
# stalls until its progressDeadlineSeconds (an image that "never becomes ready").
NEVER_READY_VERSION = "0.3.0rc666"
_NEVER_READY_PATTERN = "(never-ready|rc666)$"
_POD_READY_SELECTOR = """    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Pending'
"""
_NEVER_READY = f"""    - key: '.spec.containers.[0].image | test("{_NEVER_READY_PATTERN}")'
      operator: 'NotIn'
      values:
      - 'true'
"""


def _with_never_ready(stages: str) -> str:
    """kwok's default stages, with pods of never-ready images left out of `pod-ready`."""
    start = stages.index("name: pod-ready")
    at = stages.index(_POD_READY_SELECTOR, start) + len(_POD_READY_SELECTOR)
    return stages[:at] + _NEVER_READY + stages[at:]


class ControlPlaneUnavailable(RuntimeError):
    """The binaries are not built (run `make control-plane`) or a server did not start."""


def binaries() -> Path:
    """The directory of the built binaries; builds them when missing (minutes, once)."""
    found = subprocess.run([str(BUILD), "--print"], capture_output=True, text=True, check=False)
    if found.returncode == 0:
        return Path(found.stdout.strip().splitlines()[-1])
    if os.environ.get("CONTROL_PLANE_NO_BUILD"):
        raise ControlPlaneUnavailable("control plane not built: run `make control-plane`")
    built = subprocess.run([str(BUILD)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise ControlPlaneUnavailable(f"make control-plane failed:\n{built.stderr[-4000:]}")
    return Path(built.stdout.strip().splitlines()[-1])


@dataclass
class ControlPlane:
    """`launcher` runs every process (kubectl too) through a prefix, such as the real node's
    `nsenter` into its network namespace; `address` is where the API server listens and
    what it advertises (the `kubernetes` Service's endpoint); without `fake_node` no kwok
    runs and the nodes are real kubelets."""

    workdir: Path
    bin: Path
    api_port: int
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    launcher: tuple[str, ...] = ()
    address: str = "127.0.0.1"
    fake_node: bool = True

    @property
    def url(self) -> str:
        return f"https://{self.address}:{self.api_port}"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def ca(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    # -- start and stop ----------------------------------------------------------------

    @classmethod
    def start(
        cls,
        workdir: Path,
        *,
        timeout: float = 120.0,
        launcher: Sequence[str] = (),
        address: str = "127.0.0.1",
        api_port: int | None = None,
        fake_node: bool = True,
    ) -> ControlPlane:
        workdir.mkdir(parents=True, exist_ok=True)
        plane = cls(
            workdir=workdir, bin=binaries(), api_port=api_port or free_port(),
            launcher=tuple(launcher), address=address, fake_node=fake_node,
        )  # fmt: skip
        try:
            plane._start(timeout)
        except BaseException:
            plane.stop()
            raise
        return plane

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._certificates()
        self._write_admin_kubeconfig()
        etcd_port, peer_port = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                "--name=test", f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true", "--log-level=warn",
            ],
        )  # fmt: skip
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={self.address}", f"--advertise-address={self.address}",
                f"--secure-port={self.api_port}",
                # kwok's nodes are not reachable: no endpoint for the `kubernetes` Service;
                # on the real node its pods reach the API server through it
                f"--endpoint-reconciler-type={'none' if self.fake_node else 'lease'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={self.ca}",
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                # to a real kubelet (exec, logs) as the admin: the kubelet asks the API
                # server whether that identity may
                f"--kubelet-client-certificate={pki / 'admin.crt'}",
                f"--kubelet-client-key={pki / 'admin.key'}",
                "--kubelet-preferred-address-types=InternalIP",
            ],
        )  # fmt: skip
        self._until(
            "kube-apiserver ready",
            deadline,
            lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
        )
        kubeconfig = str(self.admin_kubeconfig)
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}", "--leader-elect=false", "--controllers=*",
                "--use-service-account-credentials=false",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={self.ca}",
                f"--cluster-signing-cert-file={self.ca}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
            ],
        )  # fmt: skip
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}", "--leader-elect=false",
            ],
        )  # fmt: skip
        self._until(
            "the default ServiceAccount", deadline,
            lambda: self.kubectl("-n", "default", "get", "serviceaccount", "default",
                                 check=False).returncode == 0,
        )  # fmt: skip
        if not self.fake_node:
            return
        stages = self.workdir / "kwok-stages.yaml"
        stages.write_text(_with_never_ready((self.bin / "kwok-stages.yaml").read_text()))
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={kubeconfig}", f"--config={stages}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--node-lease-duration-seconds=40", "--cidr=10.244.0.0/16",
                "--node-ip=127.0.0.1",
            ],
            env={"HOME": str(self.workdir)},
        )  # fmt: skip
        self.apply(_NODE)
        self._until(
            "fake node Ready", deadline,
            lambda: self.kubectl("wait", "--for=condition=Ready", f"node/{FAKE_NODE}",
                                 "--timeout=2s", check=False).returncode == 0,
        )  # fmt: skip

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                [*self.launcher, str(self.bin / name), *args],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip

    def _until(self, what: str, deadline: float, check: Any) -> None:
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise ControlPlaneUnavailable(f"{name} exited: {self.log(name)[-3000:]}")
            if check():
                return
            time.sleep(0.2)
        raise ControlPlaneUnavailable(f"timed out waiting for {what}")

    def stop(self) -> None:
        for proc in reversed(list(self.processes.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- certificates and kubeconfigs --------------------------------------------------

    def _certificates(self) -> None:
        pki = self.pki
        pki.mkdir(exist_ok=True)
        extra = "".join(f",IP:{ip}" for ip in {self.address} - {"127.0.0.1"})
        (pki / "openssl.cnf").write_text(_OPENSSL_CNF.format(extra_sans=extra))
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        cnf = ["-config", str(pki / "openssl.cnf")]

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)

        openssl("req", "-x509", "-new", "-nodes", *key, "-days", "2", *cnf, "-extensions",
                "ca", "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
        for name, subject, kind in (
            ("apiserver", "/CN=kube-apiserver", "server"),
            ("admin", "/O=system:masters/CN=test-admin", "client"),
        ):
            openssl("req", "-new", "-nodes", *key, *cnf, "-subj", subject,
                    "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
            openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                    "-CAcreateserial", "-days", "2", "-extfile", "openssl.cnf",
                    "-extensions", kind, "-out", f"{name}.crt")  # fmt: skip
        # the aggregation layer's CA: without it the controllers log a missing CA bundle
        openssl("req", "-x509", "-new", "-nodes", *key, "-days", "2", *cnf, "-extensions",
                "ca", "-subj", "/CN=test-front-proxy-ca", "-keyout", "front-proxy-ca.key",
                "-out", "front-proxy-ca.crt")  # fmt: skip
        openssl("req", "-new", "-nodes", *key, *cnf, "-subj", "/CN=front-proxy-client",
                "-keyout", "front-proxy-client.key", "-out", "front-proxy-client.csr")  # fmt: skip
        openssl("x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
                "-CAkey", "front-proxy-ca.key", "-CAcreateserial", "-days", "2", "-extfile",
                "openssl.cnf", "-extensions", "client",
                "-out", "front-proxy-client.crt")  # fmt: skip
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                "-out", "sa.key")  # fmt: skip
        openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")

    def client_kubeconfig(self, name: str, subject: str) -> Path:
        """A kubeconfig with a client certificate of `subject` (`/O=group/CN=user`), signed
        by the cluster's CA: the identities of the real node's kubelet and kube-proxy."""
        pki = self.pki
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)

        openssl("req", "-new", "-nodes", *key, "-config", "openssl.cnf", "-subj", subject,
                "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", "openssl.cnf",
                "-extensions", "client", "-out", f"{name}.crt")  # fmt: skip
        path = self.workdir / f"{name}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": name,
            "clusters": [{"name": "node", "cluster": {
                "server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": name, "user": {
                "client-certificate": str(pki / f"{name}.crt"),
                "client-key": str(pki / f"{name}.key")}}],
            "contexts": [{"name": name, "context": {"cluster": "node", "user": name}}],
        }))  # fmt: skip
        return path

    def _write_admin_kubeconfig(self) -> None:
        pki = self.pki
        self.admin_kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {
                "server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": "admin", "user": {
                "client-certificate": str(pki / "admin.crt"),
                "client-key": str(pki / "admin.key")}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        }))  # fmt: skip

    def write_kubeconfig(
        self, path: Path, *, token: str, namespace: str, server: str | None = None
    ) -> Path:
        """A kubeconfig that authenticates with `token` (a ServiceAccount's), against the
        API server or, with `server`, a proxy in front of it (plain HTTP)."""
        cluster: dict[str, Any] = {"server": server or self.url}
        if server is None or server.startswith("https"):
            cluster["certificate-authority"] = str(self.ca)
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "manager",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": "manager", "user": {"token": token}}],
            "contexts": [{"name": "manager", "context": {
                "cluster": "test", "user": "manager", "namespace": namespace}}],
        }))  # fmt: skip
        return path

    # -- acting as the admin -----------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise ControlPlaneUnavailable("kubectl not found (Debian: kubernetes-client)")
        result = subprocess.run(
            [*self.launcher, kubectl, f"--kubeconfig={self.admin_kubeconfig}", *args],
            input=input, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    def apply(self, *objects: dict[str, Any]) -> None:
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
        self.kubectl("apply", "--server-side", "--field-manager=test-admin", "-f", "-", input=body)

    def token_for(self, namespace: str, service_account: str, *, hours: int = 2) -> str:
        return self.kubectl(
            "-n", namespace, "create", "token", service_account, f"--duration={hours}h"
        ).stdout.strip()

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        found = self.kubectl(
            "-n", namespace, "get", kind, name, "-o", "json", "--show-managed-fields",
            check=False,
        )  # fmt: skip
        if found.returncode != 0:
            if "NotFound" in found.stderr:
                return None
            raise RuntimeError(found.stderr)
        obj: dict[str, Any] = json.loads(found.stdout)
        return obj

    def list(self, kind: str, namespace: str, *selector: str) -> list[dict[str, Any]]:
        args = ["-n", namespace, "get", kind, "-o", "json"]
        if selector:
            args += ["-l", ",".join(selector)]
        items: list[dict[str, Any]] = json.loads(self.kubectl(*args).stdout)["items"]
        return items
