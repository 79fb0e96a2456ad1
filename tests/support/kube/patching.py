"""The four PATCH flavours of kube-apiserver, applied to plain JSON-like dicts.

Strategic merge uses a path-agnostic table of merge keys (enough for Deployments and
Namespaces); server-side apply is approximated by a three-way strategic merge against the
manager's previous apply (see `with_deletions`).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import jsonpointer

from .meta import ApiError, Obj

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"
PATCH_TYPES = (STRATEGIC, MERGE, JSON, APPLY)

# patchMergeKey of the list fields reachable from a Deployment or Namespace.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
    "schedulingGates": "name",
    "conditions": "type",
    "ownerReferences": "uid",
}
# Primitive lists with patchStrategy=merge: the patch's items are added to the live ones.
MERGED_PRIMITIVE_LISTS = {"finalizers"}


def _clean(value: Any) -> Any:
    """Drop `$` directives and nulls from a value that is inserted rather than merged."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if not k.startswith("$") and v is not None}
    if isinstance(value, list):
        return [_clean(item) for item in value]
    return value


def _is_directive(item: Any, directive: str) -> bool:
    return isinstance(item, dict) and item.get("$patch") == directive


def strategic_merge(original: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return _clean(patch)
    if _is_directive(patch, "replace"):
        return _clean(patch)
    return _merge_map(original if isinstance(original, dict) else {}, patch)


def _merge_map(original: Obj, patch: Obj) -> Obj:
    result = copy.deepcopy(original)
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [item for item in result.get(field) or [] if item not in value]
    orders: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            orders[key.split("/", 1)[1]] = value
        elif key.startswith("$"):
            continue  # $patch handled by the caller; $retainKeys is not honoured
        elif value is None or _is_directive(value, "delete"):
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = strategic_merge(result.get(key), value)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            result[key] = value
    for field, order in orders.items():
        if isinstance(result.get(field), list):
            result[field] = _reorder(result[field], order, MERGE_KEYS.get(field))
    return result


def _merge_list(field: str, original: Any, patch: list[Any]) -> list[Any]:
    if any(_is_directive(item, "replace") for item in patch):
        return [_clean(item) for item in patch if not _is_directive(item, "replace")]
    live = copy.deepcopy(original) if isinstance(original, list) else []
    merge_key = MERGE_KEYS.get(field)
    if merge_key and all(isinstance(item, dict) for item in patch):
        for item in patch:
            key = item.get(merge_key)
            positions = [i for i, old in enumerate(live) if _key_of(old, merge_key) == key]
            if _is_directive(item, "delete"):
                live = [old for i, old in enumerate(live) if i not in positions]
            elif positions:
                live[positions[0]] = _merge_map(live[positions[0]], item)
            else:
                live.append(_merge_map({}, item))
        return live
    if field in MERGED_PRIMITIVE_LISTS:
        return live + [item for item in patch if item not in live]
    return [_clean(item) for item in patch]


def _key_of(item: Any, merge_key: str) -> Any:
    return item.get(merge_key) if isinstance(item, dict) else None


def _reorder(items: list[Any], order: list[Any], merge_key: str | None) -> list[Any]:
    wanted = [_key_of(entry, merge_key) if merge_key else entry for entry in order]

    def rank(indexed: tuple[int, Any]) -> tuple[int, int]:
        index, item = indexed
        key = _key_of(item, merge_key) if merge_key else item
        return (wanted.index(key), index) if key in wanted else (len(wanted), index)

    return [item for _, item in sorted(enumerate(items), key=rank)]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(document: Obj, operations: Any) -> Any:
    """RFC 6902 JSON patch; a failing `test` or a missing path is a 422 as on the real server."""
    if not isinstance(operations, list):
        raise ApiError(400, "json patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(document, operations, in_place=False)
    except jsonpatch.InvalidJsonPatch as exc:
        raise ApiError(400, f"invalid json patch: {exc}") from exc
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise ApiError(422, f"the server rejected our request due to an error: {exc}") from exc


def with_deletions(last: Any, new: Any) -> Any:
    """`new` plus deletion markers for what `last` (the manager's previous apply) had.

    This is the three-way merge `kubectl apply` performs with its last-applied annotation;
    it stands in for server-side apply's per-manager field ownership.
    """
    if not (isinstance(last, dict) and isinstance(new, dict)):
        return copy.deepcopy(new)
    patch = copy.deepcopy(new)
    for key, old in last.items():
        if key not in new:
            patch[key] = None
        elif isinstance(old, dict):
            patch[key] = with_deletions(old, new[key])
        elif isinstance(old, list) and isinstance(new[key], list) and key in MERGE_KEYS:
            patch[key] = _list_with_deletions(MERGE_KEYS[key], old, new[key])
    return patch


def _list_with_deletions(merge_key: str, last: list[Any], new: list[Any]) -> list[Any]:
    previous = {_key_of(item, merge_key): item for item in last}
    kept = {_key_of(item, merge_key) for item in new}
    items = [with_deletions(previous.get(_key_of(item, merge_key)), item) for item in new]
    items += [{merge_key: key, "$patch": "delete"} for key in previous if key not in kept]
    return items
