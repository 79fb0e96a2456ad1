"""What the `http` job handler may call (HTTP_JOB_ALLOWED_TARGETS), parsed once.

The settings parse the entries into `AllowedTargets`; the handler's client
(app/adapters/workload_http.py) takes that value as it is and checks each job's URL
against it. Names are Kubernetes' own: a namespace's and a Service's name is a DNS-1123
label.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# a DNS-1123 label: what Kubernetes allows as a namespace's (and a Service's) name
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
TARGET_FORM = (
    "<namespace> or <service>.<namespace> (DNS-1123 labels: lowercase letters, digits and "
    "'-', starting and ending with a letter or digit, at most 63 characters)"
)


@dataclass(frozen=True, slots=True)
class AllowedTargets:
    """What the `http` job may call: every Service of `namespaces`, and the `services`
    named one by one, as (service, namespace)."""

    namespaces: frozenset[str]
    services: frozenset[tuple[str, str]]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowedTargets:
        """From HTTP_JOB_ALLOWED_TARGETS' entries: `<namespace>` or `<service>.<namespace>`.
        Raises ValueError naming the first entry of another form, or when there is none."""
        namespaces: set[str] = set()
        services: set[tuple[str, str]] = set()
        for entry in entries:
            labels = entry.split(".")
            if len(labels) > 2 or not all(DNS_LABEL.fullmatch(label) for label in labels):
                if entry.startswith(".") or entry.endswith((".svc", ".local")):
                    raise ValueError(f"{entry!r} is a host or a host suffix: give {TARGET_FORM}")
                raise ValueError(f"{entry!r} is not {TARGET_FORM}")
            if len(labels) == 1:
                namespaces.add(entry)
            else:
                services.add((labels[0], labels[1]))
        if not namespaces and not services:
            raise ValueError(f"no target allowed: give at least one {TARGET_FORM}")
        return cls(frozenset(namespaces), frozenset(services))

    @classmethod
    def namespace(cls, name: str) -> AllowedTargets:
        """Every Service of one namespace (the default: MANAGED_NAMESPACE, whose form the
        settings check)."""
        return cls(frozenset({name}), frozenset())

    def allows(self, service: str, namespace: str) -> bool:
        return namespace in self.namespaces or (service, namespace) in self.services

    def entries(self) -> list[str]:
        """The entries again, sorted: namespaces, then `<service>.<namespace>`."""
        return sorted(self.namespaces) + [f"{svc}.{ns}" for svc, ns in sorted(self.services)]

    def describe(self) -> str:
        parts = [f"the Services of namespace {name}" for name in sorted(self.namespaces)]
        parts += [f"Service {svc}.{ns}" for svc, ns in sorted(self.services)]
        return ", ".join(parts)
