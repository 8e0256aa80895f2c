"""Bad input, table-driven, across the public surface outside the launcher (issue 14, item 1).

Every case raises an error that names the argument, the value and the rule. The distributed cases run on
4 ranks (tp 2 x ep 2 for Parm, one CP group of 4 for WallFacer), all cases of a surface in one world
call, and check on every rank:

- the same exception text on every rank, including where only one rank got the bad value ("rank 2: ...");
- the only communication before the error is the agreement's (recorded by commweave's ledger, with
  ``trace_torch_distributed`` catching DeepSpeed's own collectives): no all-to-all of data (a sync-free
  Parm forward's agreement is its fill counts' all-to-all, see AGREEMENT), no ring step, no team
  all-gather, nothing of ``deepspeed.initialize``;
- afterwards the world still runs a healthy call (no rank is a collective behind).

The local cases (config sections, constructors, dispatch/combine, the Megatron arguments) run in this
process ("1" rank). ``test_case_count`` prints the table by surface and rank count.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commweave import comm, ledger

S, M, H, E = 24, 8, 16, 8
WORLD = 4
AGREEMENT = {"all_gather", "all_reduce"}        # the kinds an agreement uses; no data moves before an error
# A sync-free Parm forward (S2, "deepspeed"; ds_plugins.schedules.sync_free) carries its agreement on the
# fill counts' all-to-all over EP 2: E int32 counts and 2 headers (ds_plugins.agreement.HEADER words each),
# W = (E + 2·HEADER)·4 bytes, W/2 sent per rank. It moves no token data, so it counts as the agreement's.

# ---------------------------------------------------------------------------------------------------------
# Parm on 4 ranks (tp 2 x ep 2, ESP 2): MP groups [0,1] [2,3], EP groups [0,2] [1,3]
# ---------------------------------------------------------------------------------------------------------

FORWARD = {  # name: (bad rank or None for every rank, schedule, change, expected text)
    "hidden size, every rank": (None, "s1", "hidden", "ParmMoE.forward: hidden_states has shape (24, "
                                                      "12): its "
                                "last dimension must be the layer's hidden_size 8"),
    "hidden size, rank 3": (3, "s1", "hidden", "rank 3: ParmMoE.forward: hidden_states has shape (24, 12)"),
    "hidden size 3-d, rank 0 (s2)": (0, "s2", "hidden 3-d", "rank 0: ParmMoE.forward: hidden_states has "
                                     "shape (4, 6, 12): its last dimension must be the layer's "
                                     "hidden_size 8"),
    "hidden size, rank 2 (deepspeed)": (2, "deepspeed", "hidden", "rank 2: ParmMoE.forward: hidden_states"),
    "integer input, rank 1": (1, "s2", "int", "rank 1: ParmMoE.forward: hidden_states has dtype torch.int64: "
                              "it must be a floating-point tensor"),
    "bf16 input, fp32 experts, rank 2": (2, "s1", "bf16", "rank 2: ParmMoE.forward: hidden_states has dtype "
                                         "torch.bfloat16, the experts torch.float32"),
    "not a tensor, rank 1": (1, "s1", "list", "rank 1: ParmMoE.forward: hidden_states must be a torch.Tensor "
                             "[..., 8], got list"),
    "0-d tensor, every rank": (None, "s2", "0-d", "ParmMoE.forward: hidden_states has shape (): its last "
                               "dimension"),
    "meta device, rank 3": (3, "s2", "meta", "rank 3: ParmMoE.forward: hidden_states is on meta, the layer "
                            "on cpu"),
    "used_token shape, rank 0": (0, "s1", "used_token", "rank 0: ParmMoE.forward: used_token has shape "
                                                        "(23,): "
                                 "it must be None or [S] = [24]"),
    "used_token a list, every rank": (None, "s2", "used_token list", "ParmMoE.forward: used_token has shape "
                                      "list: it must be None or [S] = [24]"),
    "token count, ranks 2 and 3 (drop mode)": ((2, 3), "s2", "tokens", "with drop_tokens=True every "
                                                                       "rank of a layer must "
                                        "hold the same number of tokens (the capacity, which sizes every "
                                        "exchange, is computed from it); got between 20 and 24"),
    "token count in MP, rank 1 (deepspeed)": (1, "deepspeed", "tokens", "the tensor-parallel (MP) ranks of "
                                              "this layer hold different token counts (between 20 and 24)"),
}

SETTINGS = {  # name: (bad rank, ParmMoE overrides on it, expected text); layers built on every rank
    "schedule s1 vs s2, rank 1": (1, {"schedule": "s2"}, ["ParmMoE layer settings: the ranks of group",
                                                          "must agree on schedule, got schedule:",
                                                          "rank 1=2"]),
    "overlap_chunks, rank 0": (0, {"overlap_chunks": 2}, ["must agree on overlap_chunks", "rank 0=2"]),
    "k, rank 3": (3, {"k": 1}, ["must agree on k, got k:", "rank 3=1"]),
    "num_experts, rank 2": (2, {"num_experts": 16}, ["must agree on num_experts", "rank 2=16"]),
    "capacity_factor, rank 1": (1, {"capacity_factor": 2.0}, ["must agree on capacity_factor, got "
                                                              "capacity_factor: rank 0=1.0, rank 1=2.0"]),
    "drop_tokens, rank 3": (3, {"drop_tokens": False}, ["must agree on drop_tokens", "rank 3=0"]),
    "hidden_size, rank 0": (0, {"hidden_size": 12}, ["must agree on hidden_size", "rank 0=12"]),
    "noisy_gate_policy, rank 2": (2, {"noisy_gate_policy": "Jitter"}, ["must agree on noisy_gate_policy"]),
    "skip_empty_slots, rank 1": (1, {"skip_empty_slots": False}, ["must agree on skip_empty_slots"]),
    "min_capacity, rank 3": (3, {"min_capacity": 4}, ["must agree on min_capacity", "rank 3=4"]),
    "unshardable expert, rank 2": (2, {"expert": "unshardable"},
                                   ["rank 2: ParmMoE.set_deepspeed_parallelism: expert Sequential cannot be "
                                    "sharded over ESP size 2: its first and last modules must be nn.Linear"]),
}

INITIALIZE = {  # name: (bad rank or None, change, expected text)
    "schedule 'S1', every rank": (None, {"schedule": "S1"}, "ds_plugins.initialize: parm schedule='S1' "
                                  "is not one of ('auto', 's1', 's2', 'deepspeed')"),
    "schedule 's4', rank 2": (2, {"schedule": "s4"}, "rank 2: ds_plugins.initialize: parm schedule='s4'"),
    "schedule s1 vs s2, rank 1": (1, {"schedule": "s2"}, 'ds_plugins.initialize: the "parm" section: the '
                                  "ranks of group world must agree on schedule, got schedule: rank 0=1, "
                                  "rank 1=2, rank 2=1, rank 3=1"),
    "overlap_chunks 2 vs 4, rank 3": (3, {"overlap_chunks": 2}, "must agree on overlap_chunks"),
    "enabled false, rank 2": (2, {"enabled": False}, "must agree on enabled, got enabled: rank 0=1, "
                              "rank 1=1, rank 2=0"),
    "timeout_s -1, rank 3": (3, {"timeout_s": -1}, "rank 3: ds_plugins.initialize: parm timeout_s=-1: the "
                             "communication timeout must be a finite number of seconds in [1, 604800]"),
    "config file missing, rank 0": (0, "missing file", "rank 0: ds_plugins.initialize: DeepSpeed config file "
                                    "'/nonexistent/ds_config.json' cannot be read: No such file or "
                                    "directory"),
    "section is a list, rank 1": (1, "list", 'rank 1: ds_plugins.initialize: the "parm" section must be a '
                                  "JSON object, got list"),
    "MoE k=0, rank 1": (1, "k0", "rank 1: ds_plugins.initialize: k=0 must be an integer in [1, "
                        "num_experts=8]"),
    "MoE capacity_factor nan, every rank": (None, "cf nan", "ds_plugins.initialize: capacity_factor=nan "
                                            "must be a finite number > 0"),
    "unshardable expert, rank 0": (0, "unshardable", "rank 0: ds_plugins.initialize: expert Unshardable "
                                   "cannot be sharded over ESP size 2"),
    "unknown key, rank 3": (3, {"overlap": 2}, "rank 3: ds_plugins.initialize: unknown key(s) ['overlap'] in "
                            'the "parm" section'),
}


def _outcome(fn) -> tuple[str, str, list[str]]:
    """(exception type, text, kinds of communication before it) of ``fn()``."""
    with ledger.recording() as led, comm.trace_torch_distributed():
        try:
            fn()
            kind, text = "no error", ""
        except Exception as e:
            kind, text = type(e).__name__, str(e)
    from ds_plugins.agreement import HEADER

    traffic, half = led.as_dict(), (E + 2 * HEADER) * 4 // 2
    header = traffic.get("all_to_all@ep") == {"calls": 1, "sent": half, "received": half}
    return kind, text, sorted({key.split("@")[0] for key, v in traffic.items()
                               if v["calls"] and not (header and key == "all_to_all@ep")})


def _parm_layer(schedule="s1", **overrides):
    from ds_plugins import ParmMoE
    from tests.ds_plugins.deepspeed_oracle import mlp

    args = dict(hidden_size=M, num_experts=E, ep_size=2, k=2, capacity_factor=1.0, min_capacity=0,
                enable_expert_tensor_parallelism=True, schedule=schedule)
    args.update(overrides)
    expert = args.pop("expert", None)
    if expert == "unshardable":
        expert = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Identity())
    torch.manual_seed(0)
    return ParmMoE(expert=expert or mlp(args["hidden_size"], H), **args)


def _is_bad(bad, rank: int) -> bool:
    return bad is None or rank == bad or (isinstance(bad, tuple) and rank in bad)


def _forward_input(change: str):
    torch.manual_seed(dist.get_rank() // 2)
    x, used = torch.randn(S, M), None
    if change == "hidden":
        x = torch.randn(S, 12)
    elif change == "hidden 3-d":
        x = torch.randn(4, 6, 12)
    elif change == "int":
        x = torch.randint(5, (S, M))
    elif change == "bf16":
        x = x.bfloat16()
    elif change == "list":
        x = x.tolist()
    elif change == "0-d":
        x = torch.tensor(1.0)
    elif change == "meta":
        x = x.to("meta")
    elif change == "used_token":
        used = torch.ones(S - 1)
    elif change == "used_token list":
        used = [1.0] * S
    elif change == "tokens":
        x = torch.randn(20, M)
    return x, used


def _parm_cases() -> dict:
    from tests.ds_plugins.deepspeed_oracle import use_layout

    use_layout(2, 2)
    me, out = dist.get_rank(), {}
    comm.set_timeout(60)                  # a case that hung would fail here within a minute, not hang CI
    try:
        layers = {}
        for schedule in ("s1", "s2", "deepspeed"):
            layers[schedule] = _parm_layer(schedule)
            layers[schedule].set_deepspeed_parallelism()
        for name, (bad, schedule, change) in ((n, c[:3]) for n, c in FORWARD.items()):
            x, used = _forward_input(change if _is_bad(bad, me) else "none")
            out["forward: " + name] = _outcome(lambda x=x, used=used, s=schedule: layers[s](x, used))
        for name, (bad, overrides, _) in SETTINGS.items():
            kw = overrides if me == bad else {}
            out["set-up: " + name] = _outcome(lambda kw=kw: _parm_layer(**kw).set_deepspeed_parallelism())
        torch.manual_seed(me // 2)                                    # healthy afterwards
        y, l_aux, _ = layers["s1"](torch.randn(S, M))
        (y.sum() + l_aux).backward()
        out["healthy"] = bool(torch.isfinite(y).all())
    finally:
        comm.set_timeout(None)
    return out


def _net(change):
    from deepspeed.moe.layer import MoE

    from tests.ds_plugins.deepspeed_oracle import mlp
    from tests.ds_plugins.test_engine import Unshardable

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kw = dict(k=0 if change == "k0" else 2, capacity_factor=math.nan if change == "cf nan" else 1.0)
            expert = Unshardable() if change == "unshardable" else mlp(M, H)
            self.moe = MoE(M, expert, num_experts=E, ep_size=2, enable_expert_tensor_parallelism=True, **kw)

        def forward(self, x):
            return self.moe(x)[0].sum()

    return Net()


def _initialize_cases() -> dict:
    import ds_plugins
    from tests.ds_plugins.deepspeed_oracle import use_layout

    lay = use_layout(2, 2)
    me, out = dist.get_rank(), {}
    comm.set_timeout(60)
    try:
        for name, (bad, change, _) in INITIALIZE.items():
            mine = change if bad in (None, me) else None
            parm = {"enabled": True, "schedule": "s1", "overlap_chunks": 4}
            if isinstance(mine, dict):
                parm.update(mine)
            config = {"train_micro_batch_size_per_gpu": S, "parm": parm,
                      "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
            if mine == "missing file":
                config = "/nonexistent/ds_config.json"
            elif mine == "list":
                config["parm"] = ["s1"]
            net = _net(mine)
            out["initialize: " + name] = _outcome(lambda n=net, c=config: ds_plugins.initialize(
                model=n, model_parameters=n.parameters(), mpu=lay.mpu, config=c))
        out["timeout untouched"] = comm.timeout_s() == 60
        net = _net("k0")                                  # refused, but the section's timeout_s is applied
        _outcome(lambda: ds_plugins.initialize(model=net, model_parameters=net.parameters(), mpu=lay.mpu,
                                               config={"train_micro_batch_size_per_gpu": S,
                                                       "parm": {"enabled": True, "timeout_s": 7}}))
        out["timeout applied"] = comm.timeout_s() == 7
    finally:
        comm.set_timeout(None)
    return out


def _check(results: list[dict], expected: dict[str, str | list[str]], allowed: set[str]) -> None:
    bad = []
    for name, want in expected.items():
        outcomes = [r[name] for r in results]
        kinds, texts, traffic = zip(*outcomes, strict=True)
        wants = [want] if isinstance(want, str) else want
        if set(kinds) != {"ValueError"} or len(set(texts)) != 1 or not all(w in texts[0] for w in wants):
            bad.append(f"{name}: {outcomes}")
        elif not set().union(*map(set, traffic)) <= allowed:
            bad.append(f"{name}: communication before the error {traffic}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.fault("refused", kind="bad input: Parm (4 ranks)", cases=len(FORWARD) + len(SETTINGS))
@pytest.mark.world_size(WORLD)
def test_parm_forward_and_set_up_refuse_on_every_rank(world):
    results = world.run(_parm_cases)
    expected = {"forward: " + n: c[3] for n, c in FORWARD.items()}
    expected.update({"set-up: " + n: c[2] for n, c in SETTINGS.items()})
    _check(results, expected, AGREEMENT)
    assert all(r["healthy"] for r in results)


@pytest.mark.slow
@pytest.mark.fault("refused", kind="bad input: Parm (4 ranks)", cases=len(INITIALIZE))
@pytest.mark.world_size(WORLD)
def test_initialize_refuses_on_every_rank_before_deepspeed_initialize(world):
    results = world.run(_initialize_cases)
    _check(results, {"initialize: " + n: c[2] for n, c in INITIALIZE.items()}, {"all_gather"})
    assert all(r["timeout untouched"] for r in results)   # a refused "timeout_s" is not applied
    assert all(r["timeout applied"] for r in results)


# ---------------------------------------------------------------------------------------------------------
# WallFacer on 4 ranks: wallfacer_attention over the world (P = 4, C = 2), WallFacerAttention with CP = 4
# ---------------------------------------------------------------------------------------------------------

ATTENTION = {  # name: (bad rank or None, change, expected text)
    "backward 'x', every rank": (None, {"backward": "x"}, "wallfacer_attention: backward='x' is not one of "
                                 "('auto', 'kv', 'q')"),
    "backward 'x', rank 2": (2, {"backward": "x"}, "wallfacer_attention: rank 2: backward='x' is not one of"),
    "backward kv vs q, rank 1": (1, {"backward": "q"}, "wallfacer_attention: ranks disagree: rank 1 passes "),
    "kernel 'cudnn', rank 1": (1, {"kernel": "cudnn"}, "wallfacer_attention: rank 1: kernel='cudnn' is not "
                               "one of ('auto', 'sdpa', 'flash', 'reference')"),
    "kernel 'flash' on CPU, every rank": (None, {"kernel": "flash"}, "wallfacer_attention: kernel='flash' "
                                          "needs CUDA fp16/bf16 tensors, got cpu torch.float32"),
    "kernel object without backward, rank 3": (3, {"kernel": "object"}, "rank 3: kernel=<tests.faults."
                                                "test_bad_input._NoBackward object at"),
    "order not a permutation, rank 0": (0, {"order": (0, 0, 1, 2)}, "rank 0: order=[0, 0, 1, 2] must be a "
                                        "permutation of range(4)"),
    "order of 3 ranks, every rank": (None, {"order": (0, 1, 2)}, "order=[0, 1, 2] must be a permutation of "
                                     "range(4)"),
    "order differs, rank 1": (1, {"order": (1, 0, 3, 2)}, "ranks disagree: rank 1 passes"),
    "team_size 2.5, rank 3": (3, {"team_size": 2.5}, "rank 3: team_size=2.5 must be an integer"),
    "team_size '2', every rank": (None, {"team_size": "2"}, "team_size='2' must be an integer"),
    "team_size 4, every rank": (None, {"team_size": 4}, "team_size C=4 is invalid for P=4 ranks: C² must "
                                "divide P (valid: 1, 2)"),
    "team_size 0, rank 0": (0, {"team_size": 0}, "rank 0: team_size C=0 is invalid for P=4 ranks"),
    "team_size 1 vs 2, rank 2": (2, {"team_size": 1}, "ranks disagree: rank 2 passes "),
    "causal differs, rank 0": (0, {"causal": False}, "ranks disagree: rank 0 passes q [4, 2, 4, 8] float32, "
                               "k [4, 2, 2, 8] float32, v [4, 2, 2, 8] float32, team_size=2, layout=zigzag, "
                               "causal=False"),
    "softmax_scale nan, every rank": (None, {"softmax_scale": math.nan}, "softmax_scale=nan must be a finite "
                                      "number > 0"),
    "softmax_scale 0, rank 1": (1, {"softmax_scale": 0.0}, "rank 1: softmax_scale=0.0 must be a finite "
                                "number > 0"),
    "softmax_scale 'abc', rank 2": (2, {"softmax_scale": "abc"}, "rank 2: softmax_scale='abc' must be a "
                                    "finite number > 0 or None"),
    "softmax_scale -inf, every rank": (None, {"softmax_scale": -math.inf}, "softmax_scale=-inf must be a "
                                       "finite number > 0"),
    "layout 'striped', rank 3": (3, {"layout": "striped"}, "layout='striped' is not one of ('zigzag', "
                                 "'contiguous')"),
    "layout contiguous vs zigzag, rank 0": (0, {"layout": "contiguous"}, "ranks disagree: rank 0 passes"),
    "zero-length shard, every rank": (None, {"s": 0}, "must have no empty dimension"),
    "zero-length shard, rank 2": (2, {"s": 0}, "rank 2: q [0, 2, 4, 8] and k [0, 2, 2, 8] must have no "
                                  "empty dimension"),
    "batch 0, every rank": (None, {"b": 0}, "q [4, 0, 4, 8] and k [4, 0, 2, 8] must have no empty dimension"),
    "q 3-d, rank 1": (1, {"q_dim": 3}, "rank 1: q, k and v must be 4-d tensors [s_local, batch, heads, "
                      "head_dim] (Megatron's layout)"),
    "integer q, k, v, every rank": (None, {"dtype": torch.int32}, "q, k, v dtypes must be one of"),
    "k float64, q float32, rank 3": (3, {"k_dtype": torch.float64}, "rank 3: q, k, v dtypes must be one of "
                                     "['float16', 'bfloat16', 'float32', 'float64'] and equal"),
    "3 K/V heads for 4 query heads, every rank": (None, {"hkv": 3}, "q has 4 heads and k/v have 3: the query "
                                                  "heads must be a multiple of the K/V heads"),
    "head_dim differs, rank 2": (2, {"d": 16}, "ranks disagree: rank 2 passes q [4, 2, 4, 16]"),
    "batch differs, rank 3": (3, {"b": 3}, "ranks disagree: rank 3 passes q [4, 3, 4, 8]"),
    "q is None, rank 0": (0, {"q": None}, "rank 0: q, k and v must be 4-d tensors"),
    "odd s_local, rank 1": (1, {"s": 5}, "rank 1: sequence length 20 (= P·s_local = 4·5) must be divisible "
                            "by 2·P = 8"),
}

MODULE = {  # WallFacerAttention: name: (bad rank or None, change, expected text)
    "team size 1 vs 2 in the config, rank 1": (1, {"team_size": 1}, "ranks disagree: rank 1 passes "),
    "backward q vs kv in the config, rank 2": (2, {"backward": "q"}, "ranks disagree: rank 2 passes"),
    "attention mask, rank 3": (3, "mask", "rank 3: WallFacerAttention: explicit attention masks are not "
                               "supported"),
    "attention bias, rank 0": (0, "bias", "rank 0: WallFacerAttention: attention_bias is not supported"),
    "packed sequences, rank 1": (1, "packed", "rank 1: WallFacerAttention: packed sequences (THD, "
                                 "packed_seq_params) are not supported"),
    "padding mask type at forward, rank 2": (2, "padding", "rank 2: WallFacerAttention: "
                                             "attn_mask_type=AttnMaskType.padding: only causal and no_mask"),
    "softmax_type off-by-one, every rank": (None, "off-by-one", "WallFacerAttention: "
                                            "softmax_type='off-by-one': only vanilla"),
    "cp_comm_type a2a+p2p, every rank": (None, "a2a+p2p", "WallFacerAttention: cp_comm_type='a2a+p2p': use "
                                         "one of (None, 'p2p', 'wallfacer')"),
    "timeout_s 0 in the config, every rank": (None, {"timeout_s": 0}, "--commweave-timeout-s=0: the "
                                              "communication timeout must be a finite number of seconds in "
                                              "[1, 604800]"),
}


class _NoBackward:
    def forward(self, *args):
        raise AssertionError("never called")


def _qkv(s=4, b=2, hq=4, hkv=2, d=8, dtype=torch.float32, k_dtype=None, q_dim=4, q="tensor"):
    torch.manual_seed(dist.get_rank())
    if dtype.is_floating_point:
        k = torch.randn(s, b, hkv, d, dtype=k_dtype or dtype)
        v = torch.randn(s, b, hkv, d, dtype=dtype)
        query = torch.randn(s, b, hq, d, dtype=dtype)
    else:
        k, v, query = (torch.zeros(s, b, h, d, dtype=dtype) for h in (hkv, hkv, hq))
    if q_dim == 3:
        query = query[0]
    return (None if q is None else query), k, v


def _wallfacer_cases() -> dict:
    from megatron_patches import wallfacer_attention

    me, out = dist.get_rank(), {}
    comm.set_timeout(60)
    try:
        for name, (bad, change, _) in ATTENTION.items():
            kw = dict(change) if bad in (None, me) else {}
            shapes = {n: kw.pop(n) for n in ("s", "b", "hkv", "d", "dtype", "k_dtype", "q_dim", "q")
                      if n in kw}
            if kw.get("kernel") == "object":
                kw["kernel"] = _NoBackward()
            q, k, v = _qkv(**shapes)
            args = {"team_size": 2, **kw}
            out["wallfacer_attention: " + name] = _outcome(
                lambda q=q, k=k, v=v, a=args: wallfacer_attention(q, k, v, dist.group.WORLD, **a))
        q, k, v = _qkv()
        out["healthy"] = tuple(wallfacer_attention(q, k, v, dist.group.WORLD, 2).shape) == (4, 2, 4, 8)
        out.update(_module_cases())
    finally:
        comm.set_timeout(None)
    return out


def _module_cases() -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches import WallFacerAttention, WallFacerConfig

    me, out = dist.get_rank(), {}
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=WORLD)
    try:
        for name, (bad, change, _) in MODULE.items():
            mine = change if bad in (None, me) else None
            config = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                          context_parallel_size=WORLD)
            wf, forward, build = {"team_size": 2, "backward": "kv"}, {}, {}
            if isinstance(mine, dict):
                wf.update(mine)
            elif mine == "off-by-one":
                config["softmax_type"] = "off-by-one"
            elif mine == "a2a+p2p":
                build["cp_comm_type"] = "a2a+p2p"
            q, k, v = _qkv()
            forward = {"mask": {"attention_mask": torch.zeros(2, 1, 16, 16, dtype=torch.bool)},
                       "bias": {"attention_bias": torch.zeros(1)},
                       "packed": {"packed_seq_params": PackedSeqParams(qkv_format="thd")},
                       "padding": {"attn_mask_type": AttnMaskType.padding}}.get(str(mine), {})

            def run(wf=wf, config=config, build=build, forward=forward, q=q, k=k, v=v):
                module = WallFacerAttention(TransformerConfig(**config), 1, AttnMaskType.causal, "self",
                                            wallfacer=WallFacerConfig(**wf), **build)
                module(q, k, v, forward.pop("attention_mask", None), **forward)

            out["WallFacerAttention: " + name] = _outcome(run)
        WallFacerAttention(TransformerConfig(**config), 1, AttnMaskType.causal, "self",
                           wallfacer=WallFacerConfig(team_size=2, timeout_s=9))
        out["timeout applied"] = comm.timeout_s() == 9         # --commweave-timeout-s 9
        return out
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.fault("refused", kind="bad input: WallFacer (4 ranks)", cases=len(ATTENTION) + len(MODULE))
@pytest.mark.world_size(WORLD)
def test_wallfacer_refuses_on_every_rank_before_any_ring_step(world):
    results = world.run(_wallfacer_cases)
    expected = {"wallfacer_attention: " + n: c[2] for n, c in ATTENTION.items()}
    expected.update({"WallFacerAttention: " + n: c[2] for n, c in MODULE.items()})
    _check(results, expected, {"all_gather"})
    assert all(r["healthy"] and r["timeout applied"] for r in results)


# ---------------------------------------------------------------------------------------------------------
# Local cases: the "parm" section, the ParmMoE constructor, dispatch/combine, the Megatron arguments
# ---------------------------------------------------------------------------------------------------------

PARM_SECTION = {  # the section (or the whole config, for "config:") -> expected text
    "schedule 1": ({"schedule": 1}, "parm schedule=1 is not one of"),
    "schedule null": ({"schedule": None}, "parm schedule=None is not one of"),
    "schedule 'S2'": ({"schedule": "S2"}, "parm schedule='S2' is not one of ('auto', 's1', 's2', "
                                          "'deepspeed')"),
    "overlap_chunks -1": ({"overlap_chunks": -1}, "parm overlap_chunks=-1 must be an integer >= 1"),
    "overlap_chunks '4'": ({"overlap_chunks": "4"}, "parm overlap_chunks='4' must be an integer >= 1"),
    "overlap_chunks true": ({"overlap_chunks": True}, "parm overlap_chunks=True must be an integer >= 1"),
    "enabled 1": ({"enabled": 1}, "parm enabled=1 must be true or false"),
    "enabled null": ({"enabled": None}, "parm enabled=None must be true or false"),
    "debug 'false'": ({"debug": "false"}, "parm debug='false' must be true or false"),
    "skip_empty_slots 'yes'": ({"skip_empty_slots": "yes"}, "parm skip_empty_slots='yes' must be true "
                                                            "or false"),
    "cost_cache ''": ({"cost_cache": ""}, "parm cost_cache='' must be a file path (string) or null"),
    "cost_cache list": ({"cost_cache": ["a"]}, "parm cost_cache=['a'] must be a file path"),
    "timeout_s 0": ({"timeout_s": 0}, "parm timeout_s=0: the communication timeout must be a finite "
                                      "number of "
                    "seconds in [1, 604800]"),
    "timeout_s -1": ({"timeout_s": -1}, "parm timeout_s=-1: the communication timeout"),
    "timeout_s 'abc'": ({"timeout_s": "abc"}, "parm timeout_s='abc': the communication timeout"),
    "timeout_s nan": ({"timeout_s": math.nan}, "parm timeout_s=nan: the communication timeout"),
    "timeout_s inf": ({"timeout_s": math.inf}, "parm timeout_s=inf: the communication timeout"),
    "timeout_s true": ({"timeout_s": True}, "parm timeout_s=True: the communication timeout"),
    "timeout_s list": ({"timeout_s": [5]}, "parm timeout_s=[5]: the communication timeout"),
    "two unknown keys": ({"chunks": 2, "mode": "s1"}, "unknown key(s) ['chunks', 'mode'] in the \"parm\" "
                         "section; allowed keys:"),
    "section a string": ("s1", 'the "parm" section must be a JSON object, got str'),
    "section a number": (3, 'the "parm" section must be a JSON object, got int'),
    "config: a number": ("config: 7", "DeepSpeed config must be a dict or a JSON file path, got int"),
    "config: missing file": ("config: missing", "cannot be read: No such file or directory"),
    "config: not JSON": ("config: not json", "is not valid JSON: Expecting"),
}


@pytest.mark.fault("refused", kind="bad input: Parm (one process)")
@pytest.mark.parametrize("case", list(PARM_SECTION))
def test_parm_section(case, tmp_path):
    from ds_plugins.config import ParmConfig

    section, want = PARM_SECTION[case]
    config = {"train_micro_batch_size_per_gpu": 1, "parm": section}
    if section == "config: 7":
        config = 7
    elif section == "config: missing":
        config = str(tmp_path / "missing.json")
    elif section == "config: not json":
        config = tmp_path / "ds.json"
        config.write_text('{"parm": {"enabled": true,}}')
    with pytest.raises(ValueError) as err:
        ParmConfig.from_deepspeed(config)
    assert want in str(err.value)
    if case.startswith("config: ") and case != "config: a number":
        assert str(tmp_path) in str(err.value)          # the file is named


LAYER_ARGS = {  # ParmMoE(**change) -> expected text
    "hidden_size 0": ({"hidden_size": 0}, "hidden_size=0 must be an integer >= 1"),
    "hidden_size '8'": ({"hidden_size": "8"}, "hidden_size='8' must be an integer >= 1"),
    "expert a string": ({"expert": "mlp"}, "expert=str must be a torch.nn.Module"),
    "num_experts 0": ({"num_experts": 0}, "num_experts=0 must be an integer >= 1"),
    "num_experts 2.5": ({"num_experts": 2.5}, "num_experts=2.5 must be an integer >= 1"),
    "ep_size 0": ({"ep_size": 0}, "num_experts=8 must be divisible by ep_size=0"),
    "ep_size 3": ({"ep_size": 3}, "num_experts=8 must be divisible by ep_size=3"),
    "k 0": ({"k": 0}, "k=0 must be an integer in [1, num_experts=8] (experts per token)"),
    "k 9": ({"k": 9}, "k=9 must be an integer in [1, num_experts=8]"),
    "k 1.5": ({"k": 1.5}, "k=1.5 must be an integer in [1, num_experts=8]"),
    "capacity_factor -1": ({"capacity_factor": -1.0}, "capacity_factor=-1.0 must be a finite number > 0"),
    "capacity_factor nan": ({"capacity_factor": math.nan}, "capacity_factor=nan must be a finite number > 0"),
    "capacity_factor inf": ({"capacity_factor": math.inf}, "capacity_factor=inf must be a finite number > 0"),
    "capacity_factor '1'": ({"capacity_factor": "1"}, "capacity_factor='1' must be a finite number > 0"),
    "eval_capacity_factor 0": ({"eval_capacity_factor": 0}, "eval_capacity_factor=0 must be a finite number"),
    "min_capacity -1": ({"min_capacity": -1}, "min_capacity=-1 must be an integer >= 0"),
    "min_capacity 2.5": ({"min_capacity": 2.5}, "min_capacity=2.5 must be an integer >= 0"),
    "noisy_gate_policy 'Gaussian'": ({"noisy_gate_policy": "Gaussian"}, "noisy_gate_policy='Gaussian' is not "
                                     "one of (None, 'None', 'Jitter', 'RSample')"),
    "drop_tokens 'no'": ({"drop_tokens": "no"}, "drop_tokens='no' must be True or False"),
    "use_rts 1": ({"use_rts": 1}, "use_rts=1 must be True or False"),
    "use_residual 'yes'": ({"use_residual": "yes"}, "use_residual='yes' must be True or False"),
    "enable_expert_tensor_parallelism None": ({"enable_expert_tensor_parallelism": None},
                                              "enable_expert_tensor_parallelism=None must be True or False"),
    "top2_2nd_expert_sampling 'x'": ({"top2_2nd_expert_sampling": "x"}, "top2_2nd_expert_sampling='x' "
                                                                        "must be"),
    "hidden_size 12, expert takes 8": ({"hidden_size": 12}, "hidden_size=12 but the expert's first layer "
                                       "takes 8 features: they must be equal"),
    "schedule 'parm'": ({"schedule": "parm"}, "parm schedule='parm' is not one of"),
    "overlap_chunks 0": ({"overlap_chunks": 0}, "parm overlap_chunks=0 must be an integer >= 1"),
    "debug 1": ({"debug": 1}, "parm debug=1 must be true or false"),
    "cost_cache 5": ({"cost_cache": 5}, "parm cost_cache=5 must be a file path"),
}


@pytest.mark.fault("refused", kind="bad input: Parm (one process)")
@pytest.mark.parametrize("case", list(LAYER_ARGS))
def test_parm_layer_arguments(case):
    from ds_plugins import ParmMoE
    from tests.ds_plugins.deepspeed_oracle import mlp

    change, want = LAYER_ARGS[case]
    args = dict(hidden_size=M, expert=mlp(M, H), num_experts=E)
    args.update(change)
    with pytest.raises(ValueError) as err:
        ParmMoE(**args)
    assert want in str(err.value)


def _routes():
    idx = torch.tensor([[0, 1, 2, -1, 0, 1]], dtype=torch.int32)
    loc = torch.tensor([[0, 0, 0, 0, 1, 1]], dtype=torch.int32)
    return torch.randn(6, 4), idx, loc, torch.rand(1, 6), torch.randn(3, 2, 4)


DISPATCH = {  # (op, change) -> expected text; cases not in tests/ds_plugins/test_dispatch_inputs.py
    "dispatch: x float8": (("dispatch", "x f8"), "x [S, M] must have dtype float16, bfloat16, float32, "
                           "float64, got torch.float8_e4m3fn"),
    "dispatch: num_experts '3'": (("dispatch", "E str"), "num_experts='3': must be an integer in "
                                                         "[1, 2147483647]"),
    "dispatch: num_experts 2.5": (("dispatch", "E float"), "num_experts=2.5: must be an integer in [1, "),
    "dispatch: num_experts True": (("dispatch", "E bool"), "num_experts=True: must be an integer in [1, "),
    "dispatch: capacity -1": (("dispatch", "C neg"), "capacity=-1: must be an integer in [0, 2147483647] "
                                                     "(locations are int32)"),
    "dispatch: locations int64": (("dispatch", "loc long"), "locations [k, S] must have dtype int32, got "
                                  "torch.int64"),
    "dispatch: locations a list": (("dispatch", "loc list"), "locations must be a torch.Tensor [k, S], "
                                                             "got list"),
    "dispatch: indices 3-d": (("dispatch", "idx 3d"), "indices must be 2-D [k, S], got shape (1, 1, 6)"),
    "combine: gates a list": (("combine", "gates list"), "gates must be a torch.Tensor [k, S], got list"),
    "combine: gates int": (("combine", "gates int"), "gates [k, S] must have dtype float32, float64, got "
                           "torch.int64"),
    "combine: expert_output int": (("combine", "eo int"), "expert_output [E, C, M] must have dtype float16, "
                                   "bfloat16, float32, float64, got torch.int32"),
    "combine: expert_output a tuple": (("combine", "eo tuple"), "expert_output must be a torch.Tensor "
                                                                "[E, C, M]"),
    "combine: indices on meta": (("combine", "idx meta"), "indices is on meta but gates [k, S] is on cpu"),
    "combine: slot collision": (("combine", "collision"), "routes (j=0, s=0) and (j=0, s=4) both claim "
                                                          "expert "
                                "0, location 0: a slot holds one token"),
}


@pytest.mark.fault("refused", kind="bad input: dispatch / combine")
@pytest.mark.parametrize("case", list(DISPATCH))
def test_dispatch_combine(case):
    from ds_plugins.dispatch import combine, dispatch

    (op, change), want = DISPATCH[case]
    x, idx, loc, gates, eo = _routes()
    e, c = 3, 2
    if change == "x f8":
        x = x.to(torch.float8_e4m3fn)
    elif change == "E str":
        e = "3"
    elif change == "E float":
        e = 2.5
    elif change == "E bool":
        e = True
    elif change == "C neg":
        c = -1
    elif change == "loc long":
        loc = loc.long()
    elif change == "loc list":
        loc = loc.tolist()
    elif change == "idx 3d":
        idx = idx[None]
    elif change == "gates list":
        gates = gates.tolist()
    elif change == "gates int":
        gates = gates.long()
    elif change == "eo int":
        eo = eo.int()
    elif change == "eo tuple":
        eo = (eo,)
    elif change == "idx meta":
        idx = idx.to("meta")
    elif change == "collision":
        loc = torch.zeros_like(loc)
    with pytest.raises(ValueError) as err:
        dispatch(x, idx, loc, e, c) if op == "dispatch" else combine(eo, idx, loc, gates)
    assert want in str(err.value)


def _megatron_parser():
    from tests.megatron_patches.test_args import _megatron_parser as megatron

    parser = megatron()
    parser.exit_on_error = False       # argparse raises ArgumentError instead of exiting
    return parser


BASE = "--context-parallel-size 8 --seq-length 4096 --num-attention-heads 8 --attention-dropout 0"

MEGATRON_ARGS = {  # extra command line -> expected text (argparse errors: the message it prints)
    "--commweave-timeout-s 0": "--commweave-timeout-s='0': the communication timeout must be a finite number "
                               "of seconds in [1, 604800]",
    "--commweave-timeout-s abc": "--commweave-timeout-s='abc': the communication timeout",
    "--commweave-timeout-s nan": "--commweave-timeout-s='nan': the communication timeout",
    "--commweave-timeout-s -5": "--commweave-timeout-s='-5': the communication timeout",
    "--commweave-timeout-s inf": "--commweave-timeout-s='inf': the communication timeout",
    "--wallfacer-bandwidth nan 1 1": "wallfacer bandwidths (nan, 1.0, 1.0) GB/s (3 numbers) and tflops 989.0 "
                                     "must be > 0, latencies (3.0, 10.0) us (2 numbers) >= 0, all finite",
    "--wallfacer-bandwidth 1 0 1": "wallfacer bandwidths (1.0, 0.0, 1.0) GB/s",
    "--wallfacer-latency -1 2": "latencies (-1.0, 2.0) us (2 numbers) >= 0",
    "--wallfacer-latency inf 2": "latencies (inf, 2.0) us (2 numbers) >= 0, all finite",
    "--wallfacer-tflops 0": "tflops 0.0 must be > 0",
    "--wallfacer-tflops nan": "tflops nan must be > 0",
    "--wallfacer-ranks-per-node 0": "wallfacer ranks_per_node=0 must be an integer >= 1",
    "--wallfacer-ranks-per-node -8": "wallfacer ranks_per_node=-8 must be an integer >= 1",
    "--wallfacer-kernel cudnn": "argument --wallfacer-kernel: invalid choice: 'cudnn'",
    "--wallfacer-backward both": "argument --wallfacer-backward: invalid choice: 'both'",
    "--wallfacer-network wifi": "argument --wallfacer-network: invalid choice: 'wifi'",
    "--wallfacer-placement random": "argument --wallfacer-placement: invalid choice: 'random'",
    "--wallfacer-team-size two": "argument --wallfacer-team-size: 'two' is not an integer or 'auto'",
    "--wallfacer-team-size 0": "wallfacer team_size=0 must be an int >= 1 or 'auto'",
    "--wallfacer-team-size -2": "wallfacer team_size=-2 must be an int >= 1 or 'auto'",
    "--wallfacer-team-size 3": "--wallfacer-team-size: team_size C=3 is invalid for P=8 ranks: C² must "
                               "divide P",
    "--context-parallel-size 6 --seq-length 4092 --wallfacer-team-size 2": "team_size C=2 is invalid for P=6 "
                                                                           "ranks",
    "--seq-length 4100": "--seq-length 4100 must be divisible by 2 x --context-parallel-size = 16",
    "--num-attention-heads 6 --tensor-model-parallel-size 4": "--num-attention-heads 6, --num-query-groups 6 "
                                                              "and --tensor-model-parallel-size 4",
    "--attention-dropout 0.05": "--attention-dropout 0.05: WallFacer has no attention dropout",
    "--cp-comm-type a2a+p2p": "--cp-comm-type a2a+p2p: WallFacer replaces",
}


@pytest.mark.fault("refused", kind="bad input: WallFacer (one process)")
@pytest.mark.parametrize("extra", list(MEGATRON_ARGS))
def test_megatron_arguments(extra):
    from megatron_patches.args import WallFacerConfig, add_wallfacer_args

    parser = add_wallfacer_args(_megatron_parser())
    with pytest.raises((ValueError, argparse.ArgumentError)) as err:
        WallFacerConfig.from_args(parser.parse_args(f"{BASE} {extra}".split()))
    assert MEGATRON_ARGS[extra] in str(err.value)


def test_megatron_timeout_argument_reaches_the_config():
    from megatron_patches.args import WallFacerConfig, add_wallfacer_args

    args = add_wallfacer_args(_megatron_parser()).parse_args(f"{BASE} --commweave-timeout-s 7.5".split())
    assert WallFacerConfig.from_args(args).timeout_s == 7.5
    assert WallFacerConfig.from_args(add_wallfacer_args(_megatron_parser()).parse_args(BASE.split())
                                     ).timeout_s is None


# ---------------------------------------------------------------------------------------------------------

SURFACES = {  # surface: (rank count, cases)
    "ParmMoE.forward, one rank or all": (WORLD, FORWARD),
    "ParmMoE set-up, settings differing on one rank": (WORLD, SETTINGS),
    "ds_plugins.initialize, one rank or all": (WORLD, INITIALIZE),
    "wallfacer_attention, one rank or all": (WORLD, ATTENTION),
    "WallFacerAttention, one rank or all": (WORLD, MODULE),
    '"parm" config section and file': (1, PARM_SECTION),
    "ParmMoE constructor": (1, LAYER_ARGS),
    "dispatch / combine": (1, DISPATCH),
    "Megatron arguments (add_wallfacer_args)": (1, MEGATRON_ARGS),
}


def test_case_count():
    """The table of the issue note: cases by surface and rank count (the launcher's 236 are elsewhere)."""
    counts = Counter({name: len(cases) for name, (_, cases) in SURFACES.items()})
    one_rank = sum(1 for _, cases in SURFACES.values() for c in cases.values()
                   if isinstance(c, tuple) and len(c) >= 3 and isinstance(c[0], int))
    print("\nbad-input cases by surface (ranks):")
    for name, (ranks, _) in SURFACES.items():
        print(f"  {name:50s} {ranks} ranks  {counts[name]:3d}")
    print(f"  total {sum(counts.values())}, of which {one_rank} give the bad value to one rank only")
    assert sum(counts.values()) >= 80
    json.dumps(counts)
