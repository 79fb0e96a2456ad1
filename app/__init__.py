"""Node workload manager: keeps a node's workloads healthy, reported and in sync."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("workload-manager")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
