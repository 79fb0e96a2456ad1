"""A real single-node cluster, like a user's K3S node: the pinned control plane, kubelet,
kube-proxy, containerd, runc and the CNI bridge, all inside a network namespace of its own.

The namespace has a loopback, a bridge without ports that holds the node's address
(`NODE_IP`) and is its default route (what is sent there goes nowhere: there is no way out
of the namespace), and the bridge the CNI plugin makes for the pods, without masquerade.
Every process runs in one private mount namespace (held by a `holder` process with the
network namespace), so no
mount the kubelet or containerd makes reaches the machine's own table, and in a cgroup
subtree of its own (`cgroup_root`, below this process's memory cgroup, in every v1
hierarchy): the kubelet's `cgroupRoot`, and where every process of the node is put, so a
teardown kills what is in it and removes it. Nothing here touches another cgroup, mount or
network.

The node reaches servers on this machine's loopback only through `forward()`: a socat in
the namespace listens on `NODE_IP:port` and hands each connection over a unix socket to a
socat outside, which connects to the loopback server. `expose()` is the other way round (a
port on this machine's loopback that reaches an address inside). The tests reach the API
server through `kubectl` run inside the namespace.

Teardown kills and removes everything (`stop`); if the run is killed outright, the next
`Node.start` sweeps what a dead owner left (its processes, cgroups and files).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from standins.control_plane import ROOT, ControlPlane, ControlPlaneUnavailable

NODE_NAME = "wm-node"
NODE_IP = "10.250.0.1"
POD_SUBNET = "10.88.0.0/24"
API_PORT = 6443
PAUSE_IMAGE = "localhost/pause:3.10"
RUNS = Path("/tmp/wm-node")  # short: unix socket paths are limited to 107 bytes
CGROUPS = Path("/sys/fs/cgroup")
# the v1 hierarchies, and the v2 one beside them that runc's cgroup library also writes to
HIERARCHIES = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids",
               "systemd", "unified")  # fmt: skip
BUILD = ROOT / "tools" / "control-plane" / "build.sh"
REQUIRED = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "socat", "nsenter",
            "unshare", "setpriv", "ip", "iptables", "kubectl", "wrk")  # fmt: skip
CNI_BIN = Path("/usr/lib/cni")


class NodeUnavailable(ControlPlaneUnavailable):
    """A tool is missing (see .ci/run for the Debian packages) or a component failed."""


def node_binaries() -> Path:
    found = subprocess.run([str(BUILD), "--node", "--print"], capture_output=True, text=True)
    if found.returncode == 0:
        return Path(found.stdout.strip().splitlines()[-1])
    built = subprocess.run([str(BUILD), "--node"], capture_output=True, text=True)
    if built.returncode != 0:
        raise NodeUnavailable(f"building kubelet failed:\n{built.stderr[-4000:]}")
    return Path(built.stdout.strip().splitlines()[-1])


def missing_tools() -> list[str]:
    missing = [tool for tool in REQUIRED if shutil.which(tool) is None]
    if not (CNI_BIN / "bridge").exists():
        missing.append(f"{CNI_BIN}/bridge (containernetworking-plugins)")
    return missing


def _memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path.rstrip("/")
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Node:
    run_dir: Path
    logs: Path
    cgroup_root: str  # the same path in every hierarchy
    created: list[Path] = field(default_factory=list)  # cgroup dirs this node made
    holder: subprocess.Popen[bytes] | None = None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    plane: ControlPlane | None = None
    node_bin: Path | None = None

    # -- starting ---------------------------------------------------------------------

    @classmethod
    def start(cls, logs: Path, *, timeout: float = 240.0) -> Node:
        if missing := missing_tools():
            raise NodeUnavailable(f"missing for the real node: {', '.join(missing)}")
        sweep()
        token = f"{os.getpid()}-{secrets.token_hex(3)}"
        run_dir = RUNS / token
        run_dir.mkdir(parents=True)
        logs.mkdir(parents=True, exist_ok=True)
        node = cls(run_dir=run_dir, logs=logs, cgroup_root=f"{_memory_cgroup()}/wm-node-{token}")
        try:
            node._start(time.monotonic() + timeout)
        except BaseException:
            node.stop()
            raise
        return node

    def _start(self, deadline: float) -> None:
        self.node_bin = node_binaries()
        self._cgroups()
        (self.run_dir / "owner").write_text(str(os.getpid()))
        self.holder = self._popen(
            "holder", ["unshare", "--net", "--mount", "--propagation", "slave", "--",
                       "sleep", "infinity"], inside=False,
        )  # fmt: skip
        self._until("the namespaces", deadline, self._holder_ready)
        self._network()
        # names are the node's DNS's to answer (its only server: there is no way out); the
        # bind mount is in the node's own mount namespace only
        (self.run_dir / "resolv.conf").write_text(f"nameserver {NODE_IP}\n")
        self.run("mount", "--bind", str(self.run_dir / "resolv.conf"), "/etc/resolv.conf")
        self._containerd(deadline)
        self.plane = ControlPlane.start(
            self.logs / "control-plane", timeout=max(10.0, deadline - time.monotonic()),
            launcher=self.launcher, address=NODE_IP, api_port=API_PORT, fake_node=False,
        )  # fmt: skip
        self._dns()
        self._kubelet()
        self._kube_proxy()
        self._until("node Ready", deadline, self._node_ready)

    @property
    def launcher(self) -> tuple[str, ...]:
        """Runs a command in the node: its cgroup, network and mount namespaces, and killed
        with this process (PR_SET_PDEATHSIG)."""
        assert self.holder is not None
        return self._wrap(inside=True)

    def _wrap(self, *, inside: bool) -> tuple[str, ...]:
        procs = CGROUPS / "pids" / self.cgroup_root.lstrip("/") / "node" / "cgroup.procs"
        enter: tuple[str, ...] = ()
        if inside:
            assert self.holder is not None
            ns = f"/proc/{self.holder.pid}/ns"
            enter = ("nsenter", f"--net={ns}/net", f"--mount={ns}/mnt", "--")
        return (
            "sh", "-c", f'echo $$ > {procs} && exec setpriv --pdeathsig KILL "$@"', "node",
            *enter,
        )  # fmt: skip

    def _popen(
        self,
        name: str,
        args: Sequence[str],
        *,
        inside: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [*self._wrap(inside=inside), *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.run_dir, env={**os.environ, **(env or {})},
                start_new_session=True,
            )  # fmt: skip
        self.processes[name] = proc
        return proc

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        """A command inside the node (its network and mount namespaces)."""
        done = subprocess.run(
            [*self.launcher, *args], capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise NodeUnavailable(f"{' '.join(args)}: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def _holder_ready(self) -> bool:
        assert self.holder is not None
        try:
            mine = os.readlink("/proc/self/ns/net")
            return os.readlink(f"/proc/{self.holder.pid}/ns/net") != mine
        except OSError:
            return False

    def _cgroups(self) -> None:
        """`cgroup_root` in every hierarchy, each made directory recorded for removal;
        cpuset's need their cpus and mems from the parent before anything can join."""
        for hierarchy in HIERARCHIES:
            base = CGROUPS / hierarchy
            if not base.is_dir():
                continue
            path = base
            for part in [*self.cgroup_root.strip("/").split("/"), "node"]:
                parent, path = path, path / part
                if not path.exists():
                    path.mkdir()
                    self.created.append(path)
                    if hierarchy == "cpuset":
                        for knob in ("cpuset.cpus", "cpuset.mems"):
                            (path / knob).write_text((parent / knob).read_text())
        (self.run_dir / "cgroups.json").write_text(
            json.dumps({"root": self.cgroup_root, "created": [str(p) for p in self.created]})
        )

    def _network(self) -> None:
        for command in (
            "ip link set lo up",
            "ip link add name node0 type bridge",
            f"ip addr add {NODE_IP}/32 dev node0",
            "ip link set node0 up",
            "ip route add default dev node0",
            "sysctl -qw net.ipv4.ip_forward=1",
        ):
            self.run(*command.split())

    # -- containerd, kubelet, kube-proxy ----------------------------------------------

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd" / "containerd.sock"

    def _containerd(self, deadline: float) -> None:
        base = self.run_dir / "containerd"
        cni = self.run_dir / "cni"
        for path in (base, cni / "net.d", cni / "ipam"):
            path.mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-bridge.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "wm-node",
            "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                "hairpinMode": True,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                         "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(cni / "ipam")},
            }],
        }))  # fmt: skip
        config = base / "config.toml"
        config.write_text(f"""version = 2
root = "{base / "root"}"
state = "{base / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{base / "ttrpc.sock"}"
[debug]
  level = "warn"
[plugins."io.containerd.internal.v1.opt"]
  path = "{base / "opt"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # this machine's root lacks CAP_SYS_RESOURCE: no sandbox starts without it
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{base / "runc"}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni / "net.d"}"
""")
        self._popen("containerd", ["containerd", "--config", str(config)])
        self._until("containerd", deadline, lambda: self.ctr("version", check=False) is not None)

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> str | None:
        done = subprocess.run(
            [*self.launcher, "ctr", f"--address={self.containerd_socket}", "-n", "k8s.io", *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if done.returncode != 0:
            if check:
                raise NodeUnavailable(f"ctr {' '.join(args)}: {done.stderr.strip()[-2000:]}")
            return None
        return done.stdout

    def import_image(self, archive: Path) -> None:
        """An OCI archive into the CRI's image store (as `lfgnode` would side-load one)."""
        self.ctr("images", "import", str(archive))

    def _dns(self) -> None:
        assert self.plane is not None
        pki = self.plane.pki
        self._popen("dns", [
            sys.executable, "-m", "tests.support.node_dns", f"--listen={NODE_IP}",
            f"--server={self.plane.url}", f"--ca={self.plane.ca}",
            f"--cert={pki / 'admin.crt'}", f"--key={pki / 'admin.key'}",
        ], env={"PYTHONPATH": str(ROOT)})  # fmt: skip

    def _kubelet(self) -> None:
        assert self.plane is not None and self.node_bin is not None
        kubelet = self.run_dir / "kubelet"
        kubelet.mkdir()
        kubeconfig = self.plane.client_kubeconfig(
            "kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}"
        )
        config = kubelet / "config.json"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # this machine's cgroups are v1 (see docs/test-control-plane.md)
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root,
            "cgroupsPerQOS": True, "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "address": NODE_IP, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.plane.ca)}},
            "authorization": {"mode": "Webhook"},
            "resolvConf": str(self.run_dir / "resolv.conf"),
            "clusterDNS": [NODE_IP], "clusterDomain": "cluster.local",
            "podLogsDir": str(self.run_dir / "pod-logs"),
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False, "registerNode": True,
            "nodeStatusUpdateFrequency": "4s", "syncFrequency": "10s",
            "fileCheckFrequency": "20s", "staticPodPath": "",
            "localStorageCapacityIsolation": True, "makeIPTablesUtilChains": True,
        }))  # fmt: skip
        self._popen("kubelet", [
            str(self.node_bin / "kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={kubelet / 'root'}", f"--cert-dir={kubelet / 'pki'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}", "--v=1",
        ])  # fmt: skip

    def _kube_proxy(self) -> None:
        assert self.plane is not None and self.node_bin is not None
        kubeconfig = self.plane.client_kubeconfig("kube-proxy", "/CN=system:kube-proxy")
        config = self.run_dir / "kube-proxy.json"
        config.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)}, "mode": "iptables",
            "hostnameOverride": NODE_NAME, "bindAddress": NODE_IP, "clusterCIDR": POD_SUBNET,
            "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
            # the conntrack table's size is the machine's, not the namespace's: left alone
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }))  # fmt: skip
        self._popen("kube-proxy", [str(self.node_bin / "kube-proxy"), f"--config={config}"])

    def _node_ready(self) -> bool:
        assert self.plane is not None
        done = self.plane.kubectl(
            "wait", "--for=condition=Ready", f"node/{NODE_NAME}", "--timeout=2s", check=False
        )
        return done.returncode == 0

    def _until(self, what: str, deadline: float, check: Any) -> None:
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    log = self.logs / f"{name}.log"
                    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                    raise NodeUnavailable(f"{name} exited ({proc.returncode}): {tail}")
            if check():
                return
            time.sleep(0.2)
        raise NodeUnavailable(f"timed out waiting for {what}")

    # -- reaching the machine's loopback ------------------------------------------------

    def forward(self, port: int, to_port: int) -> str:
        """`NODE_IP:port` inside the node reaches `127.0.0.1:to_port` outside; the URL host."""
        sock = self.run_dir / f"fwd-{port}.sock"
        self._popen(f"forward-{port}-out", [
            "socat", f"UNIX-LISTEN:{sock},fork,unlink-early", f"TCP:127.0.0.1:{to_port}",
        ], inside=False)  # fmt: skip
        deadline = time.monotonic() + 10
        self._until(f"forward {port}", deadline, sock.exists)
        self._popen(f"forward-{port}-in", [
            "socat", f"TCP-LISTEN:{port},bind={NODE_IP},fork,reuseaddr", f"UNIX-CONNECT:{sock}",
        ])  # fmt: skip
        return f"{NODE_IP}:{port}"

    def expose(self, target: str, host_port: int) -> str:
        """`127.0.0.1:host_port` outside reaches `target` (`address:port`) inside the node:
        `forward()` the other way round. The URL host on this machine."""
        sock = self.run_dir / f"expose-{host_port}.sock"
        self._popen(f"expose-{host_port}-in", [
            "socat", f"UNIX-LISTEN:{sock},fork,unlink-early", f"TCP:{target}",
        ])  # fmt: skip
        deadline = time.monotonic() + 10
        self._until(f"expose {target}", deadline, sock.exists)
        self._popen(f"expose-{host_port}-out", [
            "socat", f"TCP-LISTEN:{host_port},bind=127.0.0.1,fork,reuseaddr",
            f"UNIX-CONNECT:{sock}",
        ], inside=False)  # fmt: skip
        return f"127.0.0.1:{host_port}"

    # -- stopping ---------------------------------------------------------------------

    def stop(self) -> None:
        """The kubelet first (so it starts no container while the rest goes), then every
        process in the node's cgroups, its cgroups, its files (the logs stay in `logs`)."""
        pod_logs = self.run_dir / "pod-logs"
        if pod_logs.is_dir():  # the containers' logs, kept with the others
            shutil.copytree(pod_logs, self.logs / "pod-logs", symlinks=False, dirs_exist_ok=True)
        kubelet = self.processes.get("kubelet")
        if kubelet is not None and kubelet.poll() is None:
            kubelet.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                kubelet.wait(timeout=10)
        _kill_cgroup(self.cgroup_root)
        started = list(self.processes.values())
        if self.plane is not None:
            started += self.plane.processes.values()
            self.plane.processes.clear()
        for proc in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        _remove(self.run_dir, [str(p) for p in self.created])


def _pids(cgroup_root: str) -> Iterator[int]:
    base = CGROUPS / "pids" / cgroup_root.lstrip("/")
    if not base.is_dir():
        return
    for procs in base.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            yield from (int(pid) for pid in procs.read_text().split())


def _kill_cgroup(cgroup_root: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = list(_pids(cgroup_root))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove(run_dir: Path, created: list[str]) -> None:
    """The cgroup directories this node made, children first: below its own `wm-node-*`
    directory everything (the kubelet's too), above it only the ones it made itself."""
    for path in sorted(created, key=len, reverse=True):
        directory = Path(path)
        if directory.name.startswith("wm-node-") and directory.is_dir():
            children = [p for p in directory.rglob("*") if p.is_dir()]
            for child in sorted(children, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            directory.rmdir()
    shutil.rmtree(run_dir, ignore_errors=True)


def sweep() -> None:
    """What a node whose owner died left behind: its processes, cgroups and files."""
    if not RUNS.is_dir():
        return
    for run_dir in RUNS.iterdir():
        try:
            owner = int((run_dir / "owner").read_text())
        except (OSError, ValueError):
            owner = int(run_dir.name.split("-")[0]) if run_dir.name.split("-")[0].isdigit() else 0
        if owner and _alive(owner):
            continue
        try:
            recorded = json.loads((run_dir / "cgroups.json").read_text())
            root, created = str(recorded["root"]), [str(p) for p in recorded["created"]]
        except (OSError, ValueError, KeyError, TypeError):
            root, created = "", []
        if Path(root).name.startswith("wm-node-"):
            _kill_cgroup(root)
        _remove(run_dir, created)
