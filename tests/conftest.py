import os

import pytest

from tests.dist import WorldPool

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def world_pool():
    pool = WorldPool()
    yield pool
    pool.close()


@pytest.fixture
def world(request, world_pool):
    """The reusable world of the size the test's ``world_size`` marker states."""
    marker = request.node.get_closest_marker("world_size")
    if marker is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses the `world` fixture without "
                                "@pytest.mark.world_size(n)")
    env = marker.kwargs.get("env", {})
    return world_pool.get(marker.args[0], **env)
