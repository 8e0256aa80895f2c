"""pytest glue for multi-rank tests: a pool of reusable worlds, selected by ``@pytest.mark.world_size(n)``.

Usage (the case function must live at module level so the ranks can import it)::

    def _case(n):                       # runs on every rank, torch.distributed initialised (gloo)
        ...
        return value

    @pytest.mark.world_size(4)
    @pytest.mark.parametrize("n", [1, 2])
    def test_something(world, n):
        results = world.run(_case, n)    # one value per rank; a rank's exception fails the test

Worlds are started once and reused by every test that asks for the same size; the pool keeps at most
``MAX_LIVE_RANKS`` ranks alive, closing the least recently used world when a new size needs room.
A failing or hanging call kills its world (commweave.world), and the next test starts a fresh one.
"""

from __future__ import annotations

import os
from collections import OrderedDict

from commweave.world import World

# imported once by the fork server every rank forks from (commweave.world.World's preload): a world of 8
# ranks would otherwise import megatron-core 8 times on 2 cores; a world that sets DS_ACCELERATOR is spawned
PRELOAD = ("torch", "torch.distributed", "deepspeed", "megatron.core")
MAX_LIVE_RANKS = int(os.environ.get("COMMWEAVE_TEST_MAX_LIVE_RANKS", "12"))
CALL_TIMEOUT = float(os.environ.get("COMMWEAVE_TEST_TIMEOUT", "240"))


class WorldPool:
    def __init__(self) -> None:
        self._worlds: OrderedDict[tuple, World] = OrderedDict()

    def get(self, world_size: int, **env) -> World:
        key = (world_size, tuple(sorted(env.items())))
        world = self._worlds.pop(key, None)
        if world is None:
            world = World(world_size, env=env, timeout=CALL_TIMEOUT,
                          preload=() if "DS_ACCELERATOR" in env else PRELOAD)
        self._worlds[key] = world
        while sum(w.world_size for w in self._worlds.values()) > max(MAX_LIVE_RANKS, world_size):
            _, old = self._worlds.popitem(last=False)
            old.close()
        return world

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()
        self._worlds.clear()
