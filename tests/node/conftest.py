"""The real node for the whole session: started once (a minute or two), the manager installed
on it once; the tests in tests/node/ run in file order on that one installation, each step
of a node's life after the one before."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.support.node import Node
from tests.support.node_world import NodeWorld, installed


def _interrupted(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: the teardown runs


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The node; its teardown runs on SIGTERM too (a kill leaves what the next start sweeps)."""
    previous = signal.signal(signal.SIGTERM, _interrupted)
    real = Node.start(tmp_path_factory.mktemp("node-logs"))
    try:
        yield real
    finally:
        real.stop()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def world(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeWorld]:
    with installed(node, tmp_path_factory.mktemp("node-world")) as found:
        yield found
