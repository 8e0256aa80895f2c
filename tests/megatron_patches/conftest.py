"""The ``big_world`` marker: tests on 16 ranks, more than CI runs; deselected unless COMMWEAVE_BIG_WORLD=1."""

import os


def pytest_configure(config):
    config.addinivalue_line("markers",
                            "big_world: needs more than 8 ranks; runs only with COMMWEAVE_BIG_WORLD=1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("COMMWEAVE_BIG_WORLD") == "1":
        return
    big = [item for item in items if item.get_closest_marker("big_world")]
    if big:
        config.hook.pytest_deselected(items=big)
        items[:] = [item for item in items if not item.get_closest_marker("big_world")]
