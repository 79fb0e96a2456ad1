"""The manager's whole job on a real node: its own image in a pod the kubelet started, with the
ServiceAccount token the kubelet mounted, beside workload containers that really ping it,
crash and get replaced, and a self-update that swaps its own image.

One installation for the module (tests/node/conftest.py): the tests run in file order, each
on the state the one before left (the self-update ones last)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from app.domain.manifests import VERSION_ANNOTATION
from app.domain.rollout_machine import RECORD_ANNOTATION
from app.domain.tokens import ping_token
from standins.control_plane import ROOT
from standins.sync_world import manifest
from tests.support.node import NODE_NAME
from tests.support.node_world import (
    GOOD,
    NEVER_READY,
    OWN_NS,
    PINGER,
    WORKLOADS,
    NodeWorld,
    ready,
    until,
)
from tests.support.version_file import REPO

# the first test starts the node and installs the manager: minutes on a busy machine
pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]

LOAD_SECONDS = 20  # the ping load of the memory reading
CONFIRMED = "workload-manager.io/update-confirmed"
FAILED_VERSIONS = "workload-manager.io/failed-versions"
RESTRICTED = {
    "runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}  # fmt: skip


def pinger(name: str, version: str, **env: str) -> dict[str, Any]:
    body = manifest(name, version, image=PINGER, env={"PING_INTERVAL": "2", **env})
    container = body["spec"]["template"]["spec"]["containers"][0]
    container["imagePullPolicy"] = "Never"
    container["securityContext"] = RESTRICTED
    return body


def desire(world: NodeWorld, **workloads: dict[str, Any]) -> None:
    for name, body in workloads.items():
        world.backend.set_manifest(name, "1.0.0", body)
    world.backend.set_desired([{"name": name, "version": "1.0.0"} for name in workloads])


def image_of(deployment: dict[str, Any]) -> str:
    found: str = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    return found


def own(world: NodeWorld) -> dict[str, Any]:
    found = world.get("deployment", "workload-manager", OWN_NS)
    assert found is not None
    return found


def running_version(world: NodeWorld, version: str) -> list[dict[str, Any]]:
    """The manager's ready pods, when every one of them runs `version`'s image."""
    pods = [p for p in world.manager_pods() if not p["metadata"].get("deletionTimestamp")]
    images = {p["spec"]["containers"][0]["image"] for p in pods}
    if images == {f"{REPO}:{version}"} and all(ready(p) for p in pods):
        return pods
    return []


def test_the_manager_runs_from_its_image_under_the_kubelet(world: NodeWorld) -> None:
    pods = until("the manager Ready", lambda: running_version(world, "0.1.0"), timeout=180)
    pod = pods[0]
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert pod["spec"]["serviceAccountName"] == "workload-manager"
    # the kubelet ran the migrations' init container from the same image, to completion
    init = pod["status"]["initContainerStatuses"][0]
    assert init["name"] == "migrate" and init["state"]["terminated"]["exitCode"] == 0
    identity = json.loads(world.exec_manager(
        "import os, json, app; print(json.dumps([os.getuid(), os.getgid(), app.__version__,"
        " os.path.exists('/var/run/secrets/kubernetes.io/serviceaccount/token')]))"
    ))  # fmt: skip
    assert identity == [10001, 10001, "0.1.0", True]
    # its signed reports reach the backend (which checks the signature) from the pod
    report = until("a report from the pod", world.latest_report)
    assert report["manager_version"] == "0.1.0"


def test_a_desired_workload_is_created_and_pings_healthy(world: NodeWorld) -> None:
    desire(world, web=pinger("web", "1.0.0"))
    until("web's pod running", lambda: [
        p for p in world.pods(WORKLOADS, "app=web") if ready(p)
    ])  # fmt: skip
    shown = until(
        "web healthy in a report",
        lambda: (w := world.workload("web")) and w["status"] == "healthy" and w,
    )
    assert shown["deployed_version"] == "1.0.0"


def test_a_workload_that_stops_pinging_gets_a_new_pod_that_pings_again(
    world: NodeWorld,
) -> None:
    desire(world, web=pinger("web", "1.0.0"), quiet=pinger("quiet", "1.0.0",
                                                            STOP_PINGING_AFTER="6"))  # fmt: skip
    first = until("quiet's pod ready", lambda: [
        p for p in world.pods(WORKLOADS, "app=quiet") if ready(p)
    ])[0]["metadata"]["uid"]  # fmt: skip
    until("quiet stale", lambda: (w := world.workload("quiet")) and w["status"] == "stale")

    def replaced() -> list[dict[str, Any]]:
        return [
            p for p in world.pods(WORKLOADS, "app=quiet")
            if p["metadata"]["uid"] != first and ready(p)
        ]  # fmt: skip

    try:
        second = until("a rollout restart's new pod", replaced, timeout=120)[0]
    except AssertionError as exc:  # what uptime management and the loops said of it
        shown = world.status()
        raise AssertionError(
            f"{exc}; uptime: {shown['components']['uptime']}; loops: {shown['loops']}"
        ) from None
    restarted = world.get("deployment", "quiet", WORKLOADS)
    assert restarted is not None
    assert "kubectl.kubernetes.io/restartedAt" in (
        restarted["spec"]["template"]["metadata"].get("annotations") or {}
    ), "a rollout restart, as `kubectl rollout restart` makes it"
    started = datetime.fromisoformat(second["status"]["startTime"])
    until(
        "a ping from the new pod",
        lambda: (
            (w := world.workload("quiet"))
            and w["status"] == "healthy"
            and datetime.fromisoformat(w["last_ping_at"]) > started
        ),
    )


def test_a_container_that_exits_reaches_crashloopbackoff_and_an_alert(world: NodeWorld) -> None:
    desire(world, web=pinger("web", "1.0.0"), crash=pinger("crash", "1.0.0", EXIT_CODE="1"))

    def backing_off() -> bool:
        for pod in world.pods(WORKLOADS, "app=crash"):
            for status in pod.get("status", {}).get("containerStatuses") or []:
                if (status.get("state", {}).get("waiting") or {}).get("reason") == (
                    "CrashLoopBackOff"
                ):
                    return True
        return False

    until("the kubelet's CrashLoopBackOff", backing_off, timeout=120)
    shown = until(
        "crash crashlooping in a report",
        lambda: (w := world.workload("crash")) and w["status"] == "crashlooping" and w,
    )
    assert "CrashLoopBackOff" in (shown["message"] or "")
    until(
        "an alert naming it",
        lambda: [m for m in world.matrix.messages.values() if "crash" in m],
    )


def working_set(world: NodeWorld, pod: dict[str, Any]) -> tuple[int, int]:
    """The manager container's working set as the kubelet's summary API reports it, and
    as its memory cgroup gives it (usage less inactive file pages, what the kubelet
    computes)."""
    raw = world.kubectl("get", "--raw", f"/api/v1/nodes/{NODE_NAME}/proxy/stats/summary")
    summary = json.loads(raw)
    reported = next(
        c["memory"]["workingSetBytes"]
        for p in summary["pods"] if p["podRef"]["name"] == pod["metadata"]["name"]
        for c in p["containers"] if c["name"] == "manager"
    )  # fmt: skip
    container = pod["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
    base = Path("/sys/fs/cgroup/memory") / world.node.cgroup_root.lstrip("/")
    cgroup = next(base.rglob(container))
    usage = int((cgroup / "memory.usage_in_bytes").read_text())
    stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    return int(reported), usage - int(stat["total_inactive_file"])


def test_the_managers_memory_idle_and_under_ping_load(world: NodeWorld) -> None:
    """Measured, not judged (the target is the benchmark's and the closing note's)."""
    pod = until("one ready manager", lambda: running_version(world, "0.1.0"))[0]
    idle = until("an idle reading", lambda: (r := working_set(world, pod))[0] > 0 and r)
    # wrk (Debian's), four connections each pausing 20 ms after an answer: about 200
    # pings/s, from the 50 workloads in turn with their own tokens (bench/load/pings.lua)
    tokens = [f"load-{i}={ping_token('node-ping-secret', f'load-{i}')}" for i in range(50)]
    load = subprocess.Popen(
        [*world.node.launcher, shutil.which("wrk") or "wrk", "-t1", "-c4", f"-d{LOAD_SECONDS}s",
         "--timeout", "5s", "-s", str(ROOT / "bench" / "load" / "pings.lua"),
         f"http://{pod['status']['podIP']}:8080", "--",
         '{"status":"healthy","version":"1.0.0"}', *tokens],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PINGS_DELAY_MS": "20"},
    )  # fmt: skip
    peak = idle
    while load.poll() is None:
        peak = max(peak, working_set(world, pod))
    out, _ = load.communicate(timeout=LOAD_SECONDS + 30)
    phase = json.loads(out.strip().splitlines()[-1])
    rate = phase["completed"] / (phase["duration_us"] / 1e6)
    mib = 1024 * 1024
    line = (
        f"manager container working set (kubelet summary / cgroup): idle "
        f"{idle[0] / mib:.1f} / {idle[1] / mib:.1f} MiB; under {rate:.0f} "
        f"pings/s for {LOAD_SECONDS} s: {peak[0] / mib:.1f} / {peak[1] / mib:.1f} MiB"
    )
    print(line)  # noqa: T201 (the measurement, in the test's output)
    (world.node.logs / "memory.txt").write_text(line + "\n" + json.dumps(phase) + "\n")
    transport = {k: phase[k] for k in ("connect", "read", "write", "timeout")}
    assert phase["completed"] > 0 and not any(transport.values()), phase
    assert phase["status_errors"] == 0, phase  # no answer of 400 or more


def env_of(obj: dict[str, Any]) -> dict[str, str]:
    """The first container's plain env, of a pod or of a Deployment's pod template."""
    spec = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    container = spec["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def test_a_version_that_never_pings_healthy_is_reverted_on_the_node(world: NodeWorld) -> None:
    """Safe rollout under the kubelet: 1.1.0's pods really ping, unhealthy, with their
    version; after WORKLOAD_UPDATE_UNHEALTHY_SECONDS the manager puts 1.0.0 back."""
    update = {"min_healthy_seconds": 2, "deadline_seconds": 60}
    good = pinger("canary", "1.0.0", PING_VERSION="1.0.0")
    world.backend.set_manifest("canary", "1.0.0", good)
    world.backend.set_desired([{"name": "canary", "version": "1.0.0", "update": update}])
    until(
        "canary 1.0.0 healthy in a report",
        lambda: (w := world.workload("canary")) and w["status"] == "healthy"
        and w["version"] == "1.0.0" and w["deployed_version"] == "1.0.0",
    )  # fmt: skip
    bad = pinger("canary", "1.1.0", PING_STATUS="unhealthy", PING_VERSION="1.1.0")
    world.backend.set_manifest("canary", "1.1.0", bad)
    world.backend.set_desired([{"name": "canary", "version": "1.1.0", "update": update}])

    def deployed() -> dict[str, Any]:
        found = world.get("deployment", "canary", WORKLOADS)
        assert found is not None
        return found

    until("1.1.0 applied", lambda: deployed()["metadata"]["annotations"].get(
        VERSION_ANNOTATION) == "1.1.0")  # fmt: skip

    def on_good_pods() -> list[dict[str, Any]]:
        pods = [p for p in world.pods(WORKLOADS, "app=canary")
                if not p["metadata"].get("deletionTimestamp")]  # fmt: skip
        if pods and all(ready(p) and env_of(p).get("PING_VERSION") == "1.0.0" for p in pods):
            return pods
        return []

    def rolled_back() -> dict[str, Any] | None:
        obj = deployed()
        if obj["metadata"]["annotations"].get(VERSION_ANNOTATION) != "1.0.0":
            return None
        if env_of(obj).get("PING_VERSION") != "1.0.0" or not on_good_pods():
            return None
        for found in world.status()["workloads"]:
            view = found.get("update") or {}
            if found["name"] == "canary" and view.get("state") == "rolled-back":
                shown: dict[str, Any] = found
                return shown
        return None

    try:
        shown = until("reverted to 1.0.0, its pods running", rolled_back, timeout=120)
    except AssertionError as exc:
        obj = world.get("deployment", "canary", WORKLOADS) or {"metadata": {}}
        raise AssertionError(
            f"{exc}; record: {obj['metadata'].get('annotations', {}).get(RECORD_ANNOTATION)}; "
            f"versions PUT: {[b for n, b in world.backend.versions if n == 'canary']}"
        ) from None
    # what the reports showed meanwhile: 1.1.0's own pods pinging unhealthy
    assert any(
        w["name"] == "canary" and w["status"] == "unhealthy" and w["version"] == "1.1.0"
        for report in world.backend.reports for w in report.get("workloads", [])
    )  # fmt: skip
    assert shown["update"]["failed_versions"] == ["1.1.0"]
    assert "unhealthy" in shown["update"]["reason"]
    for pod in on_good_pods():
        assert "PING_STATUS" not in env_of(pod), "healthy: the pinger's default"
    until("1.0.0 healthy again", lambda: (w := world.workload("canary"))
          and w["status"] == "healthy" and w["version"] == "1.0.0")  # fmt: skip
    (put,) = [b for n, b in world.backend.versions
              if n == "canary" and b.get("outcome") == "rolled_back"]  # fmt: skip
    assert (put["version"], put["attempted_version"]) == ("1.0.0", "1.1.0")
    assert "unhealthy" in put["reason"]
    until("an alert naming the revert", lambda: [
        m for m in world.matrix.messages.values() if "canary" in m and "1.1.0" in m
    ])  # fmt: skip
    # the failed version is not tried again while it stays the desired one
    syncs = len(world.backend.reports)
    until("a few more reports", lambda: len(world.backend.reports) >= syncs + 3)
    assert deployed()["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"
    assert [b for n, b in world.backend.versions
            if n == "canary" and b.get("outcome") == "rolled_back"] == [put]  # fmt: skip


def test_self_update_replaces_its_own_pod_and_the_old_one_exits_on_sigterm(
    world: NodeWorld,
) -> None:
    old = until("one ready manager", lambda: running_version(world, "0.1.0"))[0]
    grace = old["spec"]["terminationGracePeriodSeconds"]
    # to a file, not a pipe: a pipe nobody reads fills (64 KiB) and holds the watch back
    watched = world.node.logs / "old-manager-pod.watch.json"
    with open(watched, "w") as out:
        watch = subprocess.Popen(
            [*world.node.launcher, "kubectl", f"--kubeconfig={world.node.plane.admin_kubeconfig}",  # type: ignore[union-attr]
             "-n", OWN_NS, "get", "pod", old["metadata"]["name"], "--watch", "-o", "json"],
            stdout=out,
        )  # fmt: skip
    try:
        world.versions.set(body=GOOD.encode())
        until("0.2.0 running, the old pod gone", lambda: running_version(world, GOOD),
              timeout=180)  # fmt: skip
        until("the confirmation", lambda: own(world)["metadata"]["annotations"].get(CONFIRMED)
              == GOOD)  # fmt: skip
        until("the old pod gone", lambda: world.get("pod", old["metadata"]["name"], OWN_NS)
              is None)  # fmt: skip
    finally:
        watch.terminate()
        watch.wait(timeout=10)
    seen = watched.read_text()
    states = [json.loads(doc) for doc in _json_documents(seen)]
    last = next(
        state for state in reversed(states)
        if "terminated" in state["status"]["containerStatuses"][0]["state"]
    )  # fmt: skip
    terminated = last["status"]["containerStatuses"][0]["state"]["terminated"]
    # the deletion as first seen: its timestamp is when the grace period ends (later
    # writes move it, the kubelet's final delete to the moment the pod goes)
    first = next(
        state["metadata"] for state in states if state["metadata"].get("deletionTimestamp")
    )
    deadline = datetime.fromisoformat(first["deletionTimestamp"]).timestamp()
    signalled = deadline - first["deletionGracePeriodSeconds"]  # SIGTERM, at the deletion
    took = datetime.fromisoformat(terminated["finishedAt"]).timestamp() - signalled
    print(f"old manager pod exited {took:.0f} s (±1 s) after SIGTERM, grace {grace} s")  # noqa: T201
    assert terminated["exitCode"] == 0, "exited by itself on SIGTERM, not killed at the grace"
    assert took < grace
    report = until("a report from 0.2.0", lambda: (r := world.latest_report())
                   and r["manager_version"] == GOOD)  # fmt: skip
    assert report


def test_an_image_that_never_becomes_ready_is_rolled_back_and_not_tried_again(
    world: NodeWorld,
) -> None:
    world.versions.set(body=NEVER_READY.encode())
    until("0.3.0 tried", lambda: image_of(own(world)) == f"{REPO}:{NEVER_READY}")
    until(
        "rolled back to 0.2.0 with 0.3.0 failed",
        lambda: (
            image_of(own(world)) == f"{REPO}:{GOOD}"
            and NEVER_READY in own(world)["metadata"]["annotations"].get(FAILED_VERSIONS, "")
        ),
        timeout=180,
    )
    until("0.2.0 still serving", lambda: running_version(world, GOOD))
    decided = until(
        "a check that skips 0.3.0",
        lambda: (
            (d := world.status()["components"]["self_update"]["detail"]).get("decision") == "skip"
            and d
        ),
    )
    assert "failed before" in decided["reason"]
    assert image_of(own(world)) == f"{REPO}:{GOOD}"


def test_reapplying_the_install_does_not_undo_the_confirmed_update(world: NodeWorld) -> None:
    """K3S re-applies its auto-deploy folder at every start; the file names 0.1.0. The
    version file is down, so only the manager's own re-assertion can bring 0.2.0 back."""
    world.versions.set(status=503, body=b"unavailable")
    world.apply_install()
    assert image_of(own(world)) == f"{REPO}:0.1.0", "the apply put the install's image back"
    until("0.2.0 again", lambda: running_version(world, GOOD), timeout=240)
    assert own(world)["metadata"]["annotations"][CONFIRMED] == GOOD


def _json_documents(text: str) -> list[str]:
    """Split `kubectl get --watch -o json`'s concatenated objects; the last one may be cut
    short (the watch is ended while it writes), and is left out."""
    decoder, at, found = json.JSONDecoder(), 0, []
    while at < len(text):
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        found.append(text[at:end])
        at = end
    return found
