"""A recompute under activation checkpointing runs its forward's schedule (ds_plugins.recompute), on 4 gloo
ranks (tp 2 x ep 2, ESP 2), under reentrant and non-reentrant ``torch.utils.checkpoint`` and
``deepspeed.checkpointing``.

"auto" with a selector whose pick changes between a forward and its recompute, two ways:
- "flip": a new pick at every call (deepspeed, s1, s2, deepspeed, ...), so a recompute that asked again
  would get another schedule than its forward; drop mode, the token count changing between micro-batches;
- "lagged": the real lagged pick of no-drop "auto" (from the previous forward's largest token count,
  ds_plugins.schedules.sync_free) through a rule that maps counts to schedules, the two MP groups holding
  different counts that change between micro-batches, so the count at a recompute (the headers of its own
  forward) differs from the one its forward picked from.
Each micro-batch runs forward + backward; one of them calls the layer twice, each call checkpointed on its
own (the backward recomputes the second call first). Checked per call: the schedule each forward and its
recompute ran (the oracle: the forward's pick, in the order the backward recomputes), and the output, the
input gradient and the gate-weight gradient against DeepSpeed's MoE (all experts in one process, no
checkpointing) on the same weights and inputs. Before ds_plugins.recompute the non-reentrant checkpoint
raised ``CheckpointError`` (S1 saved [12, 8] blocks where S2 saved [8, 8] ones) and the reentrant ones
differentiated a graph of another schedule.
"""

from __future__ import annotations

import itertools

import deepspeed
import pytest
import torch
import torch.distributed as dist

from ds_plugins import ParmMoE, recompute, schedules, selector
from tests.ds_plugins.deepspeed_oracle import LocalOracle, Weights, load_parm, mlp, use_layout
from tests.ds_plugins.test_eval import _checkpointed

M, H, E = 8, 16, 8
GATE = dict(k=2, capacity_factor=2.0, eval_capacity_factor=1.0, min_capacity=0)
MODES = ("torch-reentrant", "torch-non-reentrant", "deepspeed")
# token counts per micro-batch for the MP groups {0, 1} and {2, 3} (equal in drop mode); a pair of pairs
# is one micro-batch calling the layer twice
DROP_BATCHES = ((24, 24), (16, 16), ((20, 20), (12, 12)), (24, 24))
NO_DROP_BATCHES = ((24, 19), (17, 22), ((20, 23), (12, 26)), (24, 24))


def _lagged(tokens: int) -> str:
    return "s1" if tokens >= 24 else "s2" if tokens >= 20 else "deepspeed"


class _Log:
    """Patches the selector's choice with ``rule`` and logs every schedule run: (name, in a recompute)."""

    def __init__(self, rule: str) -> None:
        self.rule, self.ran = rule, []
        self.flips = itertools.cycle(("deepspeed", "s1", "s2"))
        self.saved = selector.choose, dict(schedules.SCHEDULES)

    def __enter__(self):
        selector.choose = lambda layer, tokens, dtype: next(self.flips) if self.rule == "flip" else \
            _lagged(tokens)
        for name, fn in self.saved[1].items():
            schedules.SCHEDULES[name] = self._logged(name, fn)
        return self

    def _logged(self, name, fn):
        def run(*args):
            self.ran.append((name, recompute.recomputing()))
            return fn(*args)
        return run

    def __exit__(self, *exc) -> None:
        selector.choose = self.saved[0]
        schedules.SCHEDULES.update(self.saved[1])


def _micro_batch(net, counts, mode: str, checkpointed: bool):
    """(outputs, input gradients, gate-weight gradient) of one micro-batch: one call per count."""
    net.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss, outs, xs = 0.0, [], []
    for i, s in enumerate(counts):
        g = torch.Generator().manual_seed(1000 * i + 10 * s + dist.get_rank() // 2)
        x, go = torch.randn(s, M, generator=g).requires_grad_(), torch.randn(s, M, generator=g)
        out, l_aux, _ = _checkpointed(net, x, mode) if checkpointed else net(x)
        loss = loss + (out * go).sum() + 0.5 * l_aux
        outs.append(out.detach())
        xs.append(x)
    loss.backward()
    gate = net.gate.wg.weight if isinstance(net, ParmMoE) else net.moe.gate.wg.weight
    return outs + [x.grad for x in xs] + [gate.grad]


def _run(drop: bool, rule: str) -> dict:
    lay = use_layout(2, 2)
    deepspeed.checkpointing.configure(lay.mpu)
    w = Weights.random(E, M, H)
    gate = {**GATE, "drop_tokens": drop}
    oracle = LocalOracle(w, **gate)
    out = {}
    for mode in MODES:
        layer = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=2, enable_expert_tensor_parallelism=True,
                        schedule="auto", overlap_chunks=2, **gate)
        load_parm(layer, w)
        layer.set_deepspeed_parallelism()
        errors, forwards = [], []
        with _Log(rule) as log:
            for batch in DROP_BATCHES if drop else NO_DROP_BATCHES:
                calls = batch if isinstance(batch[0], tuple) else (batch,)
                counts = [c[dist.get_rank() // 2] for c in calls]
                got = _micro_batch(layer, counts, mode, checkpointed=True)
                want = _micro_batch(oracle, counts, mode, checkpointed=False)
                errors.append(max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)))
                forwards.append(len(calls))
        out[mode] = {"errors": errors, "ran": log.ran, "forwards": forwards}
    return out


def _expected(ran: list, forwards: list) -> list:
    """The oracle of the schedules run: per micro-batch its forwards' picks, then the recomputes of the
    same picks, last call first."""
    want, i = [], 0
    for n in forwards:
        picks = [name for name, _ in ran[i:i + n]]
        want += [(p, False) for p in picks] + [(p, True) for p in reversed(picks)]
        i += 2 * n
    return want


@pytest.mark.world_size(4)
@pytest.mark.parametrize("drop,rule", [(True, "flip"), (False, "lagged")])
def test_a_recompute_runs_its_forwards_schedule(world, drop, rule):
    for rank, res in enumerate(world.run(_run, drop, rule)):
        for mode, r in res.items():
            where = (rank, mode, r)
            assert r["ran"] == _expected(r["ran"], r["forwards"]), where
            assert len({name for name, _ in r["ran"]}) >= 2, where     # the pick did change
            assert all(err < 2e-5 for err in r["errors"]), where
