"""Thread-safe object store with kube-apiserver write semantics.

One lock guards everything; the HTTP handlers (server thread) and the test-facing helpers
(main thread) both go through these methods. Deployment status is settled lazily from the
rollout simulator whenever an object is touched.
"""

from __future__ import annotations

import base64
import copy
import json
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import defaults, patching, rollout, selectors
from .meta import (
    DEPLOYMENTS,
    NAMESPACES,
    ApiError,
    Cause,
    Kind,
    Obj,
    already_exists,
    bad_request,
    conflict,
    invalid,
    not_found,
    timestamp,
)

REVISION = "deployment.kubernetes.io/revision"
_SERVER_FIELDS = ("uid", "creationTimestamp", "generation", "resourceVersion", "deletionTimestamp")


@dataclass
class Entry:
    obj: Obj
    rollout: rollout.Rollout | None = None
    applied: dict[str, Obj] = field(default_factory=dict)  # fieldManager -> last apply


def _without_rv(obj: Obj) -> Obj:
    clone = copy.deepcopy(obj)
    clone["metadata"].pop("resourceVersion", None)
    return clone


class Store:
    def __init__(
        self,
        *,
        rollout_delay: float,
        progress_deadline: float,
        strict_namespaces: bool,
        status_bumps_resource_version: bool,
    ) -> None:
        self.lock = threading.RLock()
        self.rollout_delay = rollout_delay
        self.progress_deadline = progress_deadline
        self.strict_namespaces = strict_namespaces
        self.status_bumps_resource_version = status_bumps_resource_version
        self.bad_images: set[str] = set()
        self.bad_predicates: list[Callable[[str], bool]] = []
        self._rv = 0
        self._entries: dict[Kind, dict[tuple[str, str], Entry]] = {DEPLOYMENTS: {}, NAMESPACES: {}}

    def reset(self, rollout_delay: float, progress_deadline: float) -> None:
        with self.lock:
            self.rollout_delay = rollout_delay
            self.progress_deadline = progress_deadline
            self.bad_images.clear()
            self.bad_predicates.clear()
            for entries in self._entries.values():
                entries.clear()

    @property
    def resource_version(self) -> str:
        with self.lock:
            return str(self._rv)

    # -- reads ---------------------------------------------------------------------------

    def get(self, kind: Kind, ns: str, name: str) -> Obj:
        with self.lock:
            return self._view(kind, self._require(kind, ns, name))

    def list(
        self,
        kind: Kind,
        ns: str | None,
        *,
        label_selector: str = "",
        field_selector: str = "",
        limit: int = 0,
        continue_token: str = "",
    ) -> Obj:
        labels = selectors.parse_label_selector(label_selector)
        fields = selectors.parse_field_selector(field_selector, kind)
        start = _decode_continue(continue_token) if continue_token else None
        with self.lock:
            items: list[Obj] = []
            for key in sorted(self._entries[kind]):
                if (ns is not None and key[0] != ns) or (start is not None and key <= start):
                    continue
                obj = self._view(kind, self._entries[kind][key])
                if selectors.matches(labels, obj["metadata"].get("labels")) and all(
                    f.matches(obj) for f in fields
                ):
                    items.append(obj)
            list_meta: Obj = {"resourceVersion": str(self._rv)}
        if limit and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            last = items[-1]["metadata"]
            key = (str(last.get("namespace") or ""), str(last["name"]))
            list_meta["continue"] = _encode_continue(key)
            list_meta["remainingItemCount"] = len(rest)
        for item in items:
            # Typed lists from the real server carry no apiVersion/kind on their items.
            item.pop("apiVersion", None)
            item.pop("kind", None)
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": list_meta,
            "items": items,
        }

    # -- writes --------------------------------------------------------------------------

    def create(self, kind: Kind, ns: str, body: Any, *, dry_run: bool = False) -> Obj:
        obj = _check_body(kind, ns, body, None)
        with self.lock:
            meta = obj["metadata"]
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{secrets.token_hex(3)[:5]}"
            name = str(meta.get("name") or "")
            if (ns, name) in self._entries[kind]:
                raise already_exists(kind, name)
            if kind.namespaced:
                self._ensure_namespace(ns, dry_run)
            prepared = self._prepare(kind, None, obj)
            if dry_run:
                return prepared
            self._rv += 1
            prepared["metadata"]["resourceVersion"] = str(self._rv)
            entry = Entry(prepared)
            if kind is DEPLOYMENTS:
                entry.rollout = rollout.Rollout(1, time.time(), 0)
            self._entries[kind][(ns, name)] = entry
            return self._view(kind, entry)

    def replace(
        self,
        kind: Kind,
        ns: str,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> Obj:
        with self.lock:
            entry = self._require(kind, ns, name)
            if subresource == "scale":
                return self._write_scale(entry, body, dry_run)
            obj = _check_body(kind, ns, body, name)
            return self._update(kind, entry, obj, subresource, dry_run)

    def get_scale(self, ns: str, name: str) -> Obj:
        with self.lock:
            return _scale_of(self._view(DEPLOYMENTS, self._require(DEPLOYMENTS, ns, name)))

    def patch(
        self,
        kind: Kind,
        ns: str,
        name: str,
        patch_type: str,
        patch: Any,
        *,
        field_manager: str | None = None,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> tuple[Obj, bool]:
        """Apply a patch; returns the object and whether it was created (apply only)."""
        if patch_type == patching.APPLY:
            if not field_manager:
                raise ApiError(
                    422,
                    'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
                    "is required for apply patch",
                )
            if not isinstance(patch, dict) or not patch.get("apiVersion") or not patch.get("kind"):
                raise bad_request("apply patches must set apiVersion and kind")
            if subresource == "scale":
                raise ApiError(415, "the emulator does not support apply on the scale subresource")
        with self.lock:
            entry = self._entries[kind].get((ns, name))
            if entry is None:
                if patch_type != patching.APPLY or subresource:
                    raise not_found(kind, name)
                created = self.create(kind, ns, _check_body(kind, ns, patch, name), dry_run=dry_run)
                if not dry_run:
                    self._entries[kind][(ns, name)].applied[str(field_manager)] = patch
                return created, True
            self._settle(kind, entry)
            current = _scale_of(entry.obj) if subresource == "scale" else copy.deepcopy(entry.obj)
            if patch_type == patching.STRATEGIC:
                result = patching.strategic_merge(current, patch)
            elif patch_type == patching.MERGE:
                result = patching.merge_patch(current, patch)
            elif patch_type == patching.JSON:
                result = patching.json_patch(current, patch)
            else:
                previous = entry.applied.get(str(field_manager))
                result = patching.strategic_merge(current, patching.with_deletions(previous, patch))
            if subresource == "scale":
                return self._write_scale(entry, result, dry_run), False
            obj = _check_body(kind, ns, result, name)
            updated = self._update(kind, entry, obj, subresource, dry_run)
            if patch_type == patching.APPLY and not dry_run:
                entry.applied[str(field_manager)] = patch
            return updated, False

    def delete(
        self, kind: Kind, ns: str, name: str, options: Any = None, *, dry_run: bool = False
    ) -> Obj:
        with self.lock:
            entry = self._require(kind, ns, name)
            meta = entry.obj["metadata"]
            wanted = (options.get("preconditions") if isinstance(options, dict) else None) or {}
            for key in ("resourceVersion", "uid"):
                if wanted.get(key) and wanted[key] != meta.get(key):
                    raise conflict(
                        kind,
                        name,
                        f"Precondition failed: {key[0].upper()}{key[1:]} in precondition: "
                        f"{wanted[key]}, {key[0].upper()}{key[1:]} in object meta: {meta.get(key)}",
                    )
            if not dry_run:
                del self._entries[kind][(ns, name)]
                self._rv += 1
        details: Obj = {"name": name, "kind": kind.plural, "uid": meta["uid"]}
        if kind.group:
            details["group"] = kind.group
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": details,
        }

    # -- internals -----------------------------------------------------------------------

    def _require(self, kind: Kind, ns: str, name: str) -> Entry:
        entry = self._entries[kind].get((ns, name))
        if entry is None:
            raise not_found(kind, name)
        return entry

    def _ensure_namespace(self, ns: str, dry_run: bool) -> None:
        if ("", ns) in self._entries[NAMESPACES]:
            return
        if self.strict_namespaces:
            raise not_found(NAMESPACES, ns)
        if not dry_run:
            self.create(NAMESPACES, "", {"metadata": {"name": ns}})

    def _is_bad(self, obj: Obj) -> bool:
        pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
        images = [
            str(c.get("image") or "")
            for c in (pod.get("containers") or []) + (pod.get("initContainers") or [])
        ]
        return any(
            image in self.bad_images or any(check(image) for check in self.bad_predicates)
            for image in images
        )

    def _settle(self, kind: Kind, entry: Entry) -> None:
        if kind is not DEPLOYMENTS or entry.rollout is None:
            return
        state = entry.rollout
        status = state.status_override
        if status is None:
            timing = rollout.Timing(self.rollout_delay, self.progress_deadline)
            bad = self._is_bad(entry.obj)
            status = rollout.simulate(state, entry.obj, time.time(), timing, bad)
        if status != entry.obj.get("status"):
            entry.obj["status"] = status
            if self.status_bumps_resource_version:
                self._rv += 1
                entry.obj["metadata"]["resourceVersion"] = str(self._rv)

    def _view(self, kind: Kind, entry: Entry) -> Obj:
        self._settle(kind, entry)
        return copy.deepcopy(entry.obj)

    def _prepare(
        self, kind: Kind, old: Obj | None, obj: Obj, subresource: str | None = None
    ) -> Obj:
        if old is not None and subresource == "status":
            status = obj.get("status") or {}
            obj = copy.deepcopy(old)
            obj["status"] = status
            return obj
        meta = obj["metadata"]
        for key in _SERVER_FIELDS:
            meta.pop(key, None)
        if old is None:
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = timestamp(time.time())
            obj.pop("status", None)
        else:
            for key in ("uid", "creationTimestamp", "generation"):
                if key in old["metadata"]:
                    meta[key] = old["metadata"][key]
            if "status" in old:
                obj["status"] = copy.deepcopy(old["status"])
        defaults.apply_defaults(kind, obj)
        causes = defaults.validate(kind, obj, old)
        if causes:
            raise invalid(kind, str(meta.get("name") or ""), causes)
        if kind is DEPLOYMENTS:
            self._stamp_deployment(obj, old)
        return obj

    @staticmethod
    def _stamp_deployment(obj: Obj, old: Obj | None) -> None:
        meta = obj["metadata"]
        annotations = meta.get("annotations")
        if not isinstance(annotations, dict):
            annotations = meta["annotations"] = {}
        if old is None:
            meta["generation"] = 1
            obj["status"] = {}
            annotations[REVISION] = "1"
            return
        if obj["spec"] != old["spec"]:
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        revision = int((old["metadata"].get("annotations") or {}).get(REVISION, "1"))
        if obj["spec"].get("template") != old["spec"].get("template"):
            revision += 1
        # The deployment controller owns this annotation and puts it back if a client drops it.
        annotations[REVISION] = str(revision)

    def _write_scale(self, entry: Entry, scale: Any, dry_run: bool) -> Obj:
        name = entry.obj["metadata"]["name"]
        replicas = (scale.get("spec") or {}).get("replicas") if isinstance(scale, dict) else None
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            cause = Cause("spec.replicas", "FieldValueInvalid", f"Invalid value: {replicas}")
            raise invalid(DEPLOYMENTS, name, [cause])
        obj = copy.deepcopy(entry.obj)
        obj["spec"]["replicas"] = replicas
        obj["metadata"]["resourceVersion"] = (scale.get("metadata") or {}).get("resourceVersion")
        return _scale_of(self._update(DEPLOYMENTS, entry, obj, None, dry_run))

    def _update(
        self, kind: Kind, entry: Entry, obj: Obj, subresource: str | None, dry_run: bool
    ) -> Obj:
        self._settle(kind, entry)
        old = entry.obj
        name = old["metadata"]["name"]
        wanted_rv = obj["metadata"].get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise conflict(kind, name)
        prepared = self._prepare(kind, old, obj, subresource)
        prepared["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if _without_rv(prepared) == _without_rv(old):
            # A no-op write is not persisted: resourceVersion and generation stay put.
            if subresource == "status" and entry.rollout is not None and not dry_run:
                entry.rollout.status_override = copy.deepcopy(prepared.get("status"))
            return copy.deepcopy(old)
        if dry_run:
            return prepared
        self._rv += 1
        prepared["metadata"]["resourceVersion"] = str(self._rv)
        if entry.rollout is not None:
            generation = int(prepared["metadata"].get("generation", 1))
            if subresource == "status":
                entry.rollout.status_override = copy.deepcopy(prepared.get("status"))
            elif generation != entry.rollout.generation:
                ready = int((old.get("status") or {}).get("readyReplicas") or 0)
                entry.rollout = rollout.Rollout(generation, time.time(), ready)
        entry.obj = prepared
        return self._view(kind, entry)


def _check_body(kind: Kind, ns: str, body: Any, url_name: str | None) -> Obj:
    """Normalise a request body, rejecting what the real server rejects before validation."""
    if not isinstance(body, dict):
        raise bad_request(f"the body of the request must be a {kind.kind} object")
    obj = copy.deepcopy(body)
    if obj.get("apiVersion") not in (None, kind.api_version):
        raise bad_request(
            f"the API version in the data ({obj['apiVersion']}) does not match the expected "
            f"API version ({kind.api_version})"
        )
    if obj.get("kind") not in (None, kind.kind):
        raise bad_request(
            f"the kind in the data ({obj['kind']}) does not match the expected kind ({kind.kind})"
        )
    obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
    meta = obj.get("metadata")
    if meta is None:
        meta = obj["metadata"] = {}
    if not isinstance(meta, dict):
        raise bad_request("metadata must be an object")
    if kind.namespaced:
        if meta.get("namespace") not in (None, "", ns):
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        meta["namespace"] = ns
    else:
        meta.pop("namespace", None)
    if url_name is not None:
        if meta.get("name") not in (None, "", url_name):
            raise bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL "
                f"({url_name})"
            )
        meta["name"] = url_name
    return obj


def _scale_of(deployment: Obj) -> Obj:
    meta = deployment["metadata"]
    match_labels = (deployment["spec"].get("selector") or {}).get("matchLabels") or {}
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
        },
        "spec": {"replicas": deployment["spec"].get("replicas", 0)},
        "status": {
            "replicas": int((deployment.get("status") or {}).get("replicas") or 0),
            "selector": ",".join(f"{key}={value}" for key, value in match_labels.items()),
        },
    }


def _encode_continue(key: tuple[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def _decode_continue(token: str) -> tuple[str, str]:
    try:
        ns, name = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, TypeError) as exc:
        raise bad_request("continue key is not valid") from exc
    return str(ns), str(name)
