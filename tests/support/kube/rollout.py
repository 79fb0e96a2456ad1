"""Lazy Deployment rollout simulator: the status the deployment controller would have written.

Status is a pure function of the spec, the time the spec last changed and how many replicas
were ready before, so reading it from any thread at any moment needs no background task.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .meta import Obj, timestamp

_HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


@dataclass
class Rollout:
    generation: int
    started: float  # wall-clock time the current generation was written
    from_ready: int  # ready replicas of the previous generation at that moment
    status_override: Obj | None = None  # set by a write to the status subresource


@dataclass(frozen=True)
class Timing:
    delay: float
    deadline: float


def template_hash(template: Obj) -> str:
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return "".join(_HASH_ALPHABET[b % len(_HASH_ALPHABET)] for b in digest[:10])


def _max_unavailable(spec: Obj, desired: int) -> int:
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        return desired
    value = (strategy.get("rollingUpdate") or {}).get("maxUnavailable", "25%")
    if isinstance(value, str) and value.endswith("%"):
        return desired * int(value[:-1]) // 100
    return int(value)


def _condition(kind: str, ok: str, reason: str, message: str, since: float) -> Obj:
    return {
        "type": kind,
        "status": ok,
        "lastUpdateTime": timestamp(since),
        "lastTransitionTime": timestamp(since),
        "reason": reason,
        "message": message,
    }


def _counts(**counts: int) -> Obj:
    # The real status omits zero counts (omitempty), so clients must cope with absent fields.
    return {key: value for key, value in counts.items() if value}


def simulate(rollout: Rollout, deployment: Obj, now: float, timing: Timing, bad: bool) -> Obj:
    spec = deployment.get("spec") or {}
    desired = int(spec.get("replicas") or 0)
    rs_name = f"{deployment['metadata']['name']}-{template_hash(spec.get('template') or {})}"
    elapsed = now - rollout.started
    if not bad and not spec.get("paused") and elapsed >= timing.delay:
        done = rollout.started + timing.delay
        return {
            "observedGeneration": rollout.generation,
            **_counts(
                replicas=desired,
                updatedReplicas=desired,
                readyReplicas=desired,
                availableReplicas=desired,
            ),
            "conditions": [
                _condition(
                    "Available",
                    "True",
                    "MinimumReplicasAvailable",
                    "Deployment has minimum availability.",
                    done,
                ),
                _condition(
                    "Progressing",
                    "True",
                    "NewReplicaSetAvailable",
                    f'ReplicaSet "{rs_name}" has successfully progressed.',
                    done,
                ),
            ],
        }
    ready = rollout.from_ready
    if ready >= desired - _max_unavailable(spec, desired):
        available = _condition(
            "Available",
            "True",
            "MinimumReplicasAvailable",
            "Deployment has minimum availability.",
            rollout.started,
        )
    else:
        available = _condition(
            "Available",
            "False",
            "MinimumReplicasUnavailable",
            "Deployment does not have minimum availability.",
            rollout.started,
        )
    if spec.get("paused"):
        progressing = _condition(
            "Progressing", "Unknown", "DeploymentPaused", "Deployment is paused", rollout.started
        )
    elif bad and elapsed >= timing.deadline:
        progressing = _condition(
            "Progressing",
            "False",
            "ProgressDeadlineExceeded",
            f'ReplicaSet "{rs_name}" has timed out progressing.',
            rollout.started + timing.deadline,
        )
    else:
        progressing = _condition(
            "Progressing",
            "True",
            "ReplicaSetUpdated",
            f'ReplicaSet "{rs_name}" is progressing.',
            rollout.started,
        )
    return {
        "observedGeneration": rollout.generation,
        **_counts(
            # every pod counts: the new ReplicaSet's (not ready) and the old one's (still
            # serving), which is how `kubectl rollout status` tells a rollout is not done
            replicas=desired + ready,
            updatedReplicas=desired,
            readyReplicas=ready,
            availableReplicas=ready,
            unavailableReplicas=max(desired - ready, 0),
        ),
        "conditions": [available, progressing],
    }
