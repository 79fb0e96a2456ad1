"""What a component does not use costs no memory: its client library is never imported.

kubernetes-asyncio alone is some 37 MiB of RSS and httpx with its client a few more, so a
node with PostgreSQL and NATS but no cluster must not import the one, and a worker that
has run no `http` job not the other. Each case runs in a fresh interpreter, whose
`sys.modules` says what was imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def modules_after(code: str, cwd: Path) -> set[str]:
    script = textwrap.dedent(code) + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,  # no .env of the checkout
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_fingerprint_without_a_cluster_does_not_import_the_cluster_client(
    tmp_path: Path,
) -> None:
    modules = modules_after(
        f"""
        import asyncio
        from contextlib import AsyncExitStack
        from app.services.runtime import build_runtime, deps_of
        from app.settings import Settings

        settings = Settings(data_dir={str(tmp_path)!r}, embedded_services=False)
        rt = build_runtime(settings)

        async def fingerprint():
            async with AsyncExitStack() as stack:
                return (await deps_of(rt, stack).profile()()).hardware

        hardware = asyncio.run(fingerprint())
        assert hardware and "k3s_version" not in hardware, hardware
        """,
        tmp_path,
    )
    assert "kubernetes_asyncio" not in modules
    assert "app.adapters.kube" not in modules


def test_deciding_a_worker_imports_no_nats_client(tmp_path: Path) -> None:
    """The plan is made at build time, before anything starts: a worker planned on must
    not load nats-py (and aiohttp) into a process that may never start it."""
    modules = modules_after(
        f"""
        from app.services.features import decide
        from app.services.features.worker import WORKER
        from app.settings import Settings

        settings = Settings(data_dir={str(tmp_path)!r}, nats_url="nats://127.0.0.1:1")
        assert decide(settings, can_sign=False).of(WORKER).enabled
        """,
        tmp_path,
    )
    assert "nats" not in modules
    assert "app.adapters.bus" not in modules


def test_a_manager_with_everything_off_imports_no_database_or_queue_client(
    tmp_path: Path,
) -> None:
    """Started with every component that can be off switched off: no asyncpg, no nats."""
    modules = modules_after(
        f"""
        import asyncio
        from contextlib import AsyncExitStack
        from app.services.runtime import build_runtime, start_runtime
        from app.settings import Settings

        settings = Settings(
            data_dir={str(tmp_path)!r}, embedded_services=False, sync_enabled=False,
            self_update_enabled=False, report_enabled=False,
        )

        async def main() -> None:
            runtime = build_runtime(settings)
            async with AsyncExitStack() as stack:
                await start_runtime(runtime, stack)
                assert runtime.started

        asyncio.run(main())
        """,
        tmp_path,
    )
    assert {"asyncpg", "nats", "app.adapters.registry", "app.adapters.bus"}.isdisjoint(modules)


def test_the_workload_http_client_is_made_on_the_first_call(tmp_path: Path) -> None:
    modules = modules_after(
        """
        import asyncio
        from app.adapters.workload_http import WorkloadHttp, WorkloadHttpError
        from app.domain.http_targets import AllowedTargets

        async def main() -> None:
            http = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.namespace("workloads"))
            http.check_url("http://api.workloads.svc/jobs")
            try:  # refused before any request, so before any client
                await http.post("http://example.com/", {}, headers={})
            except WorkloadHttpError:
                pass
            else:
                raise AssertionError("an outside host was allowed")
            await http.aclose()

        asyncio.run(main())
        """,
        tmp_path,
    )
    assert "httpx" not in modules


async def test_a_closed_workload_http_refuses_calls_as_a_closed_client_does() -> None:
    from app.adapters.workload_http import WorkloadHttp
    from app.domain.http_targets import AllowedTargets

    http = WorkloadHttp(timeout=1.0, allowed_targets=AllowedTargets.namespace("workloads"))
    await http.aclose()
    try:
        await http.post("http://127.0.0.1:9/", {}, headers={})
    except RuntimeError as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("a closed client sent a request")


def test_sentry_does_not_import_botocore_to_look_for_it(tmp_path: Path) -> None:
    """botocore (the S3 version file's library, some 5 MiB) is installed; Sentry's
    auto-enabled integrations would import it at start just to find out."""
    modules = modules_after(
        """
        from app.adapters import sentry

        sentry.init(dsn="http://key@127.0.0.1:9/1", environment="test", traces_sample_rate=0)
        """,
        tmp_path,
    )
    assert "sentry_sdk" in modules
    assert "botocore" not in modules
