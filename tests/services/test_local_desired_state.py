"""Sync from a local desired-state folder (the embedded default), using the shipped example."""

from __future__ import annotations

import shutil
from contextlib import AsyncExitStack
from pathlib import Path

from app.services.runtime import build_runtime, open_sync_only
from standins.sync_world import NAMESPACE
from tests.conftest import SettingsFactory
from tests.support.real_cluster import RealCluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "desired-state"


async def test_the_example_folder_syncs_into_the_cluster(
    cluster: RealCluster, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "desired"
    shutil.copytree(EXAMPLE, folder)
    settings = make_settings(
        desired_state_dir=folder,
        kubeconfig=cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE),
        managed_namespace=NAMESPACE,
    )
    rt = build_runtime(settings)
    async with AsyncExitStack() as stack:
        syncer = await open_sync_only(rt, stack)
        assert syncer is not None
        assert "local folder" in rt.components["sync"].reason
        outcome = await syncer.sync()
        assert outcome.ok, outcome.as_dict()
        assert sorted(d["metadata"]["name"] for d in cluster.list_deployments(NAMESPACE)) == [
            "echo",
            "hello",
        ]
        # an unchanged folder is a no-op; a bumped version is an update
        assert {r.outcome for r in (await syncer.sync()).results} == {"unchanged"}
        text = (folder / "workloads.yaml").read_text().replace('hello: "1.0.0"', 'hello: "1.0.1"')
        (folder / "workloads.yaml").write_text(text)
        shutil.copy(folder / "manifests/hello/1.0.0.yaml", folder / "manifests/hello/1.0.1.yaml")
        bumped = {r.name: (r.action, r.outcome) for r in (await syncer.sync()).results}
        assert bumped == {"echo": ("noop", "unchanged"), "hello": ("update", "applied")}
        # a broken file aborts the sync and changes nothing
        (folder / "workloads.yaml").write_text("workloads: [unclosed")
        cluster.clear_requests()
        broken = await syncer.sync()
        assert broken.aborted is not None and "not valid YAML" in broken.aborted
        assert [r for r in cluster.requests if r.method != "GET"] == []


async def test_without_a_cluster_sync_is_off_and_says_why(
    make_settings: SettingsFactory, tmp_path: Path
) -> None:
    settings = make_settings(desired_state_dir=EXAMPLE, kubeconfig=tmp_path / "missing")
    rt = build_runtime(settings)
    async with AsyncExitStack() as stack:
        assert await open_sync_only(rt, stack) is None
    component = rt.components["sync"]
    assert component.enabled is False
    assert "no cluster access" in component.reason and str(tmp_path / "missing") in component.reason
