"""kubernetes-asyncio, loaded in part: what the adapter uses, not every generated class.

`import kubernetes_asyncio` runs the package's `__init__`, which imports `client`, whose
`__init__` imports every API class and every one of ~770 model classes: 63 MiB in a
fresh interpreter here, the largest share of the manager's memory (docs/architecture.md).
The adapter uses the API client, its configuration, three API classes and two models:
31 MiB, 23 of them aiohttp, which nats-py loads anyway.

`install()` puts lazy stand-ins for `kubernetes_asyncio`, `kubernetes_asyncio.client`,
`.client.api` and `.client.models` into `sys.modules` before anything imports them. Each
is the real package's directory (its submodules import as usual) with a module
`__getattr__` that imports a name's own module the first time it is asked for, from the
map the real `__init__` declares (`from kubernetes_asyncio.client.x import Name`, read as
text, not run). So `client.AppsV1Api`, `from kubernetes_asyncio.client import
Configuration` and the API client's `getattr(models, "V1Deployment")` all give the real
classes. When the package is already imported, or its `__init__` files do not read as
expected (another version's layout), nothing is installed and the real import runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import sys
import types
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ROOT = "kubernetes_asyncio"
PACKAGES = (ROOT, f"{ROOT}.client", f"{ROOT}.client.api", f"{ROOT}.client.models")
_EXPORT = re.compile(r"^from (kubernetes_asyncio(?:\.\w+)+) import (\w+)$", re.MULTILINE)


def exported(init_file: str | Path) -> dict[str, str]:
    """Name -> module, from a generated `__init__.py`'s `from <module> import <Name>` lines."""
    return {name: module for module, name in _EXPORT.findall(Path(init_file).read_text())}


def install() -> bool:
    """Lazy stand-ins for the packages (see the module's doc); False if none was put in."""
    if ROOT in sys.modules:
        return False
    spec = importlib.util.find_spec(ROOT)
    if spec is None or spec.origin is None:
        return False
    base = Path(spec.origin).parent
    try:
        maps = {name: exported(_init(base, name)) for name in PACKAGES[1:]}
    except OSError as exc:
        log.warning("kubernetes-asyncio loaded whole: %s", exc)
        return False
    if not all(maps.values()):
        log.warning("kubernetes-asyncio loaded whole: its __init__ files do not read as expected")
        return False
    maps[ROOT] = {}
    for name in PACKAGES:
        sys.modules[name] = _lazy(name, base, maps[name])
    return True


def _init(base: Path, package: str) -> Path:
    return base.joinpath(*package.split(".")[1:], "__init__.py")


def _lazy(name: str, base: Path, names: dict[str, str]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(_init(base, name))
    module.__path__ = [str(Path(module.__file__).parent)]
    module.__package__ = name
    module.__all__ = sorted(names)  # type: ignore[attr-defined]

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        where = names.get(attr)
        try:
            value = (
                getattr(importlib.import_module(where), attr)
                if where is not None
                else importlib.import_module(f"{name}.{attr}")  # a submodule: rest, config...
            )
        except ModuleNotFoundError as exc:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from exc
        setattr(module, attr, value)
        return value

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module
