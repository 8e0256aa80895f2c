"""One MoE layer, forward + backward, side by side: DeepSpeed's installed MoE and ParmMoE's schedules.

    python -m benchmarks.moe_layer                 # the default config of issue 3
    python -m benchmarks.moe_layer --grid          # S1 vs S2 vs "auto" over a grid of layer configs

Default: 4 ranks (tp 2, ep 2) on gloo, E = 8, k = 2, M = 1024, FFN 4096, 4096 tokens per rank,
capacity factor 1.25, fp32, 4 overlap chunks. Rows:

    DeepSpeed MoE    deepspeed.moe.layer.MoE 0.19.8 with enable_expert_tensor_parallelism and a
                     Megatron-style tensor-parallel expert (megatron-core's copy / reduce mappings), as
                     Megatron-DeepSpeed runs it: drop, A2A, AG, expert with AR, drop, A2A, AG (parm.md §2.2)
    parm deepspeed   ParmMoE, schedule "deepspeed": the order Parm was measured against (§2.1)
    parm s1 / s2     ParmMoE, Parm's schedules (§2.3, §2.4) with the chunked overlap (§2.6)
    parm auto        ParmMoE, "auto" (its one-off micro-benchmark runs in the warm-up)
    ... all slots    the schedule with skip_empty_slots off (experts on all E·C slots, as DeepSpeed's): the
                     pair splits the gain into skipping empty slots (1 - 1/f of them or more) and the schedule
    compute only     the hardware limit of any schedule: the same gate, dispatch, sharded experts (filled
                     rows, FFN / tp columns) and combine on every rank, with no communication at all

Each row: median over iterations (rows interleaved) of the slowest rank's time, bytes per rank per group
from the ledger (DeepSpeed's collectives counted with commweave.comm.trace_torch_distributed), and the
speed-up over DeepSpeed. Then the alpha-beta model's *projections* (not measurements) for two GPU
clusters; a second table times the eval forward (``layer.eval()`` under ``torch.inference_mode()``) of
DeepSpeed's MoE and each ParmMoE schedule, "auto" included; and one JSON line of ratios. On gloo,
DeepSpeed's tensor-parallel token gather needs a shim (design/traps.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commweave import comm, ledger
from commweave.world import World


@dataclass(frozen=True)
class Config:
    ranks: int = 4
    tp: int = 2
    ep: int = 2
    experts: int = 8
    k: int = 2
    hidden: int = 1024
    ffn: int = 4096
    tokens: int = 4096
    capacity_factor: float = 1.25
    chunks: int = 4
    dtype: str = "fp32"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALL_SLOTS = " all slots"
ROWS = ("DeepSpeed MoE", "parm deepspeed", "parm deepspeed" + ALL_SLOTS, "parm s1", "parm s1" + ALL_SLOTS,
        "parm s2", "parm s2" + ALL_SLOTS, "parm auto", "compute only")


def _gloo_gather_tokens(input_, dim=0):
    """DeepSpeed's ``_gather_tokens`` with a ``[tp·d0, ...]`` buffer: gloo rejects its flat one. It reads the
    mpu through DeepSpeed's bwc helpers, as the original does, so any mpu DeepSpeed accepts works here."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

    tp = bwc_tensor_model_parallel_world_size(groups.mpu)
    input_ = input_.contiguous()
    buf = input_.new_empty((tp * input_.shape[0], *input_.shape[1:]))
    dist.all_gather_into_tensor(buf, input_, group=bwc_tensor_model_parallel_group(groups.mpu))
    return torch.cat(buf.chunk(tp), dim=dim).contiguous()


class _TensorParallelMLP(nn.Module):
    """Megatron-DeepSpeed's expert with expert tensor parallelism: column-parallel fc1, row-parallel fc2."""

    def __init__(self, m: int, h: int, tp: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(m, h // tp), nn.Linear(h // tp, m)

    def forward(self, x):
        from deepspeed.utils import groups
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        group = groups.mpu.get_tensor_model_parallel_group()
        h = F.gelu(self.fc1(copy_to_tensor_model_parallel_region(x, group)))
        return reduce_from_tensor_model_parallel_region(F.linear(h, self.fc2.weight), group) + self.fc2.bias


def _layer(row: str, cfg: Config, cost_cache: str | None = None):
    """The row's layer; ``cost_cache`` goes to ParmMoE (the "auto" selector's fitted costs file)."""
    from deepspeed.moe.layer import MoE

    from ds_plugins import ParmMoE

    kw = dict(num_experts=cfg.experts, ep_size=cfg.ep, k=cfg.k, capacity_factor=cfg.capacity_factor,
              eval_capacity_factor=cfg.capacity_factor, min_capacity=0, enable_expert_tensor_parallelism=True)
    if row == "DeepSpeed MoE":
        expert = _TensorParallelMLP(cfg.hidden, cfg.ffn, cfg.tp) if cfg.tp > 1 else \
            nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
        layer = MoE(cfg.hidden, expert, **kw)
    else:
        expert = nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
        skip = not row.endswith(ALL_SLOTS)
        layer = ParmMoE(cfg.hidden, expert, schedule=row.removesuffix(ALL_SLOTS).split()[-1],
                        overlap_chunks=cfg.chunks, skip_empty_slots=skip, cost_cache=cost_cache, **kw)
    layer.set_deepspeed_parallelism()
    if cfg.ep > 1:
        comm.set_group_name(layer.deepspeed_moe.ep_group, "ep")  # DeepSpeed's own group, as ParmMoE names it
    _load_weights(layer, cfg)
    return layer.to(DTYPES[cfg.dtype])


def _load_weights(layer, cfg: Config) -> None:
    """The same gate and experts in every row: global expert e's weights come from seed e, and each rank
    keeps its local experts' tensor-parallel shards (DeepSpeed's TP expert and ParmMoE shard alike)."""
    from deepspeed.utils import groups

    ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
    q = 0 if groups.mpu is None else groups.mpu.get_tensor_model_parallel_rank()
    h = cfg.ffn // cfg.tp
    rows = slice(q * h, (q + 1) * h)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(torch.randn(cfg.experts, cfg.hidden,
                                                             generator=torch.Generator().manual_seed(2)))
        for j, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(100 + ep_rank * layer.num_local_experts + j)
            w1 = torch.randn(cfg.ffn, cfg.hidden, generator=g) / cfg.hidden ** 0.5
            w2 = torch.randn(cfg.hidden, cfg.ffn, generator=g) / cfg.ffn ** 0.5
            fc1, fc2 = (expert.fc1, expert.fc2) if hasattr(expert, "fc1") else (expert[0], expert[2])
            fc1.weight.copy_(w1[rows] if fc1.weight.shape[0] == h else w1)
            fc2.weight.copy_(w2[:, rows] if fc2.weight.shape[1] == h else w2)
            fc1.bias.zero_()
            fc2.bias.zero_()


def _step(layer, x, go) -> None:
    out, l_aux, _ = layer(x)
    ((out * go).sum() + l_aux).backward()


def _compute_only(layer, x, go) -> None:
    """An S2 layer's local work, its groups taken away: the exchanges become local reshapes of the same
    sizes (this rank's buffer stands for every EP source's, its fill counts for theirs)."""
    from ds_plugins import overlap, routing, schedules

    g, r = layer.parm_groups, routing.route(layer.gate, x)
    alone = replace(g, mp=None, esp=None, ep=None, mp_size=1, mp_rank=0, esp_size=1, esp_rank=0)
    lay = overlap.Layout(alone, layer.num_experts, 1, r.capacity, mp_split=False)
    ((schedules._expert_pass(layer, x, r, lay) * go).sum() + r.l_aux).backward()


_MPUS: dict[int, object] = {}
_EXPERT_DICTS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS")
_MADE: dict[tuple[int, int], dict] = {}  # (tp, ep) -> the expert groups DeepSpeed's MoE made for it, reused


def in_layout(rank_fn):
    """Run ``rank_fn(cfg, ...)`` with DeepSpeed's process-wide MoE state set for ``cfg``'s layout (its mpu,
    expert-TP size, expert groups, the gloo token gather) and put back as it was afterwards.

    A rank process outlives one call: the test worlds run DeepSpeed's own engine after a benchmark, and a
    pipeline engine installs its grid as ``groups.mpu``; this module's gather left installed met that grid
    there (issue 23's order-dependent failure). The groups made for a layout are kept and reinstalled on the
    next call of that layout, so a sweep creates each process group once."""

    @functools.wraps(rank_fn)
    def run(cfg: Config, *args, **kwargs):
        import deepspeed
        from deepspeed.moe import mappings
        from deepspeed.utils import groups

        from ds_plugins.groups import ModelParallelUnit

        deepspeed.init_distributed(dist_backend="gloo")
        name, key = f"ep_size_{cfg.ep}", (cfg.tp, cfg.ep)
        saved = (groups.mpu, groups.expert_tensor_parallel_world_size, mappings._gather_tokens,
                 {d: dict(getattr(groups, d)) for d in _EXPERT_DICTS})
        made = _MADE.setdefault(key, {})
        for d in _EXPERT_DICTS:
            table = getattr(groups, d)
            table.pop(name, None)  # another layout's groups of the same name (a pipeline's per stage)
            if d in made:
                table[name] = made[d]
        mappings._gather_tokens = _gloo_gather_tokens
        if cfg.tp > 1 and cfg.tp not in _MPUS:
            _MPUS[cfg.tp] = ModelParallelUnit(cfg.tp)
        groups.mpu = _MPUS.get(cfg.tp)
        groups.expert_tensor_parallel_world_size = cfg.tp
        try:
            return rank_fn(cfg, *args, **kwargs)
        finally:
            groups.mpu, groups.expert_tensor_parallel_world_size, mappings._gather_tokens, tables = saved
            for d in _EXPERT_DICTS:
                table = getattr(groups, d)
                if name in table:
                    made[d] = table[name]
                table.clear()
                table.update(tables[d])
    return run


@in_layout
def _rank_outputs(cfg: Config, rows: tuple[str, ...]) -> dict:
    """Every row's output and input gradient for one batch: the rows compute the same function."""
    torch.manual_seed(100 + dist.get_rank() // cfg.tp)
    x = torch.randn(cfg.tokens, cfg.hidden, requires_grad=True)
    go = torch.randn(cfg.tokens, cfg.hidden)
    out = {}
    for row in rows:
        out_row, _, _ = _layer(row, cfg)(x)
        (out_row * go).sum().backward()
        out[row] = (out_row.detach(), x.grad)
        x.grad = None
    return out


@in_layout
def _rank_bench(cfg: Config, rows: tuple[str, ...], iters: int, warmup: int) -> dict:
    world = dist.group.WORLD
    torch.manual_seed(100 + dist.get_rank() // cfg.tp)
    dtype = DTYPES[cfg.dtype]
    x = torch.randn(cfg.tokens, cfg.hidden, dtype=dtype, requires_grad=True)
    go = torch.randn(cfg.tokens, cfg.hidden, dtype=dtype)
    layers = {row: _layer(row if row != "compute only" else "parm s2", cfg) for row in rows}
    steps = {row: _compute_only if row == "compute only" else _step for row in rows}
    times: dict[str, list[float]] = {row: [] for row in rows}
    cpu: dict[str, list[float]] = {row: [] for row in rows}
    for i in range(warmup + iters):
        for row in rows:  # rows interleaved, so that the machine's load drifts affect them alike
            comm.all_reduce(torch.zeros(1), world)
            t0, c0 = time.perf_counter(), time.process_time()
            steps[row](layers[row], x, go)
            wall = torch.tensor([time.perf_counter() - t0])
            work = torch.tensor([time.process_time() - c0])  # this rank's CPU seconds, all its threads
            comm.all_reduce(wall, world, op="max")
            comm.all_reduce(work, world)
            layers[row].zero_grad(set_to_none=True)
            x.grad = None
            if i >= warmup:
                times[row].append(wall.item() * 1e3)
                cpu[row].append(work.item() * 1e3)
    result = {}
    for row in rows:
        with ledger.recording() as led, comm.trace_torch_distributed():
            steps[row](layers[row], x, go)
        layers[row].zero_grad(set_to_none=True)
        result[row] = {"ms": times[row], "cpu_ms": cpu[row],
                       "bytes": {key: v["sent"] for key, v in led.as_dict().items()},
                       "schedule": getattr(layers[row], "last_schedule", None),
                       "predicted_ms": _predicted(cfg) if row == "parm auto" else {}}
    return result


EVAL_ROWS = ("DeepSpeed MoE", "parm deepspeed", "parm s1", "parm s2", "parm auto")


@in_layout
def _rank_eval(cfg: Config, rows: tuple[str, ...], iters: int, warmup: int) -> dict:
    """Eval forward of every row: ``layer.eval()`` under ``torch.inference_mode()`` (the eval capacity factor
    is the training one here), rows interleaved, the slowest rank's wall time."""
    world = dist.group.WORLD
    torch.manual_seed(100 + dist.get_rank() // cfg.tp)
    x = torch.randn(cfg.tokens, cfg.hidden, dtype=DTYPES[cfg.dtype])
    layers = {row: _layer(row, cfg).eval() for row in rows}
    times: dict[str, list[float]] = {row: [] for row in rows}
    with torch.inference_mode():
        for i in range(warmup + iters):
            for row in rows:
                comm.all_reduce(torch.zeros(1), world)
                t0 = time.perf_counter()
                layers[row](x)
                wall = torch.tensor([time.perf_counter() - t0])
                comm.all_reduce(wall, world, op="max")
                if i >= warmup:
                    times[row].append(wall.item() * 1e3)
        result = {}
        for row in rows:
            with ledger.recording() as led, comm.trace_torch_distributed():
                layers[row](x)
            result[row] = {"ms": times[row], "bytes": {key: v["sent"] for key, v in led.as_dict().items()},
                           "schedule": getattr(layers[row], "last_schedule", None)}
    return result


def _print_eval(cfg: Config, res: dict) -> dict:
    """The eval-forward table; returns its ratios for the JSON line."""
    base = res["DeepSpeed MoE"]["ms"]
    print(f"\nMoE layer eval forward (layer.eval(), torch.inference_mode()), {cfg.ranks} gloo ranks; "
          "paired: median of per-iteration DeepSpeed/row ratios\n")
    print(f"{'row':<28}{'wall ms':>9}{'speed-up':>9}{'paired':>8}{'A2A ep MB':>10}{'ESP MB':>8}{'MP MB':>8}"
          "  wall per iteration (ms)")
    ratios = {}
    for row, r in res.items():
        med = statistics.median(r["ms"])
        paired = statistics.median(d / t for d, t in zip(base, r["ms"], strict=True))
        sent = r["bytes"]
        label = row if row != "parm auto" else f"parm auto ({r['schedule']})"
        print(f"{label:<28}{med:>9.1f}{statistics.median(base) / med:>9.2f}{paired:>8.2f}"
              f"{sent.get('all_to_all@ep', 0) / 1e6:>10.2f}{_group_mb(sent, 'esp'):>8.2f}"
              f"{_group_mb(sent, 'mp'):>8.2f}  " + " ".join(f"{t:.1f}" for t in r["ms"]))
        if row != "DeepSpeed MoE":
            ratios[f"eval_paired_speedup_{row.removeprefix('parm ')}_vs_deepspeed_moe"] = paired
    ratios["eval_auto_schedule"] = res["parm auto"]["schedule"]
    return ratios


def _layer_shape(cfg: Config):
    from ds_plugins.cost_model import LayerShape

    return LayerShape(tokens=cfg.tokens, hidden=cfg.hidden, ffn=cfg.ffn, experts=cfg.experts, k=cfg.k,
                      capacity_factor=cfg.capacity_factor, mp=cfg.tp, ep=cfg.ep, esp=cfg.tp,
                      chunks=cfg.chunks, elem_bytes=DTYPES[cfg.dtype].itemsize)


def _predicted(cfg: Config) -> dict:
    """The "auto" selector's predicted fwd+bwd ms of each schedule it chose from for this config."""
    from ds_plugins import selector

    for (_, shape), decision in selector.decisions().items():
        if shape == _layer_shape(cfg):
            return {s: t * 1e3 for s, t in decision["predicted_s"].items()}
    return {}


def _group_mb(sent: dict, group: str) -> float:
    return sum(v for key, v in sent.items() if key.endswith("@" + group)) / 1e6


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run_default(cfg: Config, iters: int, warmup: int) -> dict:
    load_before = _load()
    with World(cfg.ranks, timeout=3600) as world:
        res = world.run(_rank_bench, cfg, ROWS, iters, warmup, timeout=3600)[0]
        evals = world.run(_rank_eval, cfg, EVAL_ROWS, iters, warmup, timeout=3600)[0]
    load_after = _load()
    med = {row: statistics.median(r["ms"]) for row, r in res.items()}
    cpu = {row: statistics.median(r["cpu_ms"]) for row, r in res.items()}
    base = med["DeepSpeed MoE"]
    paired = {row: statistics.median(d / t for d, t in zip(res["DeepSpeed MoE"]["ms"], r["ms"], strict=True))
              for row, r in res.items()}
    print(f"\nMoE layer fwd+bwd, {cfg.ranks} gloo ranks on {os.cpu_count()} cores, config {asdict(cfg)}")
    print(f"load average before {load_before}, after {load_after}")
    print("wall: slowest rank, median of the iterations; paired: median of per-iteration DeepSpeed/row "
          "ratios (rows interleaved); CPU: all ranks' CPU seconds (every thread), median\n")
    print(f"{'row':<28}{'wall ms':>9}{'speed-up':>9}{'paired':>8}{'CPU s':>8}{'CPU x':>7}{'A2A ep MB':>10}"
          f"{'ESP MB':>8}{'MP MB':>8}{'other MB':>9}  wall per iteration (ms)")
    for row, r in res.items():
        sent = r["bytes"]
        a2a_ep = sent.get("all_to_all@ep", 0) / 1e6
        other = sum(sent.values()) / 1e6 - sum(_group_mb(sent, g) for g in ("esp", "mp")) - a2a_ep
        label = row if row != "parm auto" else f"parm auto ({r['schedule']})"
        print(f"{label:<28}{med[row]:>9.0f}{base / med[row]:>9.2f}{paired[row]:>8.2f}{cpu[row] / 1e3:>8.2f}"
              f"{cpu['DeepSpeed MoE'] / cpu[row]:>7.2f}{a2a_ep:>10.2f}{_group_mb(sent, 'esp'):>8.2f}"
              f"{_group_mb(sent, 'mp'):>8.2f}{other:>9.2f}  " + " ".join(f"{t:.0f}" for t in r["ms"]))
    a2a = {row: r["bytes"].get("all_to_all@ep", 0) for row, r in res.items()}
    skip_gain = {s: statistics.median(a / b for a, b in zip(res[f"parm {s}{ALL_SLOTS}"]["ms"],
                                                             res[f"parm {s}"]["ms"], strict=True))
                 for s in ("deepspeed", "s1", "s2")}
    print("\nskipping empty slots, paired wall ratio all slots / filled rows: " +
          ", ".join(f"{s} {g:.2f}x" for s, g in skip_gain.items()))
    steps = attribution({row: r["ms"] for row, r in res.items()})
    print_attribution(steps)
    print("\nPROJECTIONS (alpha-beta model, not measured): the same layer, MP = ESP = GPUs per node, "
          "EP = nodes")
    projections = _print_projections(cfg)
    ratios = {
        "speedup_s1_vs_deepspeed_moe": base / med["parm s1"],
        "speedup_s2_vs_deepspeed_moe": base / med["parm s2"],
        "speedup_auto_vs_deepspeed_moe": base / med["parm auto"],
        "speedup_s1_all_slots_vs_deepspeed_moe": base / med["parm s1" + ALL_SLOTS],
        "speedup_s2_all_slots_vs_deepspeed_moe": base / med["parm s2" + ALL_SLOTS],
        "paired_speedup_s1": paired["parm s1"], "paired_speedup_s2": paired["parm s2"],
        "paired_skip_gain_s1": skip_gain["s1"], "paired_skip_gain_s2": skip_gain["s2"],
        "paired_skip_gain_deepspeed": skip_gain["deepspeed"],
        "cpu_speedup_s1": cpu["DeepSpeed MoE"] / cpu["parm s1"],
        "cpu_speedup_s2": cpu["DeepSpeed MoE"] / cpu["parm s2"],
        "auto_schedule": res["parm auto"]["schedule"],
        "a2a_bytes_parm_deepspeed_over_s1": a2a["parm deepspeed"] / a2a["parm s1"],
        "a2a_bytes_parm_deepspeed_over_s2": a2a["parm deepspeed"] / a2a["parm s2"],
        "a2a_bytes_deepspeed_moe_over_s2": a2a["DeepSpeed MoE"] / a2a["parm s2"],
        "projected_speedup_best_parm_vs_deepspeed_moe": projections,
        "attribution": {f"{s['schedule']}: {s['step']}": round(s["paired"], 3) for s in steps},
        "load_avg": load_after, "speedup_limit_compute_only_vs_deepspeed_moe": base / med["compute only"]}
    ratios.update(_print_eval(cfg, evals))
    print(json.dumps(ratios))
    return ratios


ATTRIBUTION = (("DeepSpeed MoE 0.19.8", "DeepSpeed MoE"),
               ("`deepspeed` order with the fused dispatch", "parm deepspeed" + ALL_SLOTS),
               ("+ {schedule}", "parm {schedule}" + ALL_SLOTS),
               ("+ skipping empty slots", "parm {schedule}"))
"""The speed-up split into steps, each row adding one thing to the row above it (per schedule)."""


def attribution(ms: dict[str, list[float]]) -> list[dict]:
    """Per schedule S1, S2: each step's paired ratio (median over iterations i of previous_i / row_i,
    the rows interleaved in one run) and the cumulative paired ratio against DeepSpeed's MoE."""
    steps = []
    for schedule in ("s1", "s2"):
        previous = base = ms[ATTRIBUTION[0][1]]
        for step, row in ATTRIBUTION:
            step, row = step.format(schedule=schedule.upper()), row.format(schedule=schedule)
            times = ms[row]
            steps.append({"schedule": schedule, "step": step, "row": row, "ms": statistics.median(times),
                          "paired": statistics.median(p / t for p, t in zip(previous, times, strict=True)),
                          "cumulative": statistics.median(b / t for b, t in zip(base, times, strict=True))})
            previous = times
    return steps


def print_attribution(steps: list[dict]) -> None:
    print("\nattribution of the speed-up (each step: paired ratio to the step above, from this one run)")
    print(f"{'step':<44}{'row':<26}{'wall ms':>9}{'step':>8}{'vs DeepSpeed MoE':>18}")
    for s in steps:
        print(f"{s['step']:<44}{s['row']:<26}{s['ms']:>9.0f}{s['paired']:>7.2f}x{s['cumulative']:>17.2f}x")


def _print_projections(cfg: Config) -> dict:
    from ds_plugins.cost_model import CLUSTERS, cluster_costs, predict

    out = {}
    for cl in CLUSTERS:
        sh = replace(_layer_shape(cfg), mp=cl.gpus_per_node, esp=cl.gpus_per_node, ep=cl.nodes)
        if sh.experts % sh.ep or sh.ffn % sh.esp:
            sh = replace(sh, experts=max(sh.experts, sh.ep))
        t = {s: predict(s, sh, cluster_costs(cl, sh)).total * 1e3
             for s in ("ds-installed", "deepspeed", "s1", "s2")}
        best = min(t["s1"], t["s2"])
        print(f"  {cl.name} (tp={sh.mp}, ep={sh.ep}, E={sh.experts}): " +
              ", ".join(f"{s} {v:.2f} ms" for s, v in t.items()) +
              f"; best Parm vs DeepSpeed MoE {t['ds-installed'] / best:.2f}x, vs baseline A "
              f"{t['deepspeed'] / best:.2f}x")
        out[cl.name] = round(t["ds-installed"] / best, 3)
    return out


GRID_BASE = Config(tokens=2048, hidden=1024, ffn=1024, chunks=4)


TIE = 0.05
"""Measured S1 and S2 times closer than this (relative) are a tie: either pick is right."""


def grid_configs() -> list[Config]:
    """24 layer configs on 4 ranks: (tp, ep) x (k, capacity factor), k·f from 0.5 to 4, x tokens per rank
    x overlap chunks. S1 gates N times fewer tokens but adds four MP collectives (the AG of the output and
    its dual, the all-reduces of the loss statistics and gate gradients, §2.7); S2 gathers k·f·S·M over MP
    in r chunks. Few tokens (256) make the collectives' fixed costs dominate, where S2 can win."""
    return [replace(GRID_BASE, tp=tp, ep=ep, k=k, capacity_factor=cf, tokens=tokens, chunks=chunks)
            for tp, ep in ((2, 2), (4, 1)) for k, cf in ((1, 0.5), (2, 1.25), (2, 2.0))
            for tokens in (256, 2048) for chunks in (1, 4)]


def run_grid(iters: int, warmup: int) -> dict:
    """S1 and S2 timed side by side (interleaved) per config; "auto" is judged on the paired ratio, the
    median over iterations of s1_i / s2_i, which cancels most of the machine's load drift."""
    rows = ("parm s1", "parm s2", "parm auto")
    print(f"\nS1 vs S2 vs auto over {len(grid_configs())} configs, 4 gloo ranks; load average {_load()}")
    print(f"{'tp':>3}{'ep':>3}{'k':>3}{'cf':>5}{'S':>6}{'r':>3}{'s1 ms':>8}{'s2 ms':>8}{'s1/s2':>7}"
          f"{'CPU s1/s2':>10}{'faster':>7}{'auto':>5}{'pred s1':>9}{'pred s2':>9}"
          f"  auto right? (tie: within {TIE:.0%})")
    hits, ties, regrets, results = 0, 0, [], []
    with World(4, timeout=3600) as world:
        for cfg in grid_configs():
            res = world.run(_rank_bench, cfg, rows, iters, warmup, timeout=3600)[0]
            pred = res["parm auto"]["predicted_ms"]
            s1, s2 = (statistics.median(res[r]["ms"]) for r in ("parm s1", "parm s2"))
            pairs = zip(res["parm s1"]["ms"], res["parm s2"]["ms"], strict=True)
            ratio = statistics.median(a / b for a, b in pairs)
            cpu = statistics.median(res["parm s1"]["cpu_ms"]) / statistics.median(res["parm s2"]["cpu_ms"])
            faster, auto = ("s1" if ratio <= 1 else "s2"), res["parm auto"]["schedule"]
            tie = abs(ratio - 1) <= TIE
            hits += faster == auto
            ties += faster != auto and tie
            regrets.append(max(ratio, 1 / ratio) - 1 if faster != auto else 0.0)
            results.append({"config": asdict(cfg), "s1_ms": s1, "s2_ms": s2, "s1_over_s2": ratio,
                            "auto": auto, "predicted": pred})
            print(f"{cfg.tp:>3}{cfg.ep:>3}{cfg.k:>3}{cfg.capacity_factor:>5}{cfg.tokens:>6}{cfg.chunks:>3}"
                  f"{s1:>8.1f}{s2:>8.1f}{ratio:>7.2f}{cpu:>10.2f}{faster:>7}{auto:>5}"
                  f"{pred.get('s1', 0):>9.1f}{pred.get('s2', 0):>9.1f}"
                  f"  {'yes' if faster == auto else 'tie' if tie else 'NO'}")
    summary = {"grid_configs": len(results), "auto_picked_faster": hits,
               "s1_faster_beyond_tie": sum(r["s1_over_s2"] < 1 - TIE for r in results),
               "s2_faster_beyond_tie": sum(r["s1_over_s2"] > 1 + TIE for r in results),
               "auto_picked_faster_fraction": hits / len(results),
               "auto_picked_faster_or_tie_fraction": (hits + ties) / len(results), "tie_band": TIE,
               "auto_mean_regret": statistics.mean(regrets), "auto_max_regret": max(regrets),
               "load_avg": _load()}
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Config()
    for name, value in asdict(defaults).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--grid", action="store_true", help="S1 vs S2 vs auto over 24 configs")
    args = p.parse_args(argv)
    if args.grid:
        run_grid(args.iters, args.warmup)
        return
    cfg = Config(**{name: getattr(args, name) for name in asdict(defaults)})
    run_default(cfg, args.iters, args.warmup)


if __name__ == "__main__":
    main()
