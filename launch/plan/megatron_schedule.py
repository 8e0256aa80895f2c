"""Megatron-LM's non-interleaved 1F1B as it really runs: the order of its compute and p2p calls.

``Job(schedule="megatron")`` makes :func:`launch.plan.simulate.simulate` run the blocking executor of
:mod:`launch.plan.deepspeed_schedule` on this order. megatron-core's
``forward_backward_pipelining_without_interleaving`` (0.16; compared with it call by call in
tests/launch/plan/test_megatron_schedule.py), on stage s of S with M micro-batches and
w = min(S − s − 1, M) warm-up micro-batches:

    warm-up   i < w:        recv_forward(i), F(i), send_forward(i)
              if M > w:     recv_forward(w)
    steady    i < M − w:    F(w + i), send_forward_recv_backward(act w + i, grad i), B(i),
                            send_backward(i) on the last i,
                            else send_backward_recv_forward(grad i, act w + i + 1)
    cool-down i ≥ M − w:    recv_backward(i), B(i), send_backward(i)
    then finalize_model_grads (the DP gradient all-reduce) and the optimizer step ("step").

A call on a pipeline end that has no neighbour (recv_forward on the first stage, a send_forward on the
last, ...) moves nothing and is left out. A combined call posts its send and its receive together
(``torch.distributed.isend``/``irecv`` or ``batch_isend_irecv``) and waits for both
(``wait_on_reqs``: the non-interleaved schedule refuses ``overlap_p2p_comm``), so unlike DeepSpeed's
engine a Megatron rank sends and receives at once, but every call still blocks before the next
compute. Each item is ("F" | "B", micro-batch), ("step", -1) or ("p2p", ((channel, micro-batch), ...))
with channels send_act / recv_act / send_grad / recv_grad, as :func:`launch.plan.deepspeed_schedule.run`
takes them.
"""

from __future__ import annotations


def train_schedule(stage: int, stages: int, micro_batches: int) -> list[tuple]:
    """Megatron's call order on ``stage`` (see the module docstring)."""
    S, s, M = stages, stage, micro_batches
    first, last = s == 0, s == S - 1
    warm = min(S - s - 1, M)
    out: list[tuple] = []

    def p2p(*channels: tuple[str, int]) -> None:
        kept = tuple(c for c in channels if not ((first and c[0] in ("recv_act", "send_grad"))
                                                  or (last and c[0] in ("send_act", "recv_grad"))))
        if kept:
            out.append(("p2p", kept))

    for i in range(warm):
        p2p(("recv_act", i))
        out.append(("F", i))
        p2p(("send_act", i))
    if warm < M:
        p2p(("recv_act", warm))
    steady = M - warm
    for i in range(steady):
        out.append(("F", warm + i))
        p2p(("send_act", warm + i), ("recv_grad", i))
        out.append(("B", i))
        if i == steady - 1:
            p2p(("send_grad", i))
        else:
            p2p(("send_grad", i), ("recv_act", warm + i + 1))
    for i in range(steady, M):
        p2p(("recv_grad", i))
        out.append(("B", i))
        p2p(("send_grad", i))
    out.append(("step", -1))
    return out
