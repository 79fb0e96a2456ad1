"""The sync benchmark: the Syncer, built as the app builds it, against a local backend and
a real Kubernetes control plane (kube-apiserver, deployment controller, kwok nodes).

N desired workloads (1,000; 100 with --quick): converge from empty, a second sync, steady
state (target: exactly 2 requests) and a 10% version bump, at the default SYNC_CONCURRENCY
and at 16. Requests are the API server's own counts (`GET(404)`: a create reads the name
first; `PATCH(201)`: an apply that created). The cluster and the reported versions are checked.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.services.runtime import build_runtime, open_sync_only
from app.services.syncing import Syncer, SyncOutcome
from app.settings import Settings
from bench import Options, cluster, proc
from bench.cluster import Cluster, Key, Requests
from bench.report import CheckFailed, Json, check, env_note, mib, say, table
from bench.servers import overridden
from standins.backend import LocalBackend
from standins.sync_world import KEY, NODE, desire, key_seed

NAME = "sync"
DESCRIPTION = (
    "1,000 desired workloads against a real kube-apiserver and deployment controller "
    "(kwok nodes): converge from empty, steady state (target: 2 requests), a 10% version bump"
)
_say = functools.partial(say, NAME)

WORKLOADS, QUICK_WORKLOADS = 1000, 100
STEADY_REPEATS, QUICK_STEADY_REPEATS = 5, 3
DEFAULT_CONCURRENCY: int = Settings.model_fields["sync_concurrency"].default
WIDE_CONCURRENCY = 16
BUMP_EVERY = 10  # every tenth workload gets a new version
VERSION, BUMPED = "1.0.0", "1.1.0"
STEADY_TARGET = 2  # one GET of the desired state answered 304, one LIST of the Deployments
STEADY_LIST = Key("LIST", "namespace", 200)  # a LIST of the Deployments of one namespace
ROLLOUT_TIMEOUT = 900.0  # seconds for the deployment controller and kwok to roll all out
RESET_TIMEOUT = 900.0  # seconds for the Deployments, ReplicaSets and Pods to be gone
CPU_BOUND = 0.8  # process CPU seconds per wall second above which a phase is CPU-bound
# Settings passed explicitly below; any other field set in the environment changes the run.
EXPLICIT = frozenset(
    {"node_id", "node_system_endpoint", "node_private_key", "kubeconfig", "managed_namespace",
     "embedded_services", "sync_concurrency", "data_dir", "ping_token_secret"}
)  # fmt: skip


def _peak(reset: bool = True) -> int:
    """This process's RSS peak since the last reset (VmHWM), which this one starts over."""
    peak = proc.status(os.getpid())["VmHWM"]
    if reset:
        proc.reset_peak(os.getpid())
    return peak


def _as_expected(outcome: SyncOutcome, requests: Requests) -> bool | None:
    """Whether the counts are exactly what the results imply (a LIST, one more after a change;
    create: GET(404) + PATCH(201); update: PATCH); None for a conflict, delete or failure."""
    expected: Counter[str] = Counter({"LIST": 1})
    for result in outcome.results:
        if (result.action, result.outcome) == ("noop", "unchanged"):
            continue
        if result.outcome != "applied" or "conflict" in result.reason:
            return None
        if result.action not in ("create", "update"):
            return None
        expected.update(["GET(404)", "PATCH(201)"] if result.action == "create" else ["PATCH"])
    if any(r.outcome == "applied" for r in outcome.results):
        expected.update(["LIST"])
    return dict(expected) == requests.by()


async def _until(unmet: Callable[[], str | None], limit: float) -> None:
    """Poll until `unmet()` says nothing is left (None); fail with what it said at `limit`."""
    deadline = time.monotonic() + limit
    while (left := unmet()) is not None:
        check(time.monotonic() < deadline, f"{left} after {limit:.0f} s")
        await asyncio.sleep(0.5)


def _rolled_out(d: Mapping[str, Any]) -> bool:
    """What `kubectl rollout status` waits for: the new ReplicaSet's pods all available."""
    replicas, status = d["spec"].get("replicas", 1), d.get("status") or {}
    return status.get("observedGeneration", 0) >= d["metadata"]["generation"] and all(
        status.get(k, 0) == replicas for k in ("updatedReplicas", "replicas", "availableReplicas")
    )


@dataclass
class World:
    backend: LocalBackend
    backend_url: str
    cluster: Cluster
    workdir: Path
    peaks: list[int]  # this process's RSS peak in each phase
    names: tuple[str, ...]
    rollouts: dict[str, float] = field(default_factory=dict)  # phase -> seconds to roll out

    async def reset(self) -> None:
        """An empty backend and namespace, so the previous run's clean-up does not overlap."""
        self.backend.reset()
        self.cluster.delete_deployments()

        def still_there() -> str | None:
            kinds = "deployments,replicasets,pods"
            left = self.cluster.plane.kubectl("-n", cluster.NAMESPACE, "get", kinds, "-o", "name")
            names = left.stdout.split()
            return f"{len(names)} objects left, e.g. {names[:2]}" if names else None

        await _until(still_there, RESET_TIMEOUT)

    async def wait_rolled_out(self, phase: str, n: int) -> None:
        """Every managed Deployment rolled out, outside the timed syncs: the controllers'
        writes would conflict with the next sync's applies, their CPU be in its wall time."""
        started = time.monotonic()

        def pending() -> str | None:
            listed = self.cluster.managed()
            waiting = [d["metadata"]["name"] for d in listed if not _rolled_out(d)]
            if len(listed) == n and not waiting:
                return None
            return f"{len(waiting)} of {len(listed)} Deployments not rolled out, e.g. {waiting[:2]}"

        await _until(pending, ROLLOUT_TIMEOUT)
        self.rollouts[phase] = round(time.monotonic() - started, 1)

    async def timed_sync(self, syncer: Syncer) -> tuple[Json, SyncOutcome]:
        self.backend.clear_records()
        before = self.cluster.settled_snapshot()
        plane_cpu = self.cluster.cpu_seconds()
        _peak()
        cpu, started = proc.cpu_seconds(os.getpid()), time.perf_counter()
        outcome = await syncer.sync()
        wall, cpu = time.perf_counter() - started, proc.cpu_seconds(os.getpid()) - cpu
        plane_cpu = self.cluster.cpu_seconds() - plane_cpu
        rss_peak = _peak()
        self.peaks.append(rss_peak)
        kube = Cluster.between(before, self.cluster.settled_snapshot())
        calls = [(r.method, r.status) for r in self.backend.requests]
        phase = {
            "wall_seconds": round(wall, 4), "cpu_seconds": round(cpu, 3),
            "sync_duration_seconds": round(outcome.duration_seconds, 4), "ok": outcome.ok,
            "aborted": outcome.aborted, "counts": outcome.counts(),
            "outcomes": dict(Counter(r.outcome for r in outcome.results)),
            "backend_requests": len(calls),
            "backend_by_kind": dict(Counter(m if s == 200 else f"{m}({s})" for m, s in calls)
                                    .most_common()),
            "kube_requests": kube.total, "kube_by_kind": kube.by(),
            "kube_by_scope": kube.by("scope"),
            # Deployment requests of other clients (the controllers), not counted
            "kube_not_counted": dict(kube.other.most_common()),
            # the counts are the cluster's: do they match what this sync did? (None: unknown)
            "kube_as_expected": _as_expected(outcome, kube),
            "control_plane_cpu_seconds": round(plane_cpu, 3), "rss_peak_bytes": rss_peak,
            # exactly one 304 GET of the desired state and one LIST, nothing else
            "steady_target_met": calls == [("GET", 304)] and dict(kube.counted) == {STEADY_LIST: 1},
        }  # fmt: skip
        check(outcome.aborted is None, f"sync aborted: {outcome.aborted}")
        failed = [f"{r.name}: {r.error}" for r in outcome.results if r.outcome == "failed"]
        check(not failed, f"{len(failed)} workload(s) failed, e.g. {failed[:2]}")
        rejected = [f"{r.method} {r.path}: {r.rejected_reason}" for r in self.backend.rejected]
        check(not rejected, f"the backend rejected {len(rejected)} request(s): {rejected[:2]}")
        errors = [f"{count} x {key.kind} ({key.scope})" for key, count in kube.counted.items()
                  if key.code >= 400 and (key.verb, key.code) != ("GET", 404)]  # fmt: skip
        check(not errors, f"Kubernetes API errors: {', '.join(errors)}")
        return phase, outcome

    async def unchanged(self, syncer: Syncer) -> Json:
        phase, _ = await self.timed_sync(syncer)
        n = len(self.names)
        check(phase["outcomes"] == {"unchanged": n}, f"expected {n} unchanged: {phase['outcomes']}")
        return phase


async def _measure(world: World, concurrency: int, repeats: int) -> Json:
    """Every phase at one concurrency, on a fresh backend, namespace and runtime."""
    await world.reset()
    names, n = world.names, len(world.names)
    desire(world.backend, *((name, VERSION) for name in names))
    settings = Settings(
        _env_file=None, node_id=NODE, node_system_endpoint=world.backend_url,
        node_private_key=key_seed(), kubeconfig=world.cluster.kubeconfig,
        managed_namespace=cluster.NAMESPACE, embedded_services=False,
        sync_concurrency=concurrency, data_dir=world.workdir / "data",
        ping_token_secret="bench-ping-token-secret",
        max_desired_workloads=max(n, 1),  # the bench syncs more than the default bound
    )  # fmt: skip
    phases: Json = {}
    result: Json = {"concurrency": concurrency, "phases": phases, "failure": None}
    current = "start"
    try:
        runtime = build_runtime(settings)
        async with AsyncExitStack() as stack:
            syncer = await open_sync_only(runtime, stack)
            check(syncer is not None, f"no syncer: {runtime.components['sync'].reason}")
            assert syncer is not None

            current = "converge"
            _say(f"concurrency {concurrency}: converging {n} workloads from empty")
            phases[current], outcome = await world.timed_sync(syncer)
            check(outcome.counts() == {"create": n} and phases[current]["outcomes"] == {
                "applied": n}, f"expected {n} creates applied, got {outcome.counts()}")  # fmt: skip
            deployed = world.cluster.versions()
            held = f"the cluster holds {len(deployed)} managed Deployments"
            check(deployed == dict.fromkeys(names, VERSION), f"{held}, expected {n} at {VERSION}")
            reported = world.backend.versions
            check(len(reported) == n, f"{len(reported)} versions reported, expected {n}")
            _say(f"concurrency {concurrency}: waiting for the {n} rollouts")
            await world.wait_rolled_out(f"{concurrency}:converge", n)

            current = "second"
            phases[current] = await world.unchanged(syncer)

            current = "steady"
            _say(f"concurrency {concurrency}: {repeats} steady-state syncs")
            steady = [await world.unchanged(syncer) for _ in range(repeats)]
            walls = [s["wall_seconds"] for s in steady]
            phases[current] = {
                "syncs": steady, "median_wall_seconds": statistics.median(walls),
                "min_wall_seconds": min(walls), "max_wall_seconds": max(walls),
                "target_met": sum(s["steady_target_met"] for s in steady), "repeats": repeats,
            }  # fmt: skip

            current = "bump"
            bumped = names[::BUMP_EVERY]
            _say(f"concurrency {concurrency}: bumping {len(bumped)} versions")
            desired = dict.fromkeys(names, VERSION) | dict.fromkeys(bumped, BUMPED)
            desire(world.backend, *desired.items())
            phase, outcome = await world.timed_sync(syncer)
            phases[current] = phase | {"bumped": len(bumped)}
            check(outcome.counts() == {"update": len(bumped), "noop": n - len(bumped)},
                  f"expected {len(bumped)} updates, got {outcome.counts()}")  # fmt: skip
            check(world.cluster.versions() == desired,
                  "the cluster's versions differ from the desired ones")  # fmt: skip
            reported = world.backend.versions
            told = sorted((name, body["version"]) for name, body in reported)
            expected = f"expected the {len(bumped)} bumped"
            check(told == [(name, BUMPED) for name in bumped], f"{len(told)} reported, {expected}")
    except CheckFailed as exc:
        result["failure"] = {"phase": current, "reason": str(exc)}
        _say(f"concurrency {concurrency}: FAILED in {current}: {exc}")
    return result


async def _measure_all(world: World, repeats: int) -> Json:
    concurrencies = dict.fromkeys((DEFAULT_CONCURRENCY, WIDE_CONCURRENCY))
    return {str(c): await _measure(world, c, repeats) for c in concurrencies}


def run(options: Options) -> Json:
    n = QUICK_WORKLOADS if options.quick else WORKLOADS
    repeats = QUICK_STEADY_REPEATS if options.quick else STEADY_REPEATS
    baseline = proc.status(os.getpid())["VmRSS"]
    proc.reset_peak(os.getpid())
    peaks = [baseline]
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        workdir = Path(tmp)
        (workdir / "data").mkdir()
        _say("starting the control plane (etcd, kube-apiserver, controllers, kwok)")
        plane_started = time.monotonic()
        with cluster.running(workdir) as found:
            plane_seconds = round(time.monotonic() - plane_started, 1)
            backend = LocalBackend(NODE, KEY.public_key())
            with backend.serve() as server:
                names = tuple(f"bench-{i:04d}" for i in range(n))
                world = World(backend, server.url, found, workdir, peaks, names)
                started = proc.status(os.getpid())["VmRSS"]
                runs = asyncio.run(_measure_all(world, repeats))
            versions = json.loads(found.plane.kubectl("version", "-o", "json").stdout)
    setup = {
        "workloads": n, "settings_from_environment": overridden(EXPLICIT),
        "kubernetes": versions.get("serverVersion", {}).get("gitVersion", ""),
        "control_plane_start_seconds": plane_seconds, "rollout_seconds_after": world.rollouts,
    }  # fmt: skip
    memory = {"baseline_rss_bytes": baseline, "servers_started_rss_bytes": started,
              "peak_rss_bytes": max(*peaks, _peak(reset=False))}  # fmt: skip
    steady = {c: r["phases"]["steady"] for c, r in runs.items() if "steady" in r["phases"]}
    missed = any(s["target_met"] < s["repeats"] for s in steady.values())
    measured = {c: [x["backend_requests"] + x["kube_requests"] for x in s["syncs"]]
                for c, s in steady.items()}  # fmt: skip
    result: Json = {"setup": setup, "runs": runs, "memory": memory}
    # met None: no miss seen, but a run failed before its steady-state syncs
    met = False if missed else (len(steady) == len(runs) or None)
    target = f"exactly {STEADY_TARGET}: GET desired -> 304, one LIST, in every sync"
    result["targets"] = {
        "steady_state_requests": {"target": target, "measured": measured, "met": met}
    }
    result["ok"] = all(r["failure"] is None for r in runs.values())
    result["tables"] = [
        *(_table(r, n, repeats) for r in runs.values()),
        _converge_table(setup, runs),
    ]
    result["notes"] = _notes(setup, runs, memory)
    return result


def _requests(phase: Mapping[str, Any], side: str) -> str:
    kinds = ", ".join(f"{kind} {count}" for kind, count in phase[f"{side}_by_kind"].items())
    return f"{phase[f'{side}_requests']}: {kinds}" if kinds else "0"


def _table(run: Mapping[str, Any], n: int, repeats: int) -> Json:
    phases, failure = run["phases"], run["failure"]
    words = {"create": "created", "update": "updated", "noop": "unchanged"}
    labels = {"converge": "converge from empty", "second": "second sync",
              "steady": f"steady state (median of {repeats})",
              "bump": f"bump {len(range(0, n, BUMP_EVERY))} of {n} versions"}  # fmt: skip
    rows: list[list[Any]] = []
    for key, label in labels.items():
        if failure is not None and failure["phase"] == key:
            rows.append([label, None, None, None, f"FAILED: {failure['reason']}"])
            break
        phase, wall = phases[key], phases[key].get("wall_seconds")
        counts = phase.get("outcomes" if key == "second" else "counts", {})
        outcome = "ok, " + ", ".join(f"{c} {words.get(k, k) if key != 'second' else k}"
                                     for k, c in counts.items())  # fmt: skip
        if key == "steady":  # the request columns show the sync that made the most requests
            wall = phase["median_wall_seconds"]
            phase = max(phase["syncs"], key=lambda s: s["backend_requests"] + s["kube_requests"])
            outcome = (f"ok, {n} unchanged, {phases[key]['target_met']}/{repeats} at exactly "
                       f"{STEADY_TARGET} requests")  # fmt: skip
        rows.append([label, wall, _requests(phase, "backend"), _requests(phase, "kube"), outcome])
    if failure is not None and failure["phase"] not in labels:
        rows.append(["setting up the syncer", None, None, None, f"FAILED: {failure['reason']}"])
    default = " (the default)" if run["concurrency"] == DEFAULT_CONCURRENCY else ""
    title = f"sync: {n} desired workloads, SYNC_CONCURRENCY={run['concurrency']}{default}"
    columns = "phase|wall s{.3f}|backend requests|kube requests (by method)|outcome"
    return table(title, columns, rows)


def _converge_table(setup: Mapping[str, Any], runs: Mapping[str, Any]) -> Json:
    n, rows = setup["workloads"], []
    for c, run in runs.items():
        failed = (run["failure"] or {}).get("phase") == "converge"
        if (p := run["phases"].get("converge")) and not failed:
            wall, cpu = p["wall_seconds"], p["cpu_seconds"]
            rows.append([c, wall, n / wall, (p["backend_requests"] + p["kube_requests"]) / n, cpu,
                         "yes" if cpu >= CPU_BOUND * wall else "no",
                         setup["rollout_seconds_after"].get(f"{c}:converge")])  # fmt: skip
    return table("sync: converging from empty (not timed: the rollouts after it)",
                 "SYNC_CONCURRENCY|wall s{.2f}|workloads/s{,.0f}|requests per workload{.2f}|"
                 "process CPU s{.2f}|CPU-bound|rollout after, s{.0f}", rows)  # fmt: skip


def _notes(
    setup: Mapping[str, Any], runs: Mapping[str, Any], memory: Mapping[str, Any]
) -> list[str]:
    checked = [s["kube_as_expected"] for r in runs.values() for k, p in r["phases"].items()
               for s in (p["syncs"] if k == "steady" else [p])]  # fmt: skip
    known = [c for c in checked if c is not None]
    if not known:
        verdict = "No timed sync had counts to compare with what the Syncer did."
    elif all(known):
        unknown = f" (and {len(checked) - len(known)} not predictable)" if None in checked else ""
        verdict = (f"The counts of all {len(known)} timed syncs{unknown} match exactly what the "
                   "Syncer did: no other client's request counted.")  # fmt: skip
    else:
        verdict = (f"{known.count(False)} of {len(known)} timed syncs counted other requests "
                   "than the Syncer's actions imply (kube_as_expected false): another client's, "
                   "or a retry.")  # fmt: skip
    return [
        f"Kubernetes {setup['kubernetes'] or 'version unknown'}, started in "
        f"{setup['control_plane_start_seconds']:.0f} s. {verdict}",
        f"RSS of this process (the backend included, the control plane not; the peak is the "
        f"kernel's VmHWM): {mib(memory['baseline_rss_bytes'])} MiB before, "
        f"{mib(memory['servers_started_rss_bytes'])} MiB with the backend and the control "
        f"plane up, peak {mib(memory['peak_rss_bytes'])} MiB.",
        *(f"FAILED at SYNC_CONCURRENCY={c} in phase {r['failure']['phase']}: "
          f"{r['failure']['reason']}; that run's later phases were not measured."
          for c, r in runs.items() if r["failure"] is not None),
        *env_note(setup["settings_from_environment"]),
    ]  # fmt: skip
