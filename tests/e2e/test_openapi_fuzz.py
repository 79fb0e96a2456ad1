"""Schemathesis against the running manager's own OpenAPI document.

The manager runs as a child process with every route live: the registry on a real
PostgreSQL, sync from a local desired-state folder into the real control plane, the
operator token on. Schemathesis generates requests from the document (valid and invalid
ones) and checks every answer: never a 5xx, and every status, content type and body as
the document says.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.schemas import BaseSchema as BaseOpenAPISchema

from app.adapters.embedded import EmbeddedPostgres
from app.main import create_app
from app.settings import Settings
from standins.control_plane import ControlPlane
from standins.databases import fresh_database_sync
from tests.conftest import isolate_settings
from tests.support.kube.proxy import FaultProxy
from tests.support.process import ManagerProcess
from tests.support.real_cluster import RealCluster

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOKEN = "fuzz-operator-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def manager_url(
    postgres_server: EmbeddedPostgres,
    tmp_path_factory: pytest.TempPathFactory,
    control_plane: ControlPlane,
    fault_proxy: tuple[FaultProxy, str],
) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("fuzz")
    desired = workdir / "desired"
    shutil.copytree(EXAMPLES / "desired-state", desired)  # POST /v1/sync has work to do
    cluster = RealCluster(control_plane, *fault_proxy)
    cluster.reset("workloads")
    with fresh_database_sync(postgres_server.url) as database:
        env = {
            "NODE_ID": "fuzz-node",
            "API_TOKEN": TOKEN,
            "DATABASE_URL": database,
            "DESIRED_STATE_DIR": str(desired),
            "KUBECONFIG": str(cluster.write_kubeconfig(workdir / "kc", "workloads")),
            "MANAGED_NAMESPACE": "workloads",
            "SYNC_INTERVAL_SECONDS": "3600",
            "LOG_LEVEL": "WARNING",
        }
        process = ManagerProcess(env=env, workdir=workdir).start()
        try:
            yield process.url
        finally:
            assert process.stop() in (0, -signal.SIGTERM), process.log()
        # the generated POST /v1/sync calls did real work, not just answer
        deployed = {d["metadata"]["name"] for d in cluster.list_deployments("workloads")}
        assert deployed == {"echo", "hello"}


@pytest.fixture(scope="module")
def api_schema(manager_url: str) -> BaseOpenAPISchema:
    return schemathesis.openapi.from_url(f"{manager_url}/openapi.json", timeout=10)


def _constrained(operation: dict[str, Any]) -> bool:
    """Whether some input of the operation can be invalid: a body, or a parameter that is
    not a free-form string."""
    if operation.get("requestBody"):
        return True
    for parameter in operation.get("parameters", []):
        schema = parameter.get("schema", {})
        if schema.get("type") != "string" or set(schema) & {"pattern", "enum", "maxLength"}:
            return True
    return False


def _cases() -> list[tuple[str, str, GenerationMode]]:
    """(method, path, mode) for every operation of the document, read from the app
    in-process at collection (without the shell's settings); invalid input wherever the
    operation has input that can be invalid."""
    with pytest.MonkeyPatch.context() as mp:
        isolate_settings(mp)
        document = create_app(Settings(_env_file=None, embedded_services=False)).openapi()
    cases = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            cases.append((method.upper(), path, GenerationMode.POSITIVE))
            if _constrained(operation):
                cases.append((method.upper(), path, GenerationMode.NEGATIVE))
    return cases


@pytest.mark.parametrize(("method", "path", "mode"), _cases())
def test_every_route_answers_as_documented(
    api_schema: BaseOpenAPISchema, manager_url: str, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode, headers=AUTH))
    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case: Case[Any]) -> None:
        case.call_and_validate(base_url=manager_url, timeout=10)

    check()
