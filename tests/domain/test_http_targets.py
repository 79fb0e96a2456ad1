"""HTTP_JOB_ALLOWED_TARGETS' entries parsed into `AllowedTargets`, table-driven: what is
allowed, and every refusal with its exact words."""

from __future__ import annotations

import pytest

from app.domain.http_targets import TARGET_FORM, AllowedTargets


@pytest.mark.parametrize(
    ("entries", "namespaces", "services"),
    [
        (["workloads"], {"workloads"}, set()),
        (["workloads", "api.other", "api.other"], {"workloads"}, {("api", "other")}),
        (["a" * 63, "1", "x-1.y-2"], {"a" * 63, "1"}, {("x-1", "y-2")}),
        (("api.other",), set(), {("api", "other")}),
    ],
)
def test_entries_are_namespaces_and_services(
    entries: list[str], namespaces: set[str], services: set[tuple[str, str]]
) -> None:
    parsed = AllowedTargets.parse(entries)
    assert parsed == AllowedTargets(frozenset(namespaces), frozenset(services))


HOST = f"is a host or a host suffix: give {TARGET_FORM}"
NOT = f"is not {TARGET_FORM}"


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (".svc", f"'.svc' {HOST}"),
        (".svc.cluster.local", f"'.svc.cluster.local' {HOST}"),
        ("api.workloads.svc", f"'api.workloads.svc' {HOST}"),
        ("svc.cluster.local", f"'svc.cluster.local' {HOST}"),
        ("a.b.c", f"'a.b.c' {NOT}"),
        ("Workloads", f"'Workloads' {NOT}"),
        ("work_loads", f"'work_loads' {NOT}"),
        ("-workloads", f"'-workloads' {NOT}"),
        ("workloads-", f"'workloads-' {NOT}"),
        ("a" * 64, f"'{'a' * 64}' {NOT}"),
        ("*.workloads", f"'*.workloads' {NOT}"),
        ("127.0.0.1", f"'127.0.0.1' {NOT}"),
        ("api.", f"'api.' {NOT}"),
        ("", f"'' {NOT}"),
    ],
)
def test_other_entries_are_refused_naming_the_entry_and_the_form(entry: str, error: str) -> None:
    with pytest.raises(ValueError) as caught:
        AllowedTargets.parse(["workloads", entry])
    assert str(caught.value) == error


def test_no_entry_at_all_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        AllowedTargets.parse([])
    assert str(caught.value) == f"no target allowed: give at least one {TARGET_FORM}"


def test_the_form_is_spelled_out() -> None:
    assert TARGET_FORM == (
        "<namespace> or <service>.<namespace> (DNS-1123 labels: lowercase letters, digits "
        "and '-', starting and ending with a letter or digit, at most 63 characters)"
    )


def test_one_namespace_is_every_service_of_it() -> None:
    targets = AllowedTargets.namespace("workloads")
    assert targets == AllowedTargets.parse(["workloads"])
    assert targets.allows("api", "workloads") and not targets.allows("api", "other")


@pytest.mark.parametrize(
    ("entries", "service", "namespace", "allowed"),
    [
        (["workloads"], "api", "workloads", True),
        (["workloads"], "api", "other", False),
        (["api.other"], "api", "other", True),
        (["api.other"], "web", "other", False),
    ],
)
def test_allows(entries: list[str], service: str, namespace: str, allowed: bool) -> None:
    assert AllowedTargets.parse(entries).allows(service, namespace) is allowed


def test_entries_and_description_are_sorted() -> None:
    targets = AllowedTargets.parse(["web.b", "z", "api.a", "b"])
    assert targets.entries() == ["b", "z", "api.a", "web.b"]
    assert targets.describe() == (
        "the Services of namespace b, the Services of namespace z, Service api.a, Service web.b"
    )
