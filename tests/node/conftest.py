"""The real node for the whole session: started once (a minute or two), the manager installed
on it once; the tests in tests/node/ run in file order on that one installation, each step
of a node's life after the one before."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.node import Node
from tests.support.node_world import NodeWorld, installed


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    real = Node.start(tmp_path_factory.mktemp("node-logs"))
    try:
        yield real
    finally:
        real.stop()


@pytest.fixture(scope="session")
def world(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeWorld]:
    with installed(node, tmp_path_factory.mktemp("node-world")) as found:
        yield found
