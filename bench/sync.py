"""The sync benchmark: the Syncer, built as the app builds it, against a local backend and
a real Kubernetes control plane.

N desired workloads (1,000; 100 with --quick), each with a manifest, on the local backend
(signatures checked) and a real kube-apiserver and deployment controller (kwok nodes, see
bench/cluster.py): converge from empty, a second sync, steady-state syncs (target: exactly
2 requests) and a bump of 10% of the versions, at the default SYNC_CONCURRENCY and at 16.
The backend runs in a thread of this process, the control plane in its own processes; the
manager uses its own ServiceAccount token. The Kubernetes requests are counted by the API
server (its apiserver_request_total), taken before and after each timed sync.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.domain.manifests import MANAGED_SELECTOR, VERSION_ANNOTATION
from app.services.runtime import build_runtime, open_sync_only
from app.services.syncing import Syncer, SyncOutcome
from app.settings import Settings
from bench import Options, proc
from bench.cluster import (
    ApiserverRequests,
    Key,
    Requests,
    cpu_seconds,
    start,
    write_manager_kubeconfig,
)
from bench.report import CheckFailed, check, mib, say, table
from standins.backend import LocalBackend
from standins.control_plane import ControlPlane
from standins.sync_world import KEY, NAMESPACE, NODE, key_seed, manifest

NAME = "sync"
DESCRIPTION = (
    "1,000 desired workloads against a real kube-apiserver and deployment controller "
    "(kwok nodes): converge from empty, steady state (target: 2 requests), a 10% version bump"
)


def _check(condition: bool, message: str) -> None:
    check(condition, message)


def _say(message: str) -> None:
    say(NAME, message)


WORKLOADS = 1000
QUICK_WORKLOADS = 100
STEADY_REPEATS = 5
QUICK_STEADY_REPEATS = 3
DEFAULT_CONCURRENCY: int = Settings.model_fields["sync_concurrency"].default
WIDE_CONCURRENCY = 16
BUMP_EVERY = 10  # every tenth workload gets a new version
VERSION, BUMPED = "1.0.0", "1.1.0"
PING_TOKEN_SECRET = "bench-ping-token-secret"  # only ever sent to 127.0.0.1
STEADY_TARGET = 2  # one GET of the desired state answered 304, one LIST of the Deployments
STEADY_LIST = Key("LIST", "namespace", 200)  # a LIST of the Deployments of one namespace
ROLLOUT_TIMEOUT = 900.0  # seconds for the deployment controller and kwok to roll all out
RESET_TIMEOUT = 900.0  # seconds for the Deployments, ReplicaSets and Pods to be gone
POLL = 0.5
CPU_BOUND = 0.8  # process CPU seconds per wall second above which a phase is CPU-bound
# Settings passed explicitly below; any other field set in the environment changes the run.
EXPLICIT = frozenset(
    {"node_id", "node_system_endpoint", "node_private_key", "kubeconfig", "managed_namespace",
     "embedded_services", "sync_concurrency", "data_dir", "ping_token_secret"}
)  # fmt: skip


# --- measuring ---------------------------------------------------------------------------


class RssPeak:
    """This process's RSS peak, as the kernel keeps it (VmHWM): overall, and per phase
    (the peak since the previous call, which starts it over)."""

    def __init__(self) -> None:
        self.baseline = proc.status(os.getpid())["VmRSS"]
        self._peak = self.baseline

    def sample(self) -> int:
        rss = proc.status(os.getpid())["VmRSS"]
        self._peak = max(self._peak, rss)
        return rss

    def phase_peak(self) -> int:
        peak = proc.status(os.getpid())["VmHWM"]
        self._peak = max(self._peak, peak)
        proc.reset_peak(os.getpid())
        return peak

    @property
    def peak(self) -> int:
        self._peak = max(self._peak, proc.status(os.getpid())["VmHWM"])
        return self._peak


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    status: int

    @property
    def kind(self) -> str:
        return self.method if self.status == 200 else f"{self.method}({self.status})"


@dataclass
class Phase:
    wall: float
    cpu: float  # user + system seconds of this whole process, servers included
    outcome: SyncOutcome
    backend: list[Call]
    kube: Requests
    rss_peak: int
    control_plane_cpu: float  # CPU seconds of the control plane's processes meanwhile

    @property
    def steady_target_met(self) -> bool:
        """Exactly one 304 GET of the desired state and one LIST, nothing else."""
        return [(c.method, c.status) for c in self.backend] == [("GET", 304)] and dict(
            self.kube.counted
        ) == {STEADY_LIST: 1}

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_seconds": round(self.wall, 4),
            "cpu_seconds": round(self.cpu, 3),
            "sync_duration_seconds": round(self.outcome.duration_seconds, 4),
            "ok": self.outcome.ok,
            "aborted": self.outcome.aborted,
            "counts": self.outcome.counts(),
            "outcomes": dict(Counter(r.outcome for r in self.outcome.results)),
            "backend_requests": len(self.backend),
            "backend_by_kind": _by_kind(self.backend),
            "kube_requests": self.kube.total,
            "kube_by_kind": self.kube.by_kind(),
            "kube_by_scope": _by_scope(self.kube),
            # Deployment requests of other clients (the controllers), not counted: see notes
            "kube_not_counted": dict(self.kube.other.most_common()),
            # the counts are the cluster's: do they match what this sync did? (None: unknown)
            "kube_as_expected": _as_expected(self.outcome, self.kube),
            "control_plane_cpu_seconds": round(self.control_plane_cpu, 3),
            "rss_peak_bytes": self.rss_peak,
        }


def _by_kind(calls: Sequence[Call]) -> dict[str, int]:
    return dict(Counter(c.kind for c in calls).most_common())


def _as_expected(outcome: SyncOutcome, requests: Requests) -> bool | None:
    """Whether the counted requests are exactly those the Syncer's results imply: a LIST,
    and one more after any change; per create a GET (404) and an apply (201), per update an
    apply. None when a result has no such fixed cost (a conflict, a delete, a failure)."""
    expected: Counter[str] = Counter({"LIST": 1})
    for result in outcome.results:
        if (result.action, result.outcome) == ("noop", "unchanged"):
            continue
        if result.outcome != "applied" or "conflict" in result.reason:
            return None
        if result.action == "create":
            expected.update(["GET(404)", "PATCH(201)"])
        elif result.action == "update":
            expected.update(["PATCH"])
        else:
            return None
    if any(r.outcome == "applied" for r in outcome.results):
        expected.update(["LIST"])
    return dict(expected) == requests.by_kind()


def _by_scope(requests: Requests) -> dict[str, int]:
    """e.g. `LIST namespace`, `GET(404) resource`: what each request was aimed at."""
    scopes: Counter[str] = Counter()
    for key, count in requests.counted.items():
        scopes[f"{key.kind} {key.scope}"] += count
    return dict(scopes.most_common())


def _cpu_seconds() -> float:
    return proc.cpu_seconds(os.getpid())


async def _until(unmet: Callable[[], str | None], limit: float) -> None:
    """Poll until `unmet()` says nothing is left (None); fail the run with what it said
    after `limit` seconds. Ctrl-C cancels the run at the sleep."""
    deadline = time.monotonic() + limit
    while (left := unmet()) is not None:
        _check(time.monotonic() < deadline, f"{left} after {limit:.0f} s")
        await asyncio.sleep(POLL)


@dataclass
class World:
    backend: LocalBackend
    backend_url: str
    plane: ControlPlane
    requests: ApiserverRequests
    kubeconfig: Path
    workdir: Path
    rss: RssPeak
    names: tuple[str, ...]
    rollouts: dict[str, float]  # phase -> seconds the cluster took to roll out after it

    def backend_calls(self) -> list[Call]:
        return [Call(r.method, r.path, r.status) for r in self.backend.requests]

    def managed(self) -> list[dict[str, Any]]:
        return self.requests.list_deployments(NAMESPACE, MANAGED_SELECTOR)

    def managed_versions(self) -> dict[str, str]:
        return {
            d["metadata"]["name"]: (d["metadata"].get("annotations") or {}).get(
                VERSION_ANNOTATION, ""
            )
            for d in self.managed()
        }

    async def reset(self) -> None:
        """An empty backend and no Deployments, ReplicaSets or Pods in the namespace, so the
        controllers' clean-up of the previous run does not overlap this one. One
        DELETECOLLECTION, not `kubectl delete deployments --all --wait`: kubectl deletes
        (and then reads) one object at a time, about 10 requests/s, minutes for 1,000."""
        self.backend.reset()
        self.requests.delete_deployments(NAMESPACE)

        def still_there() -> str | None:
            left = self.plane.kubectl(
                "-n", NAMESPACE, "get", "deployments,replicasets,pods", "-o", "name"
            ).stdout.split()
            return f"{len(left)} objects left in {NAMESPACE}, e.g. {left[:2]}" if left else None

        await _until(still_there, RESET_TIMEOUT)

    async def wait_rolled_out(self, phase: str, n: int) -> None:
        """Every managed Deployment rolled out (outside the timed syncs): the controllers'
        writes meanwhile would conflict with the next sync's conditional applies, and
        their CPU would be in its wall time."""
        started = time.monotonic()

        def pending() -> str | None:
            listed = self.managed()
            waiting = [d["metadata"]["name"] for d in listed if not _rolled_out(d)]
            if len(listed) == n and not waiting:
                return None
            return f"{len(waiting)} of {len(listed)} Deployments not rolled out, e.g. {waiting[:2]}"

        await _until(pending, ROLLOUT_TIMEOUT)
        self.rollouts[phase] = round(time.monotonic() - started, 1)

    def desire(self, versions: Mapping[str, str]) -> None:
        for name, version in versions.items():
            self.backend.set_manifest(name, version, manifest(name, version))
        self.backend.set_desired([{"name": n, "version": v} for n, v in versions.items()])

    async def timed_sync(self, syncer: Syncer) -> Phase:
        self.backend.clear_records()
        before = self.requests.settled_snapshot()
        plane_cpu = cpu_seconds(self.plane)
        self.rss.phase_peak()
        cpu, started = _cpu_seconds(), time.perf_counter()
        outcome = await syncer.sync()
        wall, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
        plane_cpu = cpu_seconds(self.plane) - plane_cpu
        rss_peak = self.rss.phase_peak()
        kube = ApiserverRequests.between(before, self.requests.settled_snapshot())
        phase = Phase(
            wall=wall,
            cpu=cpu,
            outcome=outcome,
            backend=self.backend_calls(),
            kube=kube,
            rss_peak=rss_peak,
            control_plane_cpu=plane_cpu,
        )
        _check(outcome.aborted is None, f"sync aborted: {outcome.aborted}")
        failed = [f"{r.name}: {r.error}" for r in outcome.results if r.outcome == "failed"]
        _check(not failed, f"{len(failed)} workload(s) failed, e.g. {failed[:2]}")
        rejected = [f"{r.method} {r.path}: {r.rejected_reason}" for r in self.backend.rejected]
        _check(not rejected, f"the backend rejected {len(rejected)} request(s): {rejected[:2]}")
        errors = [
            f"{count} x {key.kind} ({key.scope})"
            for key, count in kube.counted.items()
            if key.code >= 400 and (key.verb, key.code) != ("GET", 404)
        ]
        _check(not errors, f"Kubernetes API errors: {', '.join(errors)}")
        return phase


def _rolled_out(deployment: Mapping[str, Any]) -> bool:
    """What `kubectl rollout status` waits for: the new ReplicaSet's pods all available."""
    replicas = deployment["spec"].get("replicas", 1)
    status = deployment.get("status") or {}
    return bool(
        status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
        and status.get("updatedReplicas", 0) == replicas
        and status.get("replicas", 0) == replicas
        and status.get("availableReplicas", 0) == replicas
    )


# --- phases ------------------------------------------------------------------------------


async def _measure(world: World, concurrency: int, repeats: int) -> dict[str, Any]:
    """Every phase at one concurrency, on a fresh backend, namespace and runtime."""
    await world.reset()
    n = len(world.names)
    world.desire(dict.fromkeys(world.names, VERSION))
    settings = Settings(
        _env_file=None,
        node_id=NODE,
        node_system_endpoint=world.backend_url,
        node_private_key=key_seed(),
        kubeconfig=world.kubeconfig,
        managed_namespace=NAMESPACE,
        embedded_services=False,
        sync_concurrency=concurrency,
        data_dir=world.workdir / "data",
        ping_token_secret=PING_TOKEN_SECRET,
        max_desired_workloads=max(n, 1),  # the bench syncs more than the default bound
    )
    phases: dict[str, Any] = {}
    result: dict[str, Any] = {"concurrency": concurrency, "phases": phases, "failure": None}
    current = "start"
    try:
        runtime = build_runtime(settings)
        async with AsyncExitStack() as stack:
            syncer = await open_sync_only(runtime, stack)
            _check(syncer is not None, f"no syncer: {runtime.components['sync'].reason}")
            assert syncer is not None

            current = "converge"
            _say(f"concurrency {concurrency}: converging {n} workloads from empty")
            phase = await world.timed_sync(syncer)
            phases[current] = phase.as_dict()
            _check(
                phase.outcome.counts() == {"create": n}
                and all(r.outcome == "applied" for r in phase.outcome.results),
                f"expected {n} creates applied, got {phase.outcome.counts()}",
            )
            deployed = world.managed_versions()
            _check(
                deployed == dict.fromkeys(world.names, VERSION),
                f"the cluster holds {len(deployed)} managed Deployments, expected {n} at {VERSION}",
            )
            reported = world.backend.versions
            _check(len(reported) == n, f"{len(reported)} versions reported, expected {n}")
            _say(f"concurrency {concurrency}: waiting for the {n} rollouts")
            await world.wait_rolled_out(f"{concurrency}:converge", n)

            current = "second"
            phase = await world.timed_sync(syncer)
            phases[current] = phase.as_dict() | {"steady_target_met": phase.steady_target_met}
            _unchanged(phase, n)

            current = "steady"
            _say(f"concurrency {concurrency}: {repeats} steady-state syncs")
            steady = []
            for _ in range(repeats):
                phase = await world.timed_sync(syncer)
                _unchanged(phase, n)
                steady.append(phase.as_dict() | {"steady_target_met": phase.steady_target_met})
            walls = [s["wall_seconds"] for s in steady]
            phases[current] = {
                "syncs": steady,
                "median_wall_seconds": statistics.median(walls),
                "min_wall_seconds": min(walls),
                "max_wall_seconds": max(walls),
                "target_met": sum(s["steady_target_met"] for s in steady),
                "repeats": repeats,
            }

            current = "bump"
            bumped = world.names[::BUMP_EVERY]
            _say(f"concurrency {concurrency}: bumping {len(bumped)} versions")
            desired = dict.fromkeys(world.names, VERSION) | dict.fromkeys(bumped, BUMPED)
            world.desire({name: desired[name] for name in world.names})
            phase = await world.timed_sync(syncer)
            phases[current] = phase.as_dict() | {"bumped": len(bumped)}
            _check(
                phase.outcome.counts() == {"update": len(bumped), "noop": n - len(bumped)},
                f"expected {len(bumped)} updates, got {phase.outcome.counts()}",
            )
            deployed = world.managed_versions()
            _check(deployed == desired, "the cluster's versions differ from the desired ones")
            reported = world.backend.versions
            _check(
                sorted((name, body["version"]) for name, body in reported)
                == [(name, BUMPED) for name in bumped],
                f"{len(reported)} versions reported, expected the {len(bumped)} bumped",
            )
    except CheckFailed as exc:
        result["failure"] = {"phase": current, "reason": str(exc)}
        _say(f"concurrency {concurrency}: FAILED in {current}: {exc}")
    return result


def _unchanged(phase: Phase, n: int) -> None:
    outcomes = Counter(r.outcome for r in phase.outcome.results)
    _check(outcomes == {"unchanged": n}, f"expected {n} unchanged, got {dict(outcomes)}")


async def _measure_all(world: World, repeats: int) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for concurrency in dict.fromkeys((DEFAULT_CONCURRENCY, WIDE_CONCURRENCY)):
        runs[str(concurrency)] = await _measure(world, concurrency, repeats)
    return runs


def run(options: Options) -> dict[str, Any]:
    n = QUICK_WORKLOADS if options.quick else WORKLOADS
    repeats = QUICK_STEADY_REPEATS if options.quick else STEADY_REPEATS
    names = tuple(f"bench-{i:04d}" for i in range(n))
    overridden = sorted(
        k for k in os.environ if k.lower() in Settings.model_fields and k.lower() not in EXPLICIT
    )
    rss = RssPeak()
    proc.reset_peak(os.getpid())
    rollouts: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        workdir = Path(tmp)
        (workdir / "data").mkdir()
        _say("starting the control plane (etcd, kube-apiserver, controllers, kwok)")
        plane_started = time.monotonic()
        plane = start(workdir / "control-plane")
        plane_seconds = round(time.monotonic() - plane_started, 1)
        requests = ApiserverRequests(plane)
        try:
            kubeconfig = write_manager_kubeconfig(plane, workdir / "kubeconfig", NAMESPACE)
            backend = LocalBackend(NODE, KEY.public_key())
            with backend.serve() as server:
                world = World(
                    backend, server.url, plane, requests, kubeconfig, workdir, rss, names,
                    rollouts,
                )  # fmt: skip
                started = rss.sample()
                runs = asyncio.run(_measure_all(world, repeats))
                versions = plane.kubectl("version", "-o", "json").stdout
        finally:
            requests.close()
            plane.stop()
    setup = {
        "workloads": n,
        "steady_repeats": repeats,
        "bump_every": BUMP_EVERY,
        "concurrencies": [int(c) for c in runs],
        "default_concurrency": DEFAULT_CONCURRENCY,
        "settings_from_environment": overridden,
        "kubernetes": json.loads(versions).get("serverVersion", {}).get("gitVersion", ""),
        "control_plane_start_seconds": plane_seconds,
        "rollout_seconds_after": rollouts,
    }
    memory = {"baseline_rss_bytes": rss.baseline, "servers_started_rss_bytes": started}
    memory["peak_rss_bytes"] = rss.peak
    result: dict[str, Any] = {"setup": setup, "runs": runs, "memory": memory}
    result["targets"] = _targets(runs)
    result["ok"] = all(r["failure"] is None for r in runs.values())
    result["tables"] = [_table(r, n, repeats) for r in runs.values()]
    result["notes"] = _notes(setup, runs, memory, result["targets"])
    return result


# --- report ------------------------------------------------------------------------------


def _targets(runs: Mapping[str, Any]) -> dict[str, Any]:
    observed = {
        c: [s["backend_requests"] + s["kube_requests"] for s in r["phases"]["steady"]["syncs"]]
        for c, r in runs.items()
        if "steady" in r["phases"]
    }
    missed = any(
        r["phases"]["steady"]["target_met"] < r["phases"]["steady"]["repeats"]
        for r in runs.values()
        if "steady" in r["phases"]
    )
    # None: no miss seen, but a run failed before its steady-state syncs
    met = False if missed else (True if len(observed) == len(runs) else None)
    return {
        "steady_state_requests": {
            "target": f"exactly {STEADY_TARGET}: GET desired -> 304, one LIST",
            "measured": observed,
            "met": met,
        }
    }


def _requests(phase: Mapping[str, Any], total: str, by_kind: str) -> str:
    kinds = ", ".join(f"{kind} {count}" for kind, count in phase[by_kind].items())
    return f"{phase[total]}: {kinds}" if kinds else "0"


def _row(
    label: str, phase: Mapping[str, Any], outcome: str, wall: float | None = None
) -> list[str]:
    return [
        label,
        f"{phase['wall_seconds'] if wall is None else wall:.3f}",
        _requests(phase, "backend_requests", "backend_by_kind"),
        _requests(phase, "kube_requests", "kube_by_kind"),
        outcome,
    ]


def _verbs(counts: Mapping[str, int], words: Mapping[str, str]) -> str:
    return ", ".join(f"{count} {words.get(kind, kind)}" for kind, count in counts.items())


def _table(run: Mapping[str, Any], n: int, repeats: int) -> dict[str, Any]:
    phases, failure = run["phases"], run["failure"]
    rows: list[list[str]] = []
    labels: dict[str, str] = {
        "converge": "converge from empty",
        "second": "second sync",
        "steady": f"steady state (median of {repeats})",
        "bump": f"bump {len(range(0, n, BUMP_EVERY))} of {n} versions",
    }
    outcomes: dict[str, Callable[[Mapping[str, Any]], str]] = {
        "converge": lambda p: "ok, " + _verbs(p["counts"], {"create": "created"}),
        "second": lambda p: "ok, " + _verbs(p["outcomes"], {}),
        "bump": lambda p: "ok, " + _verbs(p["counts"], {"update": "updated", "noop": "unchanged"}),
    }
    for key, label in labels.items():
        if failure is not None and failure["phase"] == key:
            rows.append([label, "-", "-", "-", f"FAILED: {failure['reason']}"])
            break
        phase = phases[key]
        if key == "steady":
            # the request columns show the sync that made the most requests
            worst = max(phase["syncs"], key=lambda s: s["backend_requests"] + s["kube_requests"])
            verdict = (
                f"{phase['target_met']}/{phase['repeats']} at exactly {STEADY_TARGET} requests"
            )
            wall = phase["median_wall_seconds"]
            rows.append(_row(label, worst, f"ok, {n} unchanged, {verdict}", wall=wall))
        else:
            rows.append(_row(label, phase, outcomes[key](phase)))
    if failure is not None and failure["phase"] not in labels:
        rows.append(["setting up the syncer", "-", "-", "-", f"FAILED: {failure['reason']}"])
    default = " (the default)" if run["concurrency"] == DEFAULT_CONCURRENCY else ""
    return table(
        f"sync: {n} desired workloads, SYNC_CONCURRENCY={run['concurrency']}{default}",
        "phase|wall s|backend requests|kube requests (by method)|outcome",
        rows,
    )


def _expected_note(runs: Mapping[str, Any]) -> str:
    """Did another client's counted request land in a timed sync? Compared per sync."""
    checked: list[bool | None] = []
    for run in runs.values():
        for key, phase in run["phases"].items():
            for sync in phase["syncs"] if key == "steady" else [phase]:
                checked.append(sync["kube_as_expected"])
    known = [c for c in checked if c is not None]
    if known and all(known):
        verdict = f"The counts of all {len(known)} timed syncs"
        unknown = len(checked) - len(known)
        verdict += f" (and {unknown} not predictable)" if unknown else ""
        return verdict + " match exactly what the Syncer did: no other client's request counted."
    if not known:
        return "No timed sync had counts to compare with what the Syncer did."
    return (
        f"{known.count(False)} of {len(known)} timed syncs counted other requests than the "
        "Syncer's actions imply (kube_as_expected false in the JSON): another client's, or "
        "a retry."
    )


def _notes(
    setup: Mapping[str, Any],
    runs: Mapping[str, Any],
    memory: Mapping[str, Any],
    targets: Mapping[str, Any],
) -> list[str]:
    n = setup["workloads"]
    notes = [
        f"{n} workloads, one plain Deployment manifest each (standins/sync_world.py), "
        "PING_TOKEN_SECRET set (ping tokens injected); checked before reporting: the "
        "cluster's managed Deployments and the versions reported to the backend. Kubernetes "
        f"{setup['kubernetes'] or 'version unknown'} (bench/cluster.py, started in "
        f"{setup['control_plane_start_seconds']:.0f} s); the local backend runs in a thread "
        "of this process, so wall and CPU times include its work; the control plane's CPU "
        "is in the JSON (control_plane_cpu_seconds).",
        "kube requests are the API server's apiserver_request_total for Deployments (LIST, "
        "GET, PATCH = server-side apply, DELETE; not the controllers' UPDATE, WATCH and "
        "subresources: kube_not_counted in the JSON), before and after each timed sync, on "
        "a namespace emptied first, after every rollout is done. "
        + _expected_note(runs)
        + f" `GET(404) {n}` = {n} answers 404 (a create first reads the name); `PATCH(201)` "
        "= an apply that created; no status = 200. The steady-state row shows the sync "
        "that made the most requests.",
    ]
    if rollouts := setup["rollout_seconds_after"]:
        notes.append("not timed: the rollouts after each converge took " + "; ".join(
            f"SYNC_CONCURRENCY={phase.split(':')[0]}: {seconds:.0f} s"
            for phase, seconds in rollouts.items()) + ".")  # fmt: skip
    steady = targets["steady_state_requests"]
    observed = "; ".join(
        f"SYNC_CONCURRENCY={c}: {counts}" for c, counts in steady["measured"].items()
    )
    verdict = {True: "MET", False: "NOT MET", None: "not measured in every run"}[steady["met"]]
    notes.append(f"steady-state target ({steady['target']}, in every sync): {verdict}; "
                 f"requests per sync: {observed or 'none measured'}.")  # fmt: skip
    for concurrency, run in runs.items():
        converge = run["phases"].get("converge")
        if converge is None or (run["failure"] and run["failure"]["phase"] == "converge"):
            continue
        wall, cpu = converge["wall_seconds"], converge["cpu_seconds"]
        requests = converge["backend_requests"] + converge["kube_requests"]
        notes.append(
            f"SYNC_CONCURRENCY={concurrency}: converging took {wall:.2f} s ({n / wall:,.0f} "
            f"workloads/s, {requests / n:.2f} requests per workload) and {cpu:.2f} s of this "
            "process's CPU" + (": CPU-bound." if cpu >= CPU_BOUND * wall else ".")
        )
    notes.append(
        "RSS of this process (the backend included, the control plane not; the peak is the "
        f"kernel's VmHWM): {mib(memory['baseline_rss_bytes'])} MiB before, "
        f"{mib(memory['servers_started_rss_bytes'])} MiB with the backend and the control "
        f"plane up, peak {mib(memory['peak_rss_bytes'])} MiB."
    )
    notes += [
        f"FAILED at SYNC_CONCURRENCY={c} in phase {r['failure']['phase']}: "
        f"{r['failure']['reason']}; that run's later phases were not measured."
        for c, r in runs.items() if r["failure"] is not None
    ]  # fmt: skip
    if setup["settings_from_environment"]:
        notes.append("settings also read from this environment (they change what is "
                     "measured): " + ", ".join(setup["settings_from_environment"]))  # fmt: skip
    return notes
