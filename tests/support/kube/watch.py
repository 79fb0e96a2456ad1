"""Watch as a polling diff of the store, streamed as newline-delimited JSON watch events.

There is no event history: a watch from a resourceVersion treats objects written after it as
MODIFIED and cannot report deletions that happened before the watch started.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from .faults import Control
from .meta import ApiError, Kind, Obj
from .store import Store

POLL_SECONDS = 0.05
_DEFAULT_TIMEOUT = 1800.0


def _snapshot(store: Store, kind: Kind, ns: str | None, labels: str, fields: str) -> dict[str, Obj]:
    listed = store.list(kind, ns, label_selector=labels, field_selector=fields)
    return {
        f"{item['metadata'].get('namespace', '')}/{item['metadata']['name']}": {
            "apiVersion": kind.api_version,
            "kind": kind.kind,
            **item,
        }
        for item in listed["items"]
    }


def _event(kind: str, obj: Obj) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def respond(
    store: Store, control: Control, kind: Kind, ns: str | None, query: dict[str, str]
) -> StreamingResponse:
    labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
    try:
        timeout = float(query.get("timeoutSeconds") or _DEFAULT_TIMEOUT)
        since = int(query.get("resourceVersion") or 0)
    except ValueError as exc:
        raise ApiError(400, f"invalid watch parameters: {exc}") from exc
    current = _snapshot(store, kind, ns, labels, fields)  # raises 400 on a bad selector
    known = {
        key: obj
        for key, obj in current.items()
        if since and int(obj["metadata"]["resourceVersion"]) <= since
    }

    async def events() -> AsyncIterator[bytes]:
        nonlocal known, current
        deadline = time.monotonic() + timeout
        # Whether an object unknown at the start was created or updated after `since` is lost.
        unknown = "MODIFIED" if since else "ADDED"
        while True:
            for key, obj in current.items():
                if key not in known:
                    yield _event(unknown, obj)
                elif obj != known[key]:
                    yield _event("MODIFIED", obj)
            for key in known.keys() - current.keys():
                gone = known[key]
                gone["metadata"]["resourceVersion"] = store.resource_version
                yield _event("DELETED", gone)
            known, unknown = current, "ADDED"
            if control.closing.is_set() or time.monotonic() >= deadline:
                return
            await asyncio.sleep(POLL_SECONDS)
            current = _snapshot(store, kind, ns, labels, fields)

    return StreamingResponse(events(), media_type="application/json")
