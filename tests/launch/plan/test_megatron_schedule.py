"""Megatron-LM's schedule in the simulator: its call order against megatron-core's own
``forward_backward_pipelining_without_interleaving`` (run in one process with its p2p and compute
recorded), and its combined send+recv calls against a hand-derived timeline."""

from types import SimpleNamespace

import pytest
import torch

from launch.plan.megatron_schedule import train_schedule
from launch.plan.simulate import Job, Route, simulate


class _Recorder:
    """megatron-core's P2PCommunicator, recording each call with the micro-batches it moves: a send
    moves the last computed micro-batch, a receive the next one of its kind (calls at a pipeline end
    with no neighbour move nothing, as megatron-core's own return None there)."""

    def __init__(self, stage: int, stages: int) -> None:
        self.pp_group = SimpleNamespace(size=lambda: stages, rank=lambda: stage)
        self.config = None
        self.calls: list[tuple] = []
        self.received = {"act": 0, "grad": 0}
        self.last = {"F": -1, "B": -1}

    def _p2p(self, *channels) -> None:
        kept = []
        for kind, end in channels:
            if end:
                continue
            if kind.startswith("recv"):
                what = kind[5:]
                kept.append((kind, self.received[what]))
                self.received[what] += 1
            else:
                kept.append((kind, self.last["F" if kind == "send_act" else "B"]))
        if kept:
            self.calls.append(("p2p", tuple(sorted(kept))))
        return torch.zeros(1)

    def recv_forward(self, shapes, first):
        return self._p2p(("recv_act", first))

    def send_forward(self, tensor, last):
        self._p2p(("send_act", last))

    def recv_backward(self, shapes, last):
        return self._p2p(("recv_grad", last))

    def send_backward(self, tensor, first):
        self._p2p(("send_grad", first))

    def send_forward_recv_backward(self, tensor, shapes, last):
        return self._p2p(("send_act", last), ("recv_grad", last))

    def send_backward_recv_forward(self, tensor, shapes, first):
        return self._p2p(("send_grad", first), ("recv_act", first))


def _megatron_order(stage: int, stages: int, micro_batches: int, monkeypatch) -> list[tuple]:
    from megatron.core.pipeline_parallel import schedules

    comm = _Recorder(stage, stages)

    def forward_step(*args, current_microbatch, **kw):
        comm.last["F"] = current_microbatch
        comm.calls.append(("F", current_microbatch))
        return [torch.zeros(1)], 0

    def backward_step(*args):
        comm.last["B"] += 1
        comm.calls.append(("B", comm.last["B"]))
        return torch.zeros(1)

    config = SimpleNamespace(overlap_p2p_comm=False, finalize_model_grads_func=None, timers=None,
                             no_sync_func=None, num_microbatches_with_partial_activation_checkpoints=None,
                             grad_sync_func=None, deallocate_pipeline_outputs=False,
                             fine_grained_activation_offloading=False, calculate_per_token_loss=False)
    for name, value in {"forward_step": forward_step, "backward_step": backward_step,
                        "get_model_config": lambda model: config, "get_model_type": lambda model: None,
                        "get_tensor_shapes": lambda **kw: [()],
                        "deallocate_output_tensor": lambda *a: None}.items():
        monkeypatch.setattr(schedules, name, value)
    monkeypatch.setattr(schedules.torch, "zeros", lambda *a, device=None, **kw: torch.tensor(0))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)   # ranks from comm.pp_group
    groups = SimpleNamespace(tp=None, cp=SimpleNamespace(size=lambda: 1), embd=None, pos_embd=None,
                             pp=comm.pp_group, dp_cp=None)
    schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=None, data_iterator=iter(()), model=torch.nn.Module(),
        num_microbatches=micro_batches, seq_length=1, micro_batch_size=1, p2p_communicator=comm,
        pg_collection=groups)
    return [*comm.calls, ("step", -1)]


@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 4), (3, 2), (4, 6), (5, 8)])
def test_call_order_is_megatron_cores(stages, micro_batches, monkeypatch):
    for s in range(stages):
        ours = [(k, tuple(sorted(m)) if k == "p2p" else m)
                for k, m in train_schedule(s, stages, micro_batches)]
        assert ours == _megatron_order(s, stages, micro_batches, monkeypatch), (s, stages, micro_batches)


def test_hand_derived_two_stage_timeline():
    """t_f = 1, t_b = 2, a transfer takes 1 and lands 0.5 later, 2 micro-batches. S0 (one warm-up
    micro-batch): F0 0-1, send_forward(act 0) 1..2 (S1 waits in recv_forward since 0; lands 2.5), F1
    2-3, then send_forward_recv_backward(act 1, grad 0) posted at 3. S1: F0 2.5-3.5, B0 3.5-5.5, then
    send_backward_recv_forward(grad 0, act 1) at 5.5: both transfers run at once, 5.5..6.5, landing at
    7 (DeepSpeed's engine would run them one after the other). S0 B0 7-9, then recv_backward(grad 1);
    S1 F1 7-8, B1 8-10, send_backward(grad 1) 10..11, lands 11.5; S0 B1 11.5-13.5; no loss broadcast."""
    route = Route(0.5, 1.0)
    job = Job(((1.0,), (1.0,)), ((2.0,), (2.0,)), ((route,),), 1.0, 2, "megatron", "spatial")
    r = simulate(job)
    assert r.iteration == pytest.approx(13.5)
    got = {(t.fwd, t.m): [t.started, t.done, t.arrives] for t in r.transfers}
    want = {(True, 0): [1, 2, 2.5], (True, 1): [5.5, 6.5, 7], (False, 0): [5.5, 6.5, 7],
            (False, 1): [10, 11, 11.5]}
    assert sorted(got) == sorted(want)
    for key, times in want.items():
        assert got[key] == pytest.approx(times)
