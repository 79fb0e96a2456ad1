"""`KubeEmulator`: the test-facing handle on the emulated API server (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from starlette.applications import Starlette

from tests.support.servers import ThreadedServer

from .faults import Control, RecordedRequest, Rule
from .meta import DEPLOYMENTS, NAMESPACES, ApiError, Obj
from .routes import build_app
from .store import Store


class KubeEmulator:
    """An in-process kube-apiserver for apps/v1 Deployments and core/v1 Namespaces."""

    def __init__(
        self,
        *,
        rollout_delay: float = 0.2,
        progress_deadline: float = 0.5,
        strict_namespaces: bool = False,
        status_bumps_resource_version: bool = False,
    ) -> None:
        self._store = Store(
            rollout_delay=rollout_delay,
            progress_deadline=progress_deadline,
            strict_namespaces=strict_namespaces,
            status_bumps_resource_version=status_bumps_resource_version,
        )
        self._options = (rollout_delay, progress_deadline)
        self._control = Control()
        self.app: Starlette = build_app(self._store, self._control)
        self._server: ThreadedServer | None = None

    # -- serving ----------------------------------------------------------------------

    @classmethod
    @contextmanager
    def serve(cls, **options: Any) -> Iterator[KubeEmulator]:
        with cls(**options) as emulator:
            yield emulator

    def start(self) -> KubeEmulator:
        if self._server is None:
            self._control.reopen()
            server = ThreadedServer(self.app)
            self._server = server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._control.shutdown()
            self._server.stop()
            self._server = None

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the emulator is not serving; use start() or KubeEmulator.serve()")
        return self._server.url

    def reset(self) -> None:
        """Forget all objects, bad images, faults and recorded requests; restore the timings.

        resourceVersion keeps increasing. Lets one served emulator be shared by many tests.
        """
        self._control.reset()
        self._store.reset(*self._options)

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """Write a credential-free kubeconfig whose current context points at the emulator."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
                }
            ],
            "current-context": "emulator",
            "preferences": {},
        }
        target = Path(path)
        target.write_text(yaml.safe_dump(config, sort_keys=False))
        return target

    # -- simulator knobs ----------------------------------------------------------------

    @property
    def rollout_delay(self) -> float:
        return self._store.rollout_delay

    @rollout_delay.setter
    def rollout_delay(self, seconds: float) -> None:
        with self._store.lock:
            self._store.rollout_delay = seconds

    @property
    def progress_deadline(self) -> float:
        return self._store.progress_deadline

    @progress_deadline.setter
    def progress_deadline(self, seconds: float) -> None:
        with self._store.lock:
            self._store.progress_deadline = seconds

    def mark_bad_image(self, image: str | Callable[[str], bool]) -> None:
        """Rollouts using this image (or any image the predicate accepts) never become ready."""
        with self._store.lock:
            if isinstance(image, str):
                self._store.bad_images.add(image)
            else:
                self._store.bad_predicates.append(image)

    def clear_bad_images(self) -> None:
        with self._store.lock:
            self._store.bad_images.clear()
            self._store.bad_predicates.clear()

    @property
    def resource_version(self) -> str:
        return self._store.resource_version

    # -- state, as a human with kubectl would change it ---------------------------------

    def add_namespace(self, name: str, labels: dict[str, str] | None = None) -> Obj:
        return self._store.create(NAMESPACES, "", {"metadata": {"name": name, "labels": labels}})

    def add_deployment(self, obj: Obj, namespace: str | None = None) -> Obj:
        """Create a Deployment as POST would (defaults, validation, resourceVersion)."""
        ns = namespace or (obj.get("metadata") or {}).get("namespace") or "default"
        return self._store.create(DEPLOYMENTS, ns, obj)

    def get_deployment(self, namespace: str, name: str) -> Obj | None:
        try:
            return _with_kind(self._store.get(DEPLOYMENTS, namespace, name))
        except ApiError:
            return None

    def list_deployments(self, namespace: str | None = None, label_selector: str = "") -> list[Obj]:
        listed = self._store.list(DEPLOYMENTS, namespace, label_selector=label_selector)
        return [_with_kind(item) for item in listed["items"]]

    def edit_deployment(self, namespace: str, name: str, edit: Callable[[Obj], Obj | None]) -> Obj:
        """Apply `edit` to a copy of the live object and PUT the result (like `kubectl edit`).

        `edit` may mutate its argument in place or return a replacement.
        """
        with self._store.lock:
            draft = self._store.get(DEPLOYMENTS, namespace, name)
            edited = edit(draft)
            body = draft if edited is None else edited
            return _with_kind(self._store.replace(DEPLOYMENTS, namespace, name, body))

    def delete_deployment(self, namespace: str, name: str) -> bool:
        try:
            self._store.delete(DEPLOYMENTS, namespace, name)
        except ApiError:
            return False
        return True

    # -- observing and disturbing the traffic --------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        return self._control.requests

    def clear_requests(self) -> None:
        self._control.clear_requests()

    def fail_next(
        self,
        method: str | None = None,
        path_contains: str = "",
        *,
        status: int = 500,
        times: int = 1,
        message: str = "",
        retry_after: int | None = None,
    ) -> None:
        """Answer the next `times` matching requests with a Status of code `status`."""
        rule = Rule(method, path_contains, times, status, message, retry_after)
        self._control.add_fault(rule)

    def delay_next(
        self, method: str | None = None, path_contains: str = "", *, seconds: float, times: int = 1
    ) -> None:
        """Hold the next `times` matching requests for `seconds`, then serve them normally."""
        self._control.add_delay(Rule(method, path_contains, times, seconds=seconds))

    def clear_faults(self) -> None:
        self._control.clear_faults()

    @property
    def delays_waiting(self) -> int:
        """Delays set with `delay_next` that no request has met yet: 0 once the held
        request has arrived."""
        return self._control.delays_waiting


def _with_kind(item: Obj) -> Obj:
    return {"apiVersion": DEPLOYMENTS.api_version, "kind": DEPLOYMENTS.kind, **item}
