"""Activation checkpointing: a recomputed forward runs the schedule its forward ran.

Under activation checkpointing (``torch.utils.checkpoint``, reentrant or not, ``deepspeed.checkpointing``)
the backward calls the layer's forward a second time, the *recompute*, and differentiates that call. Its
inputs, RNG state and mode are the forward's, so a schedule that is a function of the call alone (a fixed
one; "auto" in drop mode, a function of the agreed shape) is the forward's again. But "auto" without
dropping picks from the previous forward's headers (ds_plugins.schedules.sync_free), and between a
forward and its recompute other forwards of the layer may have run (the next micro-batch's, the
recompute itself): the recompute could run another schedule. Every schedule computes the same function,
but not the same autograd graph: the non-reentrant checkpoint compares the tensors the two calls save
and raises ``CheckpointError`` (S1 saves [S/N, M] blocks where S2 saves [S, M] ones); the reentrant ones
would differentiate another graph than the forward's (tests/ds_plugins/test_recompute.py).

So every forward outside a backward records its pick, and a forward inside one (a recompute: autograd's
engine is running, ``torch._C._current_graph_task_id() != -1``, the test DeepSpeed's ZeRO-3 uses for the
same purpose) takes the most recent unconsumed record of the same key and consumes it. Most recent first
is the order in which a backward recomputes the forwards it differentiates: one forward per micro-batch
(gradient accumulation: forward, then its backward), and a layer called several times in one forward,
each call checkpointed on its own (the backward recomputes the last first). The key is what the
pick depends on besides history and what every rank of the layer holds alike: the mode and the dtype,
and in drop mode the token count (the headers check it equal on every rank; without dropping the ranks'
counts may differ, so they are not in the key). Every rank of the layer runs the same forwards and
recomputes in the same order (their collectives meet), so every rank replays the same record: the
schedules still agree across ranks, and the headers' schedule word checks it.

Not covered exactly: forwards recomputed oldest first with different picks under one key (a pipeline
schedule that runs several micro-batches' forwards before their backwards, with token counts that
change between them and no dropping), and a forward in training mode that is never recomputed (no
backward) between a checkpointed forward and its recompute. There the recompute runs the pick of another
forward: still a schedule every rank agrees on, the same function, the non-reentrant checkpoint's
``CheckpointError`` where the saved tensors differ.
"""

from __future__ import annotations

from collections import deque

import torch

DEPTH = 64
"""Records kept per layer: the forwards whose recomputes may still come. Older ones are dropped (a layer
trained without checkpointing records every forward and recomputes none)."""


def recomputing() -> bool:
    """Whether this call runs inside a backward pass: under activation checkpointing, a recompute."""
    return torch._C._current_graph_task_id() != -1


class Picks:
    """The schedules of a layer's recent forwards, for their recomputes (module docstring)."""

    def __init__(self) -> None:
        self._records: deque[tuple[tuple, str]] = deque(maxlen=DEPTH)

    def schedule(self, key: tuple, pick) -> str:
        """The schedule for this call: ``pick()`` in a forward (recorded under ``key``), the most recent
        unconsumed record of ``key`` in a recompute (consumed), ``pick()`` where there is none."""
        if recomputing():
            for i in range(len(self._records) - 1, -1, -1):
                if self._records[i][0] == key:
                    schedule = self._records[i][1]
                    del self._records[i]
                    return schedule
            return pick()
        schedule = pick()
        if not torch.is_inference_mode_enabled():      # never recomputed: nothing to record
            self._records.append((key, schedule))
        return schedule
