"""Self-update with `SELF_UPDATE_URL=s3://bucket/key`: the version file in a private bucket
on moto's S3 server (IAM checks on), the own Deployment on the real API server (kwok makes
pods Ready), the self-updater built by the runtime from the settings as in production."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from app.api.schemas import ComponentInfo
from app.domain.updates import Choice
from app.services.runtime import Runtime, build_runtime, open_self_update_only
from tests.conftest import SettingsFactory
from tests.support.moto_s3 import (
    Keys,
    MotoS3,
    S3World,
    isolated_aws_environment,
    use_keys,
)
from tests.support.real_cluster import RealCluster
from tests.support.version_file import OWN_NS, REPO, image_of, own_deployment, updater

DEADLINE = 10.0
POLL = 0.05


@pytest.fixture
def s3(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3World:
    isolated_aws_environment(monkeypatch, tmp_path)
    return moto_s3.provision()


@pytest.fixture
async def runtime(
    cluster: RealCluster, s3: S3World, make_settings: SettingsFactory, tmp_path: Path
) -> AsyncIterator[Runtime]:
    plane = cluster.plane
    plane.kubectl("-n", OWN_NS, "delete", "deployment", "workload-manager",
                  "--ignore-not-found", "--wait=true")  # fmt: skip
    cluster.add_deployment(own_deployment(f"{REPO}:0.1.0"))
    plane.kubectl("-n", OWN_NS, "rollout", "status", "deployment/workload-manager",
                  "--timeout=60s")  # fmt: skip
    settings = make_settings(
        self_update_url=s3.version_file,
        self_update_s3_endpoint=s3.url,
        pod_namespace=OWN_NS,
        kubeconfig=cluster.write_kubeconfig(tmp_path / "kc", OWN_NS),
        self_image_repository=REPO,
        self_update_deadline_seconds=DEADLINE,
        self_update_min_healthy_seconds=0,
        self_update_poll_seconds=POLL,
        self_update_timeout_seconds=5.0,
        kube_timeout_seconds=3.0,
    )
    rt = build_runtime(settings)
    async with AsyncExitStack() as stack:
        updater = await open_self_update_only(rt, stack)
        assert updater is not None, rt.components["self_update"].reason
        rt.supervisor.add_loop(
            "self-update", updater.run_scheduled, every=3600,
            component=rt.components["self_update"],
        )  # fmt: skip
        yield rt
    plane.kubectl("-n", OWN_NS, "delete", "deployment", "workload-manager",
                  "--ignore-not-found", "--wait=true")  # fmt: skip


async def test_with_the_right_credentials_a_newer_version_is_decided_and_applied(
    runtime: Runtime, cluster: RealCluster, s3: S3World, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    s3.put(b'{"version": "0.2.0"}')
    decision = await updater(runtime).check()
    assert decision.choice is Choice.UPDATE and decision.image == f"{REPO}:0.2.0"
    await runtime.supervisor.run_now("self-update")
    assert image_of(cluster) == f"{REPO}:0.2.0"
    assert runtime.metrics.self_updates.labels("available")._value.get() == 1
    assert runtime.components["self_update"].state == "ok"


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("wrong secret", "HTTP 403 SignatureDoesNotMatch"),
        ("unknown key", "HTTP 403 InvalidAccessKeyId"),
        ("no rights", "HTTP 403 AccessDenied"),
        ("no credentials", "no AWS credentials found"),
        ("no object", "HTTP 404 NoSuchKey"),
        ("garbage", "not a version"),
    ],
)
async def test_refusals_a_missing_object_and_garbage_change_nothing_and_say_why(
    runtime: Runtime, cluster: RealCluster, s3: S3World, monkeypatch: pytest.MonkeyPatch,
    case: str, says: str,
) -> None:  # fmt: skip
    keys = {
        "wrong secret": Keys(s3.reader.access_key_id, "not-the-secret-key-of-the-reader"),
        "unknown key": Keys("AKIAUNKNOWNKEY000000", s3.reader.secret_access_key),
        "no rights": s3.stranger,
        "no credentials": None,
    }.get(case, s3.reader)
    if keys is not None:
        use_keys(monkeypatch, keys)
    if case != "no object":
        s3.put(b"<html>oops</html>" if case == "garbage" else b'{"version": "0.2.0"}')
    cluster.clear_requests()
    await runtime.supervisor.run_now("self-update")
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert [r for r in cluster.requests if r.method != "GET"] == []
    assert updater(runtime).last is None  # nothing was decided
    # what /v1/status shows for the component
    shown = ComponentInfo(**runtime.components["self_update"].as_dict())
    assert shown.state == "failing"
    assert shown.last_error is not None and says in shown.last_error, shown.last_error
    if case != "garbage":
        assert shown.last_error.startswith(f"GET {s3.version_file}: ")
    assert s3.reader.secret_access_key not in shown.model_dump_json()
    assert runtime.metrics.self_updates.labels("check-failed")._value.get() == 1
