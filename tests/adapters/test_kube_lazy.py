"""kubernetes-asyncio, imported in part: each test runs a fresh interpreter (the package is
imported once per process, and this suite imports it whole elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from standins.control_plane import ROOT


def fresh(code: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_the_adapter_loads_only_what_it_uses() -> None:
    seen = fresh(
        "import sys, json, app.adapters.kube;"
        "print(json.dumps({'modules': sum(k.startswith('kubernetes_asyncio.client.models.')"
        " for k in sys.modules)}))"
    )
    assert isinstance(seen["modules"], int) and seen["modules"] < 20, (
        "every model class was imported (the whole package: ~60 MiB)"
    )


@pytest.mark.parametrize("package", ["client", "client.models", "client.api"])
def test_every_name_the_package_exports_resolves_to_the_real_class(package: str) -> None:
    """The lazy package hands out the same objects as the real one, for all of its names."""
    code = f"""
import importlib, json, sys
import app.adapters.kube_lazy as lazy
lazy.install()
lazy_pkg = importlib.import_module('kubernetes_asyncio.{package}')
names = sorted(lazy.exported(lazy_pkg.__file__))
found = {{n: (lambda o: o.__module__ + '.' + o.__qualname__)(getattr(lazy_pkg, n)) for n in names}}
print(json.dumps(found))
"""
    real = """
import importlib, json
real = importlib.import_module('kubernetes_asyncio.PKG')
print(json.dumps({n: getattr(real, n).__module__ + '.' + getattr(real, n).__qualname__
                  for n in real.__all__ if not isinstance(getattr(real, n), type(json))}))
""".replace("PKG", package)
    lazy_names, real_names = fresh(code), fresh(real)
    assert len(real_names) > 50
    assert {k: v for k, v in lazy_names.items() if k in real_names} == real_names


def test_a_deployment_answer_deserializes_into_its_model() -> None:
    """The API client turns answers into models by name (getattr on the models package)."""
    seen = fresh(
        "import asyncio, json, app.adapters.kube as k\n"
        "from kubernetes_asyncio import client\n"
        "async def main():\n"
        "    async with client.ApiClient(client.Configuration()) as api:\n"
        "        obj = api._ApiClient__deserialize({'metadata': {'name': 'web'},"
        " 'spec': {'selector': {}, 'template': {}}}, 'V1Deployment')\n"
        "    print(json.dumps({'type': type(obj).__name__, 'name': obj.metadata.name}))\n"
        "asyncio.run(main())"
    )
    assert seen == {"type": "V1Deployment", "name": "web"}
