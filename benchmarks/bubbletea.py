"""BubbleTea on CPU ranks: training step time with and without prefill in the bubbles, side by side.

    python -m benchmarks.bubbletea [--wan-ms 10] [--pairs 12] [--replicas R] [--bind auto|on|off] ...
    python -m benchmarks.bubbletea --hf DIR | --hf-tiny llama|gpt2 ...    # a Hugging Face causal LM
    python -m benchmarks.bubbletea --tail-quantile 0.9 --versus-quantile 0 --pairs 48   # two start rules

A DeepSpeed pipeline (2 stages x ``--replicas`` data-parallel replicas, gloo, one intra-op thread per
rank, the training of examples/bubbletea_pipeline.py) with an emulated one-way WAN latency on every
pipeline transfer (``--wan-ms``: its stages wait on the WAN as across data centers). Each rank keeps
``--outstanding`` prompts queued for its own copy of a small causal LM (0: the windows open with nothing
to prefill, which prices the window signalling and the service's wake-ups alone): the project's
CausalLM, or with ``--hf DIR`` a local Hugging Face model (``--hf-tiny llama|gpt2``: a random one of
CausalLM's size, saved to a temporary directory, for a machine with nothing downloaded).

Each rank stands for a GPU, and BubbleTea's premise is that a rank's bubble is idle hardware. ``--bind``
gives every rank (and the prefill service it starts, which inherits the mask) its own share of the cores,
as ``deepspeed --bind_cores_to_rank`` does: then a bubble is this rank's cores idling, and the service
can only use those. With more ranks than cores (``--bind off``, e.g. 2 replicas on 2 cores) a rank's
bubble is mostly the other stage's compute on the same cores, so the prefill competes with training for
them (at SCHED_IDLE priority; still a few percent): that measures the CPU's oversubscription, not
BubbleTea. Default replicas: 2 where there are 4 or more cores, else 1 (one rank per core).

In one process tree, after ``--warmup`` iterations:
- ``--pairs`` cycles of three iterations: *stock* (DeepSpeed's own PipelineEngine class, no BubbleTea
  code on the path), *on* (BubbleTea prefilling), *profile* (BubbleTea's tracing without prefill: what
  the windows are measured from). Cycle i runs the arms in the (i mod 6)-th of their 6 orders, so over
  6 cycles every arm holds every place and every arm follows every other equally often (a chunk still
  running when an *on* iteration ends falls on stock and profile alike). The slowdown is the median
  over cycles of on / stock step time (rank 0's ``train_batch`` wall time; every rank's is within the
  noise of it);
- ``--steady`` iterations (or more, up to 10x, until every rank finished 3 prompts submitted in this
  phase) with BubbleTea on: time to first token of the prompts submitted and finished there.

Utilisation per rank is (training compute + prefill) / wall time of the iteration, union of spans;
training compute counts every instruction but the pipeline waits (sends, receives, the loss broadcast).
Prints a table and ends with one JSON line of ratios. The machine's load average is printed too:
figures taken on a busy 2-core machine are not worth much.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import statistics
import tempfile
import time

from benchmarks.sleeping_chunks import SleepingChunks
from benchmarks.start_rules import attribute, check_pairs, compare, rule_of
from commweave.world import World
from launch.bubbletea.windows import WAITS

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _each_thread(apply) -> None:
    """``apply(tid)`` for every thread of this rank (the training thread, gloo's and DeepSpeed's);
    threads and processes started later inherit nice and CPU mask from their creator."""
    for tid in os.listdir("/proc/self/task"):
        apply(int(tid))


def core_shares(cpus: list[int], ranks: int) -> list[list[int]]:
    """``deepspeed --bind_cores_to_rank``'s split: rank r gets the r-th run of len(cpus) // ranks cores."""
    k = len(cpus) // ranks
    if k < 1:
        raise ValueError(f"{ranks} ranks cannot each have a core of {len(cpus)} ({cpus})")
    return [cpus[r * k:(r + 1) * k] for r in range(ranks)]


class GCPauses:
    """The cyclic garbage collector's pauses in this process (``gc.callbacks``): seconds in all, full
    (generation 2) collections, the longest pause."""

    def __init__(self) -> None:
        self.seconds, self.full, self.longest, self._t0 = 0.0, 0, 0.0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._t0
        self.seconds += pause
        self.full += info["generation"] == 2
        self.longest = max(self.longest, pause)

    def remove(self) -> None:
        gc.callbacks.remove(self)


class Collect:
    """A later stage's callback (pipelined): its results, nothing submitted (prompts enter at stage 0)."""

    def __init__(self) -> None:
        self.results = []

    def __call__(self, result) -> None:
        result.cache = None
        self.results.append(result)


def bench_rank(cfg: dict) -> dict:
    """One rank's part: build, warm up, run the cycles and the steady phase, return its measurements."""
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from commweave import comm
    from examples.bubbletea_pipeline import ClosedLoop, build_engine, data, emulate_wan_latency
    from launch.bubbletea import PrefillServer
    from launch.bubbletea.engine import BubbleTeaPipelineEngine, enable

    if cfg["cores"]:
        _each_thread(lambda tid: os.sched_setaffinity(tid, cfg["cores"][dist.get_rank()]))
    engine = build_engine(cfg["hidden"], cfg["layers"], cfg["micro_batches"], cfg["batch"])
    if cfg["atlas"]:               # ATLAS's multi-TCP temporal p2p over the namespaces' emulated WAN
        from launch.run.runtime import enable_deepspeed

        wan = enable_deepspeed(atlas_plan(cfg), ifname=cfg["ifname"])
    else:
        wan = emulate_wan_latency(cfg["wan_ms"] / 1e3)
    lm = SleepingChunks(prefill_spec(cfg)) if cfg["sleeping_chunks"] else prefill_spec(cfg)
    stage, stages = engine.stage_id, engine.num_stages
    pipeline, spec = None, lm
    if cfg["pipelined"]:           # the inference model's layers split over the training stages
        from launch.bubbletea.hf_pipelined import split_hf
        from launch.bubbletea.pipelined import pipeline_setup, shared_key, split

        spec = (split_hf if cfg.get("hf") else split)(lm, stages)[stage]
        pipeline = pipeline_setup(stage, stages, "127.0.0.1", shared_key(dist.group.WORLD))
    server = PrefillServer(spec, cfg["chunk"], callback=lambda r: loop(r), guard=cfg["guard_ms"] / 1e3,
                           nice=cfg["prefill_nice"], idle=cfg["prefill_idle"], pipeline=pipeline,
                           tail_quantile=cfg["tail_quantile"] or None)
    if cfg["pipelined"]:
        from launch.bubbletea.pipelined import link_stages

        link_stages(server, dist.group.WORLD)
    # pipelined, prompts enter at the first stage and finish (first token) at the last
    feeds, last = not cfg["pipelined"] or stage == 0, not cfg["pipelined"] or stage == stages - 1
    loop = (ClosedLoop(server, cfg["outstanding"], cfg["prompt"], first_id=dist.get_rank() * 10**6) if feeds
            else Collect())
    if cfg["nice"]:
        _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, cfg["nice"]))
    bt = enable(engine, server, warmup=0, reprofile_every=0, history=cfg["history"])
    step = 0
    pauses = GCPauses()
    collected = {a: [0.0, 0, 0.0] for a in ("stock", "on", "profile")}   # GC ms, full GCs, longest ms
    on_spans = []                         # (start, end) of every on iteration (--versus-quantile)

    def run(arm: str) -> float:
        nonlocal step
        engine.__class__ = PipelineEngine if arm == "stock" else BubbleTeaPipelineEngine
        bt.enabled = arm == "on"
        batches = data(engine, step, cfg["batch"], cfg["hidden"])
        dist.barrier()
        before, full, pauses.longest = pauses.seconds, pauses.full, 0.0
        t0 = time.perf_counter()
        engine.train_batch(batches)
        wall = time.perf_counter() - t0
        if arm == "on":
            on_spans.append((t0, t0 + wall))
        c = collected[arm]
        c[0], c[1] = c[0] + 1e3 * (pauses.seconds - before), c[1] + pauses.full - full
        c[2] = max(c[2], 1e3 * pauses.longest)
        engine.__class__ = BubbleTeaPipelineEngine
        step += 1
        return wall

    for _ in range(cfg["warmup"]):
        run("profile")
    collected.update((a, [0.0, 0, 0.0]) for a in collected)        # the cycles' and steady phase's only
    if cfg["windows"] != "measured":
        bt.plan, bt.windows_from = simulated_windows(cfg, bt, engine), cfg["windows"]
    orders = list(itertools.permutations(("stock", "on", "profile")))
    walls = {a: [] for a in orders[0]}
    rules = start_rules(cfg)
    cycle_rules = [rule_of(i, rules) if rules else rules for i in range(cfg["pairs"])]
    for i in range(cfg["pairs"]):
        for arm in orders[i % len(orders)]:
            if arm == "on" and rules:             # before the iteration's plan, which prices with it
                server.set_tail_quantile(cycle_rules[i])
            walls[arm].append(run(arm))
    if rules:
        server.set_tail_quantile(rules[0])
    compared = list(on_spans)
    # steady: at least --steady iterations, more (up to 10x) until every rank finished 3 prompts
    # submitted in this phase, so that their time to first token is measured
    t_steady, n, finished = time.perf_counter(), 0, torch.zeros(1)
    while n < cfg["steady"] or (cfg["outstanding"] and finished.item() < 3 and n < 10 * cfg["steady"]):
        walls["on"].append(run("on"))
        n += 1
        finished[0] = sum(r.submitted >= t_steady for r in list(loop.results))
        comm.all_reduce(finished, dist.group.WORLD, op="min")
    bt.wait_idle()
    steady_s = time.perf_counter() - t_steady
    its = bt.iterations
    on = [it for it in its if it.prefill_on]
    off = [it for it in its if not it.prefill_on][cfg["warmup"]:]
    out = {
        "rank": dist.get_rank(), "last": last,
        "stock": walls["stock"], "on": walls["on"][:cfg["pairs"]], "profile": walls["profile"],
        "util_off": _median([it.utilisation for it in off]),
        "util_on": _median([it.utilisation for it in on]),
        "train_busy_on": sum(it.training_busy for it in on),
        "prefill_busy_on": sum(it.prefill_busy for it in on),
        "wall_on": sum(it.wall for it in on),
        "windows": [(w.tag, round(w.length * 1e3, 2)) for w in bt.windows()],
        "steady_s": steady_s, "steady_iterations": n,
        "ttft": [r.ttft for r in list(loop.results) if r.submitted >= t_steady] if last else [],
        "prefilled": len(loop.results), "tokens": server.stats.tokens, "chunks": server.stats.chunks,
        "skipped": server.stats.skipped, "closed": server.stats.closed,
        "counters": {k: v for k, v in server.counters().items() if k != "memory"},
        "memory": server.memory, "starved": bt.starved, "window_report": bt.window_report(),
        "dry_s": bt.dry_s, "dry_iterations": bt.dry_iterations, "on_iterations": len(on),
        "time": where_time_goes(list(its)[cfg["warmup"]:]), "gc": collected, "cycle_rules": cycle_rules,
        "rules": attribute(list(server.stats.timings), [(a, b, r) for (a, b), r in
                                                         zip(compared, cycle_rules, strict=True)]),
    }
    pauses.remove()
    out["tokens_per_s"] = server.stats.tokens / max(sum(it.wall for it in on), 1e-9)
    bt.undo()
    server.stop()
    wan.undo()
    torch.distributed.barrier()
    return out


def start_rules(cfg: dict) -> tuple | None:
    """--versus-quantile: the two start rules the cycles alternate (None: the mean cost), else None."""
    if cfg.get("versus_quantile") is None:
        return None
    return cfg["tail_quantile"] or None, cfg["versus_quantile"] or None


def where_time_goes(its: list) -> dict:
    """Where an iteration's time goes, prefill off against on: per instruction kind the median over
    iterations of its summed time (ms); how far the on-iterations' chunks ran into training (a chunk
    still running after the wait it started in had returned: count and ms in all); and the iterations'
    median wall time (ms, count): off, on with no chunk into training, on with one or more."""
    kinds = sorted({op.kind for it in its for op in it.ops})
    out = {"ms": {k: [round(1e3 * _median([sum(op.end - op.start for op in it.ops if op.kind == k)
                                          for it in its if it.prefill_on == on]), 3) for on in (False, True)]
                  for k in kinds}}
    into, into_s, walls = 0, 0.0, {"off": [], "on_clear": [], "on_into": []}
    off = [it for it in its if not it.prefill_on and len(it.ops) == len(its[0].ops)]
    usual = [_median([it.ops[i].end - it.ops[i].start for it in off]) for i in range(len(its[0].ops))]
    slow = []       # the iterations with a chunk into training: instructions 2 ms over their usual time
    for it in its:
        waits = [op for op in it.ops if op.kind in WAITS]
        n = 0
        for a, b in it.prefill:
            op = next((w for w in waits if w.start <= a <= w.end), None)
            if op is not None and b > op.end:
                n, into_s = n + 1, into_s + (b - op.end)
        into += n
        walls["off" if not it.prefill_on else "on_into" if n else "on_clear"].append(it.wall)
        if n and len(it.ops) == len(usual) and len(slow) < 5:
            slow.append([(i, op.kind, round(1e3 * (op.end - op.start - usual[i]), 1))
                         for i, op in enumerate(it.ops) if op.end - op.start - usual[i] > 2e-3])
    out["into_training"], out["into_training_ms"] = into, round(1e3 * into_s, 2)
    out["wall_ms"] = {k: [round(1e3 * _median(v), 2), len(v)] for k, v in walls.items()}
    out["into_slow"] = slow
    return out


def prefill_spec(cfg: dict):
    """The model every rank's service prefills: the project's CausalLM (``--lm-hidden``, ``--lm-layers``),
    or the Hugging Face model in ``cfg["hf"]`` (a local directory; ``--hf-tiny`` saved one there)."""
    if cfg.get("hf"):
        from launch.bubbletea.hf import HFConfig

        return HFConfig.load(cfg["hf"], max_seq=cfg["prompt"])
    from launch.bubbletea import LMConfig

    return LMConfig(hidden=cfg["lm_hidden"], layers=cfg["lm_layers"], max_seq=cfg["prompt"])


def model_name(cfg: dict) -> str:
    if cfg.get("hf_tiny"):
        return f"Hugging Face {cfg['hf_tiny']} (random) hidden {cfg['lm_hidden']} x {cfg['lm_layers']} layers"
    if cfg.get("hf"):
        return f"Hugging Face model {cfg['hf']}"
    return f"LM hidden {cfg['lm_hidden']} x {cfg['lm_layers']} layers"


@contextlib.contextmanager
def hf_model(cfg: dict):
    """``cfg`` with ``hf`` set to the model's directory: ``--hf``'s, or for ``--hf-tiny`` a random model
    sized by ``--lm-hidden``/``--lm-layers`` saved into a temporary directory (removed after the run)."""
    if not cfg.get("hf_tiny"):
        yield cfg
        return
    from launch.bubbletea.hf import save_tiny

    with tempfile.TemporaryDirectory(prefix="bubbletea-hf-") as where:
        save_tiny(cfg["hf_tiny"], where, hidden=cfg["lm_hidden"], layers=cfg["lm_layers"],
                  max_seq=cfg["prompt"])
        yield {**cfg, "hf": where}


def atlas_plan(cfg: dict):
    """ATLAS's plan for the 2-stage pipeline over the two namespaces (data centers "a" and "b")."""
    from launch.plan import topology
    from launch.plan.estimate import ModelSpec
    from launch.plan.placement import make_plan

    raw = {"datacenters": {dc: {"hosts": [{"name": f"{dc}0", "slots": 1}], "ifname": cfg["ifnames"][dc]}
                           for dc in "ab"},
           "wan": [{"between": ["a", "b"], "rtt_ms": 2 * cfg["wan_ms"],
                    "bandwidth_gbps": cfg["rate_mbit"] / 1e3}]}
    model = ModelSpec(layers=2 * cfg["layers"], hidden=cfg["hidden"], seq=8,
                      global_batch=cfg["batch"] * cfg["micro_batches"], pp=2, tp=1, dp=1)
    return make_plan(topology.parse(raw, source="bubbletea-bench"), model, cfg["connections"], "temporal")


def simulated_windows(cfg: dict, bt, engine) -> list:
    """This rank's windows from ATLAS's simulator: the pipeline as a :class:`launch.plan.simulate.Job`
    whose forward and backward times are the warm-up's (medians, gathered from every rank) and whose
    boundary is the WAN (latency one way, the link's rate), simulated as DeepSpeed's engine runs it
    (``--plan-schedule deepspeed``, :func:`launch.bubbletea.windows.engine_plan`; ``1f1b``: the
    idealised schedule, for comparison), its gaps mapped onto the rank's wait instructions
    (:func:`launch.bubbletea.windows.plan_windows`)."""
    import torch
    import torch.distributed as dist

    from commweave import comm
    from launch.bubbletea.engine import step_sync
    from launch.bubbletea.windows import engine_plan, instruction_names, plan_windows
    from launch.plan.simulate import Job, Route, simulate

    its = list(bt.iterations)[-cfg["warmup"]:]       # ops are per micro-batch: a median is t_f, t_b
    mine = torch.tensor([_median([op.end - op.start for it in its for op in it.ops if op.kind == kind])
                         for kind in ("ForwardPass", "BackwardPass")], dtype=torch.float64)
    every = torch.zeros(dist.get_world_size() * 2, dtype=torch.float64)
    comm.all_gather(every, mine, dist.group.WORLD)
    S, D, M = engine.num_stages, dist.get_world_size() // engine.num_stages, engine.micro_batches
    per = every.view(S, D, 2)            # rank = stage · D + replica (PipeDataParallelTopology)
    rate = cfg["rate_mbit"] * 1e6 / 8 if cfg["atlas"] else float("inf")
    routes = (tuple(Route(cfg["wan_ms"] / 1e3, rate) for _ in range(D)),)
    job = Job(tuple(tuple(float(per[s, d, 0]) for d in range(D)) for s in range(S)),
              tuple(tuple(float(per[s, d, 1]) for d in range(D)) for s in range(S)),
              routes, act_bytes=4.0 * cfg["batch"] * cfg["hidden"], micro_batches=M)
    result = engine_plan(job, "deepspeed") if cfg["plan_schedule"] == "deepspeed" else simulate(job)
    return plan_windows(result.ops, result.iteration, (engine.stage_id, engine.grid.get_data_parallel_id()),
                        instruction_names(M, S, engine.stage_id), lane=dist.get_rank(),
                        transfers=result.transfers, step_sync=step_sync(engine))


def report(cfg: dict, ranks: list[dict], load_before: str, load_after: str) -> dict:
    r0 = ranks[0]
    ratios = [a / b for a, b in zip(r0["on"], r0["stock"], strict=True)]
    control = [a / b for a, b in zip(r0["profile"], r0["stock"], strict=True)]   # A/A: the noise floor
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    per_rank_ratio = [_median([a / b for a, b in zip(r["on"], r["stock"], strict=True)]) for r in ranks]
    stock, on, prof = _median(r0["stock"]), _median(r0["on"]), _median(r0["profile"])
    util_off = statistics.mean(r["util_off"] for r in ranks)
    util_on = statistics.mean(r["util_on"] for r in ranks)
    # pipelined, each stage runs every token: the prefill done is the last stage's
    tok_s = sum(r["tokens_per_s"] for r in ranks if not cfg["pipelined"] or r["last"])
    ttft = sorted(t for r in ranks for t in r["ttft"])
    p90 = ttft[int(0.9 * (len(ttft) - 1))] if ttft else float("nan")
    binding = (f"each bound to its own {len(cfg['cores'][0])} core(s) with its prefill service"
               if cfg["cores"] else f"unbound, on {cfg['cpus']} cores")
    replicas = f"{len(ranks) // 2} replica{'s' * (len(ranks) > 2)}"
    print(f"BubbleTea, {len(ranks)} CPU ranks (2 stages x {replicas}, {binding}), "
          f"emulated WAN {cfg['wan_ms']:g} ms one way; "
          f"training {cfg['layers']} x Linear({cfg['hidden']}) + Tanh, {cfg['micro_batches']} micro-batches "
          f"of {cfg['batch']}; prefill {model_name(cfg)}, prompts of "
          f"{cfg['prompt']} tokens in chunks of {cfg['chunk']}, {cfg['outstanding']} queued per rank, "
          + ("chunks SLEEPING (no work), " if cfg.get("sleeping_chunks") else "") +
          f"guard {cfg['guard_ms']:g} ms, start rule on the "
          + (f"p{100 * cfg['tail_quantile']:g} cost" if cfg["tail_quantile"] else "mean cost")
          + (" and, every other cycle, on the " + ("mean cost" if not cfg["versus_quantile"] else
                                                   f"p{100 * cfg['versus_quantile']:g} cost")
             if start_rules(cfg) else "")
          + f"; nice: training {cfg['nice']}, prefill {cfg['prefill_nice']}"
          + (" + SCHED_IDLE" if cfg["prefill_idle"] else ""))
    print(f"load average before {load_before}, after {load_after}; {cfg['pairs']} cycles "
          f"(stock / on / profile, in their 6 orders in turn), {r0['steady_iterations']} steady iterations")
    print()
    print("| | step time (median, s) | GPU utilisation | prefill tokens/s | TTFT median / p90 (s) |")
    print("|---|---|---|---|---|")
    print(f"| DeepSpeed (stock engine) | {stock:.4f} | {100 * util_off:.1f}% (traced) | - | - |")
    print(f"| BubbleTea, tracing only | {prof:.4f} | {100 * util_off:.1f}% | - | - |")
    print(f"| BubbleTea, prefill on | {on:.4f} | {100 * util_on:.1f}% | {tok_s:.0f} | "
          f"{_median(ttft):.3f} / {p90:.3f} |")
    print()
    print(f"slowdown (median of paired on/stock, rank 0): {100 * (_median(ratios) - 1):+.2f}% "
          f"(quartiles {100 * (q[0] - 1):+.1f}% .. {100 * (q[2] - 1):+.1f}%); per rank "
          + ", ".join(f"{100 * (x - 1):+.2f}%" for x in per_rank_ratio))
    print(f"noise floor (median of paired tracing-only/stock, rank 0): {100 * (_median(control) - 1):+.2f}%")
    print("per rank: " + "; ".join(
        f"rank {r['rank']}: prefill {r['prefill_busy_on'] / r['wall_on']:.0%} + training "
        f"{r['train_busy_on'] / r['wall_on']:.0%} of on-iterations, {r['prefilled']} prompts, "
        f"{r['chunks']} chunks "
        f"(planned, not started: {r['skipped']} too long for the rest of their window, {r['closed']} after "
        f"an early close), windows (instr, ms) {r['windows']}" for r in ranks))
    per_rank = rank_table(cfg, ranks)
    summary = {"ranks": len(ranks), "bound": bool(cfg["cores"]), "atlas": cfg["atlas"],
               "tail_quantile": cfg["tail_quantile"] or None,
               "pipelined": cfg["pipelined"], "windows": cfg["windows"], "per_rank": per_rank,
               "starved_ranks": [r["rank"] for r in per_rank if r["starved"]],
               "slowdown": _median(ratios) - 1, "slowdown_per_rank": [x - 1 for x in per_rank_ratio],
               "tracing_overhead": _median(control) - 1,
               "step_s_stock": stock, "step_s_bubbletea": on, "step_s_tracing": prof,
               "utilisation": util_off, "utilisation_bubbletea": util_on, "prefill_tokens_per_s": tok_s,
               "ttft_median_s": _median(ttft), "ttft_p90_s": p90, "load": [load_before, load_after]}
    if start_rules(cfg):
        summary["start_rules"] = compare(ranks, start_rules(cfg))
    print(json.dumps(summary))
    return summary


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def rank_table(cfg: dict, ranks: list[dict]) -> list[dict]:
    """Per rank: its service's counters, its share of the prefill, its slowdown, plan vs measurement;
    prints the table and a warning for a starved rank (a share under half the even share, or no chunk)."""
    # pipelined, every stage runs every token: a stage's share is of the stage that ran the most
    tokens = max(r["tokens"] for r in ranks) if cfg["pipelined"] else sum(r["tokens"] for r in ranks)
    even = 1.0 if cfg["pipelined"] else 1.0 / len(ranks)
    rows = []
    for r in ranks:
        c, w = r["counters"], r["window_report"]
        share = r["tokens"] / tokens if tokens else 0.0
        rows.append({"rank": r["rank"], "chunks": r["chunks"], "tokens": r["tokens"], "share": share,
                     "prompts": r["prefilled"], "queue": c["queue"], "queue_peak": c["queue_peak"],
                     "ttft_median_s": _median(r["ttft"]) if r["ttft"] else None,
                     "tokens_per_s": r["tokens_per_s"],
                     "slowdown": _median([a / b for a, b in zip(r["on"], r["stock"], strict=True)]) - 1,
                     "plan_vs_measured": w["median_rel_diff"], "plan_s": w["plan_s"],
                     "measured_s": w["measured_s"], "plan_windows": w.get("windows", []),
                     "recalibrated": c["recalibrated"], "kv_cap": r["memory"].get("cap"),
                     "late": c["late"], "late_ms": 1e3 * c["late_s"], "over_tail": c["over_tail"],
                     "cost_ratio_median": c["cost_ratio_median"], "cost_ratio_p90": c["cost_ratio_p90"],
                     "time": r["time"], "gc": r["gc"],
                     "kv_peak": r["memory"].get("kv_peak"),
                     "dry_s": r.get("dry_s", 0.0), "dry_iterations": r.get("dry_iterations", 0),
                     "on_iterations": r.get("on_iterations", 0), "restarts": r.get("starved", 0),
                     "starved": r["chunks"] == 0 or share < 0.5 * even})
    print()
    print(f"| rank | chunks | tokens (share) | prompts | queue end / peak | TTFT median | prefill tokens/s | "
          f"slowdown | windows ({cfg['windows']}): plan / measured, median diff | KV peak / cap |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        diff = "-" if x["plan_vs_measured"] is None else f"{100 * x['plan_vs_measured']:+.0f}%"
        ttft = "-" if x["ttft_median_s"] is None else f"{x['ttft_median_s']:.3f} s"
        print(f"| {x['rank']} | {x['chunks']} | {x['tokens']} ({100 * x['share']:.0f}%) | {x['prompts']} | "
              f"{x['queue']} / {x['queue_peak']} | {ttft} | {x['tokens_per_s']:,.0f} | "
              f"{100 * x['slowdown']:+.2f}% | {1e3 * x['plan_s']:.1f} / {1e3 * x['measured_s']:.1f} ms, "
              f"{diff} | "
              f"{(x['kv_peak'] or 0) / 2**20:.1f} / {(x['kv_cap'] or 0) / 2**30:.1f} GiB |")
    print()
    print("Chunks against their windows and training, per rank: late = ended after its window's planned end; "
          "into training = still running when the wait it started in returned; measured / predicted cost. "
          "Then ms per iteration by instruction, prefill off -> on (median).")
    for x in rows:
        t = x["time"]
        ratio = ("-" if x["cost_ratio_median"] is None else
                 f"{x['cost_ratio_median']:.2f} / {x['cost_ratio_p90']:.2f}")
        print(f"rank {x['rank']}: late {x['late']} of {x['chunks']} ({x['late_ms']:.1f} ms), over their "
              f"tail cost {x['over_tail']}, into training "
              f"{t['into_training']} ({t['into_training_ms']:.1f} ms), measured/predicted median / p90 "
              f"{ratio}; " + ", ".join(f"{k} {a:.1f} -> {b:.1f}" for k, (a, b) in t["ms"].items())
              + "; iteration ms (count): "
              + ", ".join(f"{k} {a:.1f} ({n})" for k, (a, n) in t["wall_ms"].items())
              + "; garbage collector (ms in all, full collections, longest ms): "
              + ", ".join(f"{arm} {ms:.1f} / {n} / {top:.1f}" for arm, (ms, n, top) in x["gc"].items())
              + "; iterations with a chunk into training, instructions 2 ms over their usual: "
              + str(t["into_slow"]))
    if cfg["windows"] != "measured":
        print("Windows per rank, plan / measured ms by instruction (tag): " + "; ".join(
            f"rank {x['rank']}: " + ", ".join(f"{w['tag']}: {_ms(w['plan_ms'])} / {_ms(w['measured_ms'])}"
                                              for w in x["plan_windows"]) for x in rows))
    print("Starvation per rank (prefill-on iterations with prompts queued and no chunk run; the service "
          "re-timed after 8 in a row): " + "; ".join(
              f"rank {x['rank']}: {x['dry_iterations']} of {x['on_iterations']} iterations, "
              f"{x['dry_s']:.2f} s, re-timed {x['restarts']}x" for x in rows))
    for x in rows:
        if x["starved"]:
            print(f"WARNING: rank {x['rank']}'s prefill service is starved: {x['chunks']} chunks, "
                  f"{100 * x['share']:.0f}% of the prefilled tokens (even share {100 * even:.0f}%), "
                  f"{x['dry_s']:.2f} s of prefill-on iterations without a chunk")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bubbletea", description=__doc__.splitlines()[0])
    ap.add_argument("--wan-ms", type=float, default=10.0,
                    help="emulated one-way latency per pipeline transfer")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lm-hidden", type=int, default=128)
    ap.add_argument("--lm-layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--guard-ms", type=float, default=1.0)
    ap.add_argument("--tail-quantile", type=float, default=0.9,
                    help="a chunk starts only if its cost at this quantile of the recent measured ones ends "
                         "the guard band before its window closes; 0: its mean cost (launch.bubbletea.cost)")
    ap.add_argument("--versus-quantile", type=float, default=None,
                    help="compare start rules in one run: the on iterations alternate, cycle by cycle, "
                         "between --tail-quantile's rule and this one (0: the mean cost); --pairs a "
                         "multiple of 12 (benchmarks.start_rules)")
    ap.add_argument("--sleeping-chunks", action="store_true",
                    help="each chunk sleeps the time its shape took once instead of computing: BubbleTea's "
                         "windows, messages and hand-offs without the chunks' work (SleepingChunks)")
    ap.add_argument("--outstanding", type=int, default=8,
                    help="prompts kept queued per rank; 0: windows open, nothing to prefill")
    ap.add_argument("--history", type=int, default=5)
    ap.add_argument("--nice", type=int, default=0,
                    help="nice of the training threads (negative needs root: a stand-in for dedicated hosts "
                         "on a shared machine)")
    ap.add_argument("--prefill-nice", type=int, default=19, help="nice of the prefill service")
    ap.add_argument("--prefill-idle", type=int, choices=(0, 1), default=1,
                    help="1: the prefill service runs under SCHED_IDLE (default); 0: nice alone")
    ap.add_argument("--replicas", type=int, default=None,
                    help="data-parallel replicas of the 2-stage pipeline (default: 2 with 4+ cores, else 1)")
    ap.add_argument("--bind", choices=("auto", "on", "off"), default="auto",
                    help="each rank and its prefill service on its own cores (auto: when there are enough)")
    ap.add_argument("--pipelined", action="store_true",
                    help="split the inference model's layers over the 2 stages (rows between them on "
                         "loopback); with --hf/--hf-tiny a GPT-2 or LLaMA model (hf_pipelined)")
    ap.add_argument("--hf", default=None, metavar="DIR",
                    help="prefill this local Hugging Face causal LM (save_pretrained's directory) instead of "
                         "the project's CausalLM")
    ap.add_argument("--hf-tiny", choices=("llama", "gpt2"), default=None,
                    help="prefill a random Hugging Face model of that family sized by --lm-hidden and "
                         "--lm-layers, saved to a temporary directory (nothing downloaded)")
    ap.add_argument("--windows", choices=("measured", "plan", "both"), default="measured",
                    help="where the windows come from: measurement, ATLAS's simulated schedule, or both")
    ap.add_argument("--plan-schedule", choices=("deepspeed", "1f1b"), default="deepspeed",
                    help="--windows plan|both: simulate ATLAS's job as DeepSpeed's engine runs it (blocking "
                         "p2p in TrainSchedule's order) or as the idealised 1F1B")
    ap.add_argument("--atlas", action="store_true",
                    help="the 2 ranks in 2 network namespaces joined by launch.net.wanemu (RTT 2 x --wan-ms, "
                         "--rate-mbit), pipeline p2p by ATLAS's multi-TCP temporal sharing (needs root)")
    ap.add_argument("--rate-mbit", type=float, default=800.0, help="--atlas: the emulated WAN's rate")
    ap.add_argument("--connections", type=int, default=4, help="--atlas: TCP connections per WAN transfer")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--steady", type=int, default=12)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return worker(json.loads(args.worker))
    cfg = {k: v for k, v in vars(args).items() if k != "worker"}
    for k in ("pairs", "warmup", "steady", "outstanding", "history"):
        if cfg[k] < (1 if k in ("pairs", "history") else 0):
            raise SystemExit(f"--{k.replace('_', '-')}={cfg[k]} is too small")
    for k in ("tail_quantile", "versus_quantile"):
        if cfg[k] is not None and not 0.0 <= cfg[k] <= 1.0:
            raise SystemExit(f"--{k.replace('_', '-')}={cfg[k]}: in [0, 1] (0: the mean cost)")
    if cfg["versus_quantile"] is not None:
        if cfg["versus_quantile"] == cfg["tail_quantile"]:
            raise SystemExit(f"--versus-quantile={cfg['versus_quantile']}: the same rule as --tail-quantile;"
                             " give the other rule to compare")
        try:
            check_pairs(cfg["pairs"])
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if cfg["windows"] != "measured" and cfg["warmup"] < 1:
        raise SystemExit(f"--windows {cfg['windows']} needs --warmup >= 1 (the simulated plan's compute "
                         "times)")
    cpus = sorted(os.sched_getaffinity(0))
    if cfg["replicas"] is None:
        cfg["replicas"] = 2 if len(cpus) >= 4 and not cfg["atlas"] else 1
    if cfg["replicas"] < 1 or (cfg["atlas"] and cfg["replicas"] != 1):
        raise SystemExit(f"--replicas={cfg['replicas']}: at least 1 (exactly 1 with --atlas: two namespaces)")
    if cfg["atlas"] and cfg["pipelined"]:
        raise SystemExit("--atlas with --pipelined: the inference pipeline stays inside one data center, and "
                         "--atlas puts the two stages in two")
    if cfg["hf"] and cfg["hf_tiny"]:
        raise SystemExit(f"--hf {cfg['hf']} with --hf-tiny {cfg['hf_tiny']}: one model or the other")
    if cfg["pipelined"] and cfg["sleeping_chunks"]:
        raise SystemExit("--pipelined with --sleeping-chunks: a sleeping chunk computes no rows for the next "
                         "stage")
    if cfg["hf"]:
        try:                  # refused here, before any rank starts
            prefill_spec(cfg)
        except ValueError as e:
            raise SystemExit(f"--hf: {e}") from None
    n = 2 * cfg["replicas"]
    bind, cfg["cpus"], cfg["cores"] = cfg.pop("bind"), len(cpus), None
    if bind != "off":
        try:
            cfg["cores"] = core_shares(cpus, n)
        except ValueError as e:       # auto: too few cores to bind, run unbound
            if bind == "on":
                raise SystemExit(f"--bind on: {e}") from None
    with hf_model(cfg) as cfg:
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        if cfg["atlas"]:
            ranks = run_atlas(cfg)
        else:
            with World(n, timeout=3600, env={"COMMWEAVE_RANK_THREADS": "1"}) as world:
                ranks = world.run(bench_rank, cfg)
        report(cfg, ranks, load, " ".join(f"{v:.2f}" for v in os.getloadavg()))


def run_atlas(cfg: dict) -> list[dict]:
    """Two ranks in two namespaces joined by the emulated WAN; each rank in the namespace of the data
    center ATLAS's plan puts its stage in; their results, rank order."""
    import subprocess
    import sys

    from launch.net import netns
    from launch.net.wanemu import WanLink

    ok, reason = netns.available()
    if not ok:
        raise SystemExit(f"--atlas needs network namespaces: {reason}")
    with WanLink(rtt=2 * cfg["wan_ms"] / 1e3, rate=cfg["rate_mbit"] * 1e6 / 8) as link:
        cfg = {**cfg, "ifnames": {"a": link.ifname_a, "b": link.ifname_b}}
        plan = atlas_plan(cfg)
        where = {"a": (link.a, link.addr_a, link.ifname_a), "b": (link.b, link.addr_b, link.ifname_b)}
        master = where[plan.dc_of(0)][1]
        procs = []
        for rank in range(2):
            ns, _addr, ifname = where[plan.dc_of(rank)]
            job = {**cfg, "rank": rank, "master": master, "ifname": ifname}
            cmd = ["timeout", "3600", sys.executable, "-m", "benchmarks.bubbletea", "--worker",
                   json.dumps(job)]
            procs.append(link.lab.popen(ns, cmd, stdout=subprocess.PIPE, text=True, cwd=_REPO,
                                        env={**os.environ, "GLOO_SOCKET_IFNAME": ifname,
                                             "OMP_NUM_THREADS": "1", "COMMWEAVE_RANK_THREADS": "1",
                                             "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                             "LOCAL_SIZE": "1", "MASTER_ADDR": master,
                                             "MASTER_PORT": "29631"}))
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"--atlas: a rank failed (exit codes {[p.returncode for p in procs]}):\n{outs}")
    return [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            for out in outs]


def worker(job: dict) -> None:
    """One rank of ``--atlas``, inside its namespace: a gloo world of 2 over the emulated WAN."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{job['master']}:29631", rank=job["rank"],
                            world_size=2)
    out = bench_rank(job)
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
