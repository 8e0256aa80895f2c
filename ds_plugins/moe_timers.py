"""DeepSpeed's MoE timers, kept by ParmMoE: what ``wall_clock_breakdown`` reports.

With ``"wall_clock_breakdown": true`` the engine switches on the timers of every ``TopKGate`` and
``MOELayer`` it finds (a ParmMoE holds DeepSpeed's own, ``layer.gate`` and ``layer.deepspeed_moe``) and, at
each step, logs ``time (ms) | fwd: .. (fwd_moe: .., 1st_a2a: .., 2nd_a2a: .., top_k: ..)`` from their
attributes (``DeepSpeedEngine.print_forward_breakdown``). DeepSpeed's ``MOELayer.forward`` sets them; a
ParmMoE runs its own forward, so it sets them here, with the same timers and the same meaning:

    'moe'       time_moe         the whole layer forward
    'topk_gate' gate_time        routing (the gate's logits, top-k, capacity, locations)
    '1st_a2a'   time_falltoall   the dispatch exchange (all-to-all over EP and, in S1/S2, the overlapped
                                 all-gather over ESP: one chunked pipeline, timed as a whole)
    '2nd_a2a'   time_salltoall   the combine exchange (reduce-scatter over ESP, all-to-all over EP and,
                                 in S2, the all-gather over MP)

Like DeepSpeed's, each attribute is the timer's total since it was created (``elapsed(reset=False)``),
forward only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from deepspeed.moe.sharded_moe import FIRST_ALLTOALL_TIMER, MOE_TIMER, SECOND_ALLTOALL_TIMER, TOPK_GATE_TIMER

ATTRIBUTES = {MOE_TIMER: "time_moe", FIRST_ALLTOALL_TIMER: "time_falltoall",
              SECOND_ALLTOALL_TIMER: "time_salltoall", TOPK_GATE_TIMER: "gate_time"}


@contextmanager
def timed(owner, name: str) -> Iterator[None]:
    """Time the block with ``owner``'s timer ``name`` when the engine switched its timers on; ``owner`` is
    a ``MOELayer`` or a ``TopKGate``."""
    if not getattr(owner, "wall_clock_breakdown", False):
        yield
        return
    timer = owner.timers(name)
    timer.start()
    try:
        yield
    finally:
        timer.stop()
        setattr(owner, ATTRIBUTES[name], timer.elapsed(reset=False))
