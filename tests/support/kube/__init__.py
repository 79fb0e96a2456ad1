"""In-process Kubernetes API server emulator, split into small modules.

Import it through `tests.support.kube_emulator`; the behaviours it honours are listed in
docs/kube-emulator.md.
"""

from .emulator import KubeEmulator
from .faults import RecordedRequest

__all__ = ["KubeEmulator", "RecordedRequest"]
