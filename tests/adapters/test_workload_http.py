"""What the `http` job may call (the URL check, table-driven: no request is made), how
httpx's failures are classified, and HTTP_JOB_ALLOWED_TARGETS' validation by the settings
(the entries' own parser: tests/domain/test_http_targets.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.adapters.workload_http import WorkloadHttp, WorkloadHttpError, retryable
from app.domain.http_targets import AllowedTargets
from app.settings import SettingsError, load_settings

DEFAULT = ("workloads",)  # MANAGED_NAMESPACE's default, what an empty setting allows
WITH_ONE_SERVICE = ("workloads", "api.other")


@pytest.mark.parametrize(
    ("targets", "url", "service"),
    [
        (DEFAULT, "http://api.workloads", ("api", "workloads", "api.workloads.svc")),
        (DEFAULT, "http://api.workloads:8080/x", ("api", "workloads", "api.workloads.svc")),
        (DEFAULT, "http://api.workloads.svc:8080/v1/write?a=1#f",
         ("api", "workloads", "api.workloads.svc")),
        (DEFAULT, "http://api.workloads.svc.cluster.local/",
         ("api", "workloads", "api.workloads.svc.cluster.local")),
        (DEFAULT, "http://api.workloads.svc.cluster.local./",
         ("api", "workloads", "api.workloads.svc.cluster.local.")),
        (DEFAULT, "HTTPS://API.Workloads.SVC/", ("api", "workloads", "api.workloads.svc")),
        (DEFAULT, "http://my-api-2.workloads.svc/",
         ("my-api-2", "workloads", "my-api-2.workloads.svc")),
        (WITH_ONE_SERVICE, "http://api.other.svc:9000/", ("api", "other", "api.other.svc")),
        (WITH_ONE_SERVICE, "http://api.other/", ("api", "other", "api.other.svc")),
        (("1",), "http://api.1.svc/", ("api", "1", "api.1.svc")),
    ],
)  # fmt: skip
def test_a_service_of_an_allowed_namespace_or_an_allowed_service_may_be_called(
    targets: tuple[str, ...], url: str, service: tuple[str, str, str]
) -> None:
    target = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.parse(targets)).check_url(url)
    assert (target.service, target.namespace, target.connect_host) == service


@pytest.mark.parametrize(
    ("targets", "url"),
    [
        # the cluster's own Services, which the suffix check let through
        (DEFAULT, "http://nats.nats.svc:8222/varz"),
        (DEFAULT, "http://kube-dns.kube-system.svc.cluster.local:9153/metrics"),
        (DEFAULT, "http://workload-manager.workload-manager.svc:8080/v1/status"),
        (WITH_ONE_SERVICE, "http://db.other.svc/"),  # only api.other is allowed there
        # longer names that end or start like a cluster name
        (DEFAULT, "http://x.notsvc.cluster.local/"),
        (DEFAULT, "http://api.workloads.svc.cluster.local.evil.example/"),
        (DEFAULT, "http://api.workloads.svc.example.com/"),
        (DEFAULT, "http://a.api.workloads.svc/"),
        (DEFAULT, "http://api.workloads.svc.cluster/"),
        (DEFAULT, "http://api.workloads.cluster.local/"),
        # a trailing dot skips the search domains: the internet's DNS would answer
        (DEFAULT, "http://api.workloads./"),
        (DEFAULT, "http://api.workloads.svc./"),
        # bare names, localhost, outside hosts
        (DEFAULT, "http://workloads/"),
        (DEFAULT, "http://api/"),
        (DEFAULT, "http://localhost:8080/"),
        (DEFAULT, "http://localhost.workloads.svc/"),
        (("localhost",), "http://api.localhost/"),
        (DEFAULT, "http://example.com/"),
        # names no DNS label takes
        (DEFAULT, "http://-api.workloads.svc/"),
        (DEFAULT, "http://api_1.workloads.svc/"),
        (DEFAULT, "http://api%2eworkloads.svc/"),
        (DEFAULT, "http://\u00e4pi.workloads.svc/"),
    ],
)
def test_any_other_host_is_refused_naming_it_and_what_is_allowed(
    targets: tuple[str, ...], url: str
) -> None:
    http = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.parse(targets))
    with pytest.raises(WorkloadHttpError, match=r"is not allowed: the http job may call") as e:
        http.check_url(url)
    assert not e.value.retryable
    assert f"host '{httpx.URL(url).host}'" in str(e.value) or "%2e" in url
    assert "the Services of namespace" in str(e.value)


@pytest.mark.parametrize(
    ("targets", "url"),
    [
        (DEFAULT, "http://127.0.0.1:8080/"),
        (DEFAULT, "http://10.96.0.10:53/"),
        (DEFAULT, "http://[::1]:8080/"),
        (DEFAULT, "http://[fd00::a]/"),
        (DEFAULT, "http://2130706433/"),
        (("1",), "http://127.1/"),  # inet_aton reads it as 127.0.0.1, not as Service 127 of "1"
        (("1",), "http://0x7f.1/"),
    ],
)
def test_ip_literals_are_refused_as_such(targets: tuple[str, ...], url: str) -> None:
    http = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.parse(targets))
    with pytest.raises(WorkloadHttpError, match=r"is an IP address: the http job may call"):
        http.check_url(url)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://api.workloads.svc/a\tb", r"'\\t' at position 26 \(whitespace or a control"),
        ("http://api.work\tloads.svc/", r"'\\t' at position 15"),  # urlsplit would drop it
        ("http://api.workloads.svc/a\nb", r"'\\n'"),
        ("http://api.workloads.svc/a\rb", r"'\\r'"),
        ("http://api.workloads.svc/a b", r"' '"),
        ("http://api.workloads.svc/a\x00b", r"'\\x00'"),
        ("http://api.workloads.svc/a\x7fb", r"'\\x7f'"),
        ("http://api.workloads.svc/a\x85b", r"'\\x85'"),
        ("http://api.workloads.svc/a\u2028b", r"'\\u2028'"),
        (" http://api.workloads.svc/", r"' ' at position 0"),
        ("http://api.workloads.svc/\n", r"'\\n'"),
        ("http://user@api.workloads.svc/", "userinfo"),
        ("http://user:pw@api.workloads.svc/", "userinfo"),
        ("http://api.workloads.svc\\@evil.example/", "userinfo"),
        ("http://api.workloads.svc:0/", "not a valid port"),
        ("http://api.workloads.svc:65536/", "not a valid port"),
        ("http://api.workloads.svc:99999/", "not a valid port"),
        ("http://api.workloads.svc:abc/", "not a valid port"),
        ("http://api.workloads.svc:80:80/", "not a valid port"),
        ("http://api.workloads.svc:+80/", "not a valid port"),
        ("http://api.workloads.svc:\uff18\uff10/", "not a valid port"),  # fullwidth 80
        ("http://[api.workloads.svc]/", "not an http"),
        ("http://[::1/", "not an http"),
        ("ftp://api.workloads.svc/", "not an http"),
        ("file:///etc/passwd", "not an http"),
        ("api.workloads.svc/x", "not an http"),
        ("http:///x", "not an http"),
        ("", "not an http"),
    ],
)
def test_a_url_that_cannot_be_sent_is_refused_permanently(url: str, why: str) -> None:
    http = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.parse(DEFAULT))
    with pytest.raises(WorkloadHttpError, match=why) as caught:
        http.check_url(url)
    assert not caught.value.retryable


# pieces of authorities that parsers are known to read differently
PIECES = [
    "api", "workloads", "svc", "cluster", "local", "evil", ".", ":", "@", "\\", "/", "?",
    "#", "[", "]", "%2e", "%40", "8080", "\t", "\n", " ", "\x00", "\u3002", "\uff0e",
]  # fmt: skip
_pieces = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)


@given(_pieces, st.sampled_from(["", ".svc", ".svc.cluster.local"]), _pieces)
def test_the_host_checked_is_the_host_httpx_connects_to(before: str, form: str, after: str) -> None:
    """Whatever surrounds an allowed name, a URL that passes the check names, to httpx,
    the same host and no userinfo: no parser difference takes a request elsewhere."""
    url = f"http://{before}api.workloads{form}{after}/x"
    try:
        target = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.parse(DEFAULT)).check_url(
            url
        )
    except WorkloadHttpError:
        return
    parsed = httpx.URL(url)
    assert (parsed.host, parsed.userinfo) == (target.host, b"")
    assert target.namespace == "workloads"


def test_a_refusal_does_not_show_the_password_of_a_url() -> None:
    http = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.parse(DEFAULT))
    with pytest.raises(WorkloadHttpError) as caught:
        http.check_url("http://user:s3cret@api.workloads.svc/")
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(
    ("error", "again"),
    [
        (httpx.UnsupportedProtocol("Request URL has an unsupported protocol 'gopher://'"), False),
        (httpx.LocalProtocolError("Illegal header value b'k\\n1'"), False),
        (httpx.ConnectError("connection refused"), True),
        (httpx.ConnectTimeout("timed out"), True),
        (httpx.ReadTimeout("timed out"), True),
        (httpx.PoolTimeout("timed out"), True),
        (httpx.ReadError("reset"), True),
        (httpx.WriteError("broken pipe"), True),
        (httpx.RemoteProtocolError("peer closed connection"), True),
        (httpx.ProxyError("bad gateway"), True),
        (httpx.DecodingError("bad gzip"), True),
    ],
)
def test_httpx_failures_are_retried_unless_the_request_cannot_be_made(
    error: httpx.HTTPError, again: bool
) -> None:
    assert retryable(error) is again


@pytest.mark.parametrize(
    ("value", "loaded"),
    [
        ("", []),
        ("workloads", ["workloads"]),
        (" workloads , api.other ,", ["workloads", "api.other"]),
        ('["workloads", "api.other"]', ["workloads", "api.other"]),
        ("[]", []),
    ],
)
def test_the_setting_takes_namespaces_and_services(
    monkeypatch: pytest.MonkeyPatch, value: str, loaded: list[str]
) -> None:
    """Parsed once, by the settings; none given is None (MANAGED_NAMESPACE only)."""
    monkeypatch.setenv("HTTP_JOB_ALLOWED_TARGETS", value)
    targets = load_settings(_env_file=None).http_job_allowed_targets
    assert (targets.entries() if targets is not None else []) == loaded


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (".svc,.svc.cluster.local", r"'\.svc' is a host or a host suffix"),
        ("workloads,api.workloads.svc", r"'api\.workloads\.svc' is a host or a host suffix"),
        ("workloads,Other", r"'Other' is not <namespace> or <service>\.<namespace>"),
        ("127.0.0.1", r"'127\.0\.0\.1' is not"),
        ('["workloads"', "must be a JSON list or comma-separated values"),
    ],
)
def test_the_setting_refuses_other_entries(
    monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    monkeypatch.setenv("HTTP_JOB_ALLOWED_TARGETS", value)
    with pytest.raises(SettingsError, match=f"^HTTP_JOB_ALLOWED_TARGETS: .*{why}"):
        load_settings(_env_file=None)


def test_an_entry_that_is_not_a_string_is_refused_naming_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_JOB_ALLOWED_TARGETS", '["workloads", 1]')
    with pytest.raises(SettingsError) as caught:
        load_settings(_env_file=None)
    assert str(caught.value) == "HTTP_JOB_ALLOWED_TARGETS.1: Input should be a valid string"


@pytest.mark.parametrize("name", ["HTTP_JOB_ALLOWED_SUFFIXES", "http_job_allowed_suffixes"])
def test_the_former_setting_in_the_environment_stops_the_start(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(name, ".svc,.svc.cluster.local")
    with pytest.raises(SettingsError, match=r"HTTP_JOB_ALLOWED_SUFFIXES is no longer read: set "
                       r"HTTP_JOB_ALLOWED_TARGETS instead"):  # fmt: skip
        load_settings(_env_file=None)


def test_the_former_setting_in_the_env_file_stops_the_start(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("NODE_ID=n1\nHTTP_JOB_ALLOWED_SUFFIXES=.svc\n")
    with pytest.raises(SettingsError, match="HTTP_JOB_ALLOWED_SUFFIXES is no longer read"):
        load_settings(_env_file=env_file)


def test_the_former_setting_left_blank_is_unset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As every `NAME=` of .env.example: blank means not set."""
    monkeypatch.setenv("HTTP_JOB_ALLOWED_SUFFIXES", "")
    env_file = tmp_path / ".env"
    env_file.write_text("HTTP_JOB_ALLOWED_SUFFIXES=\n")
    assert load_settings(_env_file=env_file).http_job_allowed_targets is None
