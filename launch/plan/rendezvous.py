"""Small messages under gloo's receiver-driven rendezvous: a tensor's later pieces, the engines'
cross-stage all-reduces in the optimizer step, DeepSpeed's loss broadcast.

gloo's TCP pair (``gloo/transport/tcp/pair.cc``: "sends cannot execute until the remote side is ready
to receive") moves an unbound buffer only after the receiver's NOTIFY_RECV_READY has reached the
sender. A receive posted at ``r`` therefore lets data leave at ``r + n`` at the earliest (``n``: the
notice's one-way trip), and a message of a few bytes arrives one one-way latency ``h`` after it left:

    sent = max(send posted, recv posted + n),   arrived = sent + h            (:func:`tiny_message`)

So a receive posted after the matching send costs a full round trip. Measured in the main job's
``--atlas`` rows (2026-12-02, 40 ms RTT): the 4-byte second tensor of every pipeline transfer,
received once the 1 MiB activation had arrived, took 41-42 ms on the receiver (median of 16).

**Cross-stage all-reduces** (:func:`pipe_all_reduce`). With more than one stage, DeepSpeed all-reduces
one number over each replica's pipeline (``mpu.get_model_parallel_group()``: the pipe x model ranks
of one data index) in the optimizer step: ZeRO-1/2 twice (overflow flag, gradient norm), without ZeRO
once when ``gradient_clipping`` > 0 (``clip_grad_norm_``); Megatron-LM once when ``clip_grad`` > 0
(the norm over its model-parallel group). gloo's ring all-reduce of one element has one non-empty
chunk, owned by group rank 0 (stage 0): a reduce-scatter step in which each other stage sends its
value to stage 0, then an all-gather step in which stage 0 sends the sum back, each a tiny message:

    stage j > 0:  sent_j = max(a_j, a_0 + n_j),        stage 0 holds it at  r_j = sent_j + h_j
    stage 0:      back_j = max(max(a_0, r_*), sent_j + n_j)   (j posted the all-gather recv at sent_j)
    done: stage 0 at max(a_0, r_*, back_*), stage j at back_j + h_j

(``a``: when each stage entered it; ``h_j``, ``n_j``: stage j to stage 0, summed over the boundaries
between them). Checked against the same trace: stage 0 entering last at a_0 left at a_0 + 2h
(42.7 ms measured, h = 21 ms from the connections' minrtt), stage 1 at a_0 + 3h (62.9 ms). For two
stages this is gloo's ring; for more it is a star on stage 0 (the ring's hops through the middle
stages are not modelled: the latency terms are the same sums, the waits differ).
"""

from __future__ import annotations

from collections.abc import Sequence


def tiny_message(send_posted: float, recv_posted: float, one_way: float,
                 notice: float) -> tuple[float, float]:
    """(sent, arrived) of a message of a few bytes: it leaves once the sender is in its call and the
    receiver's notice (``notice`` seconds one way) has reached it, and lands ``one_way`` later.
    ``notice`` 0 (not modelled, the planner's engines): eager, it leaves when the send is posted."""
    if one_way < 0 or notice < 0:
        raise ValueError(f"tiny_message: one_way={one_way} and notice={notice} must be >= 0")
    sent = max(send_posted, recv_posted + notice) if notice > 0 else send_posted
    return sent, sent + one_way


def pipe_all_reduce(arrive: Sequence[float], one_way: Sequence[float],
                    notice: Sequence[float]) -> list[float]:
    """When each stage leaves an all-reduce of one number over the pipeline (module docstring):
    ``arrive[s]`` when stage s entered it, ``one_way[s]`` / ``notice[s]`` from stage s to stage 0
    (index 0 unused)."""
    S = len(arrive)
    if S < 1 or len(one_way) != S or len(notice) != S:
        raise ValueError(f"pipe_all_reduce: arrive ({S}), one_way ({len(one_way)}) and notice "
                         f"({len(notice)}) need one entry per stage, >= 1 stage")
    sent, held = [0.0] * S, arrive[0]
    for j in range(1, S):        # reduce-scatter: each stage's value reaches stage 0
        sent[j], at_owner = tiny_message(arrive[j], arrive[0], one_way[j], notice[j])
        held = max(held, at_owner)
    done, owner = [0.0] * S, held
    for j in range(1, S):        # all-gather: stage 0 sends the sum to each (j's recv posted at sent[j])
        back, done[j] = tiny_message(held, sent[j], one_way[j], notice[j])
        owner = max(owner, back)
    done[0] = owner
    return done
