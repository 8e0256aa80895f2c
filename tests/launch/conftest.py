import pytest

from launch.net import netns


@pytest.fixture(scope="session")
def namespaces():
    """Skip (with the machine's reason) where network namespaces cannot be created."""
    ok, reason = netns.available()
    if not ok:
        pytest.skip(f"network namespace tests skipped: {reason}")
