"""Two stage services of a pipelined inference model in the test's own process, over a real loopback
link: what the tests of back-pressure (test_pipelined) and of sleeping stages (test_sleeping_chunks)
drive window by window, without a rank or a service process."""

from __future__ import annotations

import array
import contextlib
import os
import queue
import socket
import threading
import time

from launch.bubbletea.pipelined import AHEAD, pipeline_setup
from launch.bubbletea.service import Service


class StagePair:
    """Stage j's :class:`Service` in ``services[j]``: its out-messages land in ``outs[j]``, what its link
    brings (the previous stage's rows, the next stage's "finished") in ``boxes[j]``."""

    def __init__(self, specs, chunk_tokens: int, key: bytes, ahead: int | None = AHEAD) -> None:
        self.boxes, self.outs = [queue.Queue(), queue.Queue()], [[], []]
        self.words = [memoryview(array.array("d", [0.0, 0.0])) for _ in range(2)]
        setups = [{"model": spec, "chunk_tokens": chunk_tokens, "guard": 0.0, "cost": (1e-4, 0.0, 0.0),
                   **pipeline_setup(j, 2, "127.0.0.1", key, ahead=ahead)} for j, spec in enumerate(specs)]
        self.services = [Service(lambda *m, j=j: self.outs[j].append(m), self.words[j], setups[j],
                                 post=self.boxes[j].put) for j in range(2)]
        accept = threading.Thread(target=self.services[1].handle, args=(("link", "accept"),))
        accept.start()
        self.services[0].handle(("link", self.services[1].address))
        accept.join()

    def take(self, j: int, n: int = 0, timeout: float = 30.0) -> list:
        """What stage j's link brought: at least ``n`` messages (waiting up to ``timeout`` s for them),
        and whatever else is there."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                got.append(self.boxes[j].get(timeout=0.01))
        while not self.boxes[j].empty():
            got.append(self.boxes[j].get())
        return got

    def window(self, j: int, tag: int, messages=()) -> None:
        """Stage j handles ``messages`` (from :meth:`take`), then plans and runs one long window."""
        for msg in messages:
            self.services[j].handle(msg)
        self.services[j].handle(("windows", [(tag, 0.0, 60.0)]))
        self.words[j][1], self.words[j][0] = time.perf_counter() + 60.0, float(tag)
        self.services[j].handle(("open", tag, float(tag)))

    def done(self, j: int) -> list:
        return [m[1] for m in self.outs[j] if m[0] == "done"]

    def close(self) -> None:
        """Shut the link down under its readers (they see EOF and end), then close everything."""
        first, second = self.services
        socket.socket(fileno=os.dup(first.down.fileno())).shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 30
        while any("_forward" in t.name for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
        for conn in (first.down, second.up, second.listener):
            conn.close()
