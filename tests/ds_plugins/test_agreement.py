"""Every size a collective depends on is agreed over every group it uses (issue 9, item 3), on 4 gloo ranks
(tp 2 x ep 2, ESP 2): inputs or routing that differ where they must not raise the same clear error on
every rank instead of hanging, the world stays usable afterwards, and set-up runs once per layer."""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from commweave.ledger import recording
from ds_plugins import ParmMoE
from ds_plugins import dispatch as dispatch_module
from ds_plugins.schedules import sync_free
from tests.ds_plugins.deepspeed_oracle import LocalOracle, Weights, load_parm, mlp, tp_rank, use_layout
from tests.ds_plugins.test_schedules import _run

S, M, H, E = 24, 8, 16, 8


def _layer(schedule: str, drop: bool = True, w: Weights | None = None, skip: bool = True, tp: int = 2,
           ep: int = 2) -> ParmMoE:
    use_layout(tp, ep)
    torch.manual_seed(0)
    layer = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=ep, k=2, capacity_factor=1.0, min_capacity=0,
                    drop_tokens=drop, enable_expert_tensor_parallelism=True, schedule=schedule,
                    skip_empty_slots=skip)
    if w is not None:
        load_parm(layer, w)
    layer.set_deepspeed_parallelism()
    return layer


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _healthy() -> bool:
    """A normal forward + backward after the errors: nothing hung, no rank is a collective behind."""
    layer = _layer("s1")
    torch.manual_seed(dist.get_rank() // 2)
    out, l_aux, _ = layer(torch.randn(S, M))
    (out.sum() + l_aux).backward()
    return True


def _divergent_routing(schedule: str) -> str:
    """No token dropping; MP rank 1 routes every token to one expert, its MP peer does not: the capacity
    (the largest expert count) differs across the MP ranks of a group."""
    layer = _layer(schedule, drop=False)
    torch.manual_seed(dist.get_rank() // 2)
    x = torch.randn(S, M)
    if tp_rank() == 1:
        x = 10 * layer.gate.wg.weight[0].detach().expand(S, M).clone()
    return _error(lambda: layer(x))


def _token_counts() -> dict:
    torch.manual_seed(1)
    big = 24 if dist.get_rank() // 2 == 0 else 20                   # MP group {0,1} vs {2,3}: EP peers differ
    # S1 takes the token agreement (ds_plugins.agreement.tokens); the sync-free path: test_a_changed_shape
    errors = {"mp": _error(lambda: _layer("s1")(torch.randn(24 + tp_rank(), M))),
              "ep drop": _error(lambda: _layer("s1")(torch.randn(big, M)))}
    layer = _layer("s1")
    layer.train(dist.get_rank() != 3)
    errors["train/eval"] = _error(lambda: layer(torch.randn(S, M)))
    return errors


def _ep_counts_without_dropping(schedule: str) -> float:
    """drop_tokens=False: EP peers may hold different token counts (the capacity is their MAX). Two
    forwards of different counts: "auto" agrees in the first, and in the second picks from the first's
    largest count, carried on its headers (ds_plugins.schedules.sync_free)."""
    w = Weights.random(E, M, H)
    layer = _layer(schedule, drop=False, w=w)
    torch.manual_seed(1000 + dist.get_rank() // 2)
    oracle = LocalOracle(w, k=2, capacity_factor=1.0, min_capacity=0, drop_tokens=False)
    err = 0.0
    for tokens in ((24, 19), (17, 22)):
        x, go = torch.randn(tokens[dist.get_rank() // 2], M), torch.randn(tokens[dist.get_rank() // 2], M)
        got, want = _run(layer, x, go), _run(oracle, x, go)
        err = max(err, (got[0] - want[0]).abs().max().item(), (got[3] - want[3]).abs().max().item())
    return err


def _all() -> dict:
    out = {f"routing {s}": _divergent_routing(s) for s in ("s2", "deepspeed")}
    out.update(_token_counts())
    out["no-drop error"] = {s: _ep_counts_without_dropping(s) for s in ("s1", "s2", "deepspeed", "auto")}
    out["healthy"] = _healthy()
    return out


@pytest.mark.world_size(4)
def test_disagreements_raise_the_same_error_on_every_rank(world):
    for rank, res in enumerate(world.run(_all)):
        for schedule in ("s2", "deepspeed"):
            assert res[f"routing {schedule}"].startswith("RuntimeError: parm MoE: routing differs across the "
                                                         "tensor-parallel (MP) ranks"), (rank, res)
        assert "MP) ranks of this layer hold different token counts (between 24 and 25)" in res["mp"], rank
        assert "drop_tokens=True every rank" in res["ep drop"] and "between 20 and 24" in res["ep drop"], rank
        assert "others in eval mode" in res["train/eval"], rank
        for schedule, err in res["no-drop error"].items():
            assert err < 2e-5, (rank, schedule, err)
        assert res["healthy"]


def _set_up_twice() -> dict:
    layer = _layer("auto")
    shapes = [tuple(p.shape) for p in layer.parameters()]
    error = _error(layer.set_deepspeed_parallelism)
    torch.manual_seed(dist.get_rank() // 2)
    layer(torch.randn(S, M))
    return {"error": error, "same shapes": shapes == [tuple(p.shape) for p in layer.parameters()],
            "sharded": layer.local_experts[0][0].out_features}


@pytest.mark.world_size(4)
def test_a_second_set_up_fails_clearly_and_never_shards_twice(world):
    for res in world.run(_set_up_twice):
        assert res["error"].startswith("RuntimeError: ParmMoE.set_deepspeed_parallelism() was already called")
        assert res["same shapes"] and res["sharded"] == H // 2


# Issue 23, item 4: no host sync on the hot path. A steady-state forward (the third of one shape) is counted:
# the collectives from the ledger, the host reads by patching every Tensor method that copies a value to
# the host (item, cpu, tolist, numpy, __int__, __index__, __bool__, __float__), each attributed to the
# first calling frame outside torch: "parm" (ds_plugins), "deepspeed" (its gating functions) or "other";
# and the route checks of dispatch / combine (a C++ pass on the CPU, one device-to-host copy each on a GPU).

_READS = ("item", "cpu", "tolist", "numpy", "__int__", "__index__", "__bool__", "__float__")


@contextmanager
def _host_reads():
    seen: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    checks = dispatch_module._check_route_values

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            path = frame.f_code.co_filename if frame is not None else "?"
            who = "parm" if f"{os.sep}ds_plugins{os.sep}" in path else \
                "deepspeed" if f"{os.sep}deepspeed{os.sep}" in path else "other"
            seen[f"{who} {name} {os.path.basename(path)}:{frame.f_code.co_name if frame else '?'}"] += 1
            return fn(self, *args, **kwargs)
        return counted

    def checked(*args, **kwargs):
        seen["route check"] += 1
        return checks(*args, **kwargs)

    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        dispatch_module._check_route_values = checked
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        dispatch_module._check_route_values = checks


def _steady_state() -> dict:
    cases = {"s2": ("s2", True, 2, 2), "deepspeed": ("deepspeed", True, 2, 2), "s1": ("s1", True, 2, 2),
             "auto": ("auto", True, 2, 2), "s2 all slots": ("s2", False, 2, 2), "s2 tp1": ("s2", True, 1, 4),
             "deepspeed tp1": ("deepspeed", True, 1, 4), "s2 no-drop": ("s2", True, 2, 2, False),
             "s1 no-drop": ("s1", True, 2, 2, False), "deepspeed no-drop": ("deepspeed", True, 2, 2, False),
             "auto no-drop": ("auto", True, 2, 2, False)}
    out = {}
    for name, (schedule, skip, tp, ep, *drop) in cases.items():
        layer = _layer(schedule, skip=skip, tp=tp, ep=ep, drop=not drop)
        torch.manual_seed(dist.get_rank() // tp)
        x = torch.randn(S, M, requires_grad=True)
        with recording() as first:
            y, l_aux, _ = layer(x)
        (y.sum() + l_aux).backward()
        y, l_aux, _ = layer(x)
        (y.sum() + l_aux).backward()
        with recording() as led, _host_reads() as reads:
            y, l_aux, _ = layer(x)
        (y.sum() + l_aux).backward()
        out[name] = {"sync_free": sync_free(layer), "reads": dict(reads),
                     "calls": {key: v["calls"] for key, v in led.as_dict().items()},
                     "first": {key: v["calls"] for key, v in first.as_dict().items() if key not in EXCHANGES}}
    gate = _layer("s2").gate
    with _host_reads() as reads:
        gate(torch.randn(S, M))
    out["deepspeed gate"] = dict(reads)
    return out


NOT_SYNC_FREE = {"s2 all slots"}                  # no fill exchange
AGREES_FIRST = {"auto no-drop"}                   # its first forward has no previous headers to pick from
EXCHANGES = {"all_to_all@ep", "all_gather@esp", "reduce_scatter@esp", "all_gather@mp", "all_reduce@esp"}


@pytest.mark.world_size(4)
def test_steady_state_forward_issues_no_agreement_and_one_host_read(world):
    for rank, res in enumerate(world.run(_steady_state)):
        for name, got in res.items():
            if name == "deepspeed gate":
                continue
            assert got["sync_free"] == (name not in NOT_SYNC_FREE), (rank, name)
            token_agreement = {"all_reduce@mp": 1, "all_reduce@ep": 1}
            assert got["first"] == (token_agreement if name in NOT_SYNC_FREE | AGREES_FIRST else {}), \
                (rank, name, got)
            agreements = {key: n for key, n in got["calls"].items() if key not in EXCHANGES}
            if name not in NOT_SYNC_FREE:
                # 0 agreement collectives; 1 host read: the fill counts with the headers, which skipping
                # the empty slots needs anyway; the route checks of dispatch and combine
                assert agreements == {}, (rank, name, got)
                assert got["reads"] == {"parm tolist overlap.py:read": 1, "route check": 2}, (rank, name, got)
            else:
                # the token agreement; the capacity rides on the headers
                assert agreements == token_agreement, (rank, name, got)
                assert got["reads"] == {"parm tolist agreement.py:spread": 1, "route check": 2}, \
                    (rank, name, got)


def _changes(schedule: str, drop: bool) -> dict:
    """A sync-free layer in steady state, then one rank changes its input: each change must raise the same
    error on every rank (none hangs, no exchange of mismatched sizes), and the layer keeps working."""
    layer = _layer(schedule, drop=drop)
    me = dist.get_rank()

    def x(tokens: int = S, hidden: int = M) -> torch.Tensor:     # the same input on the two MP ranks
        torch.manual_seed(me // 2)
        return torch.randn(tokens, hidden)

    for _ in range(2):
        layer(x())
    errors = {"ep": _error(lambda: layer(x(S - 4 if me // 2 else S))),       # MP group {2, 3}
              "mp": _error(lambda: layer(x(S + 1 if me == 1 else S))),
              "refused": _error(lambda: layer(x(hidden=M + (me == 2))))}
    layer.train(me != 2)
    errors["train/eval"] = _error(lambda: layer(x()))
    layer.train()
    errors["all change"] = _error(lambda: layer(x(S - 8)))                   # every rank: a new shape
    if me == 0:
        layer.schedule = "s2" if schedule == "s1" else "s1"
    errors["schedules"] = _error(lambda: layer(x()))
    layer.schedule = schedule
    with torch.no_grad():                                 # the odd MP ranks' gates favour expert 0
        layer.gate.wg.weight[0].add_(float(me % 2))
    errors["gate"] = _error(lambda: layer(x()))
    errors["sync_free"] = sync_free(layer)
    return errors


@pytest.mark.world_size(4)
@pytest.mark.parametrize("drop", [True, False], ids=["drop", "no-drop"])
def test_a_changed_shape_on_one_rank_raises_the_same_error_on_every_rank(world, drop):
    for schedule in ("s2", "deepspeed", "s1", "auto"):
        per_rank = world.run(_changes, schedule, drop)
        for rank, res in enumerate(per_rank):
            assert res["sync_free"], (schedule, rank)
            if drop:
                assert "drop_tokens=True every rank" in res["ep"] and "between 20 and 24" in res["ep"], res
            else:                                         # EP groups may hold different token counts
                assert res["ep"] == "no error", res
            assert "MP) ranks of this layer hold different token counts (between 24 and 25)" in res["mp"], res
            assert res["refused"].startswith("ValueError: rank 2: ParmMoE.forward: hidden_states has shape "
                                             "(24, 9)"), res
            assert "others in eval mode" in res["train/eval"], res
            assert res["all change"] == "no error", res
            assert res["schedules"].startswith("RuntimeError: parm MoE: the ranks of this layer run "
                                               "different schedules ({0: "), res
            # the deepspeed order with empty-slot skipping aborted gloo here ("Received data size doesn't
            # match"): the MP ranks' filled rows differ, so do their expert all-reduces' sizes
            # (the hashes name the ranks; S1's per-block capacities, and the no-drop C, differ first)
            why = "(ranks [0, 1, 2, 3]" if drop and schedule != "s1" else "(capacities between"
            assert res["gate"].startswith("RuntimeError: parm MoE: routing differs across the "
                                          f"tensor-parallel (MP) ranks of this layer {why}"), res
        assert len({str(res) for res in per_rank}) == 1, per_rank
    assert all(world.run(_healthy))
