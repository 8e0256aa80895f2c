"""One rank of ``python -m benchmarks.bubbletea`` (:func:`bench_rank`): build the DeepSpeed pipeline and its
prefill service, warm up, run the cycles of three arms (stock / on / profile) and the steady phase, and
return the rank's measurements for :mod:`benchmarks.bubbletea_report`.

The arms of a cycle: *stock* (DeepSpeed's own PipelineEngine class, no BubbleTea code on the path), *on*
(BubbleTea prefilling), *profile* (BubbleTea's tracing without prefill: what the windows are measured from).
Cycle i runs them in the (i mod 6)-th of their 6 orders, so over 6 cycles every arm holds every place and
every arm follows every other equally often (a chunk still running when an *on* iteration ends falls on
stock and profile alike). The steady phase runs ``--steady`` iterations (or more, up to 10x, until every
rank finished 3 prompts submitted in it) with BubbleTea on: the time to first token of those prompts.
The windows come from measurement, or from ATLAS's simulated schedule (:func:`simulated_windows`).
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import time

from benchmarks.sleeping_chunks import SleepingChunks
from benchmarks.start_rules import attribute, rule_of, rules_from
from launch.bubbletea.windows import WAITS


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def _each_thread(apply) -> None:
    """``apply(tid)`` for every thread of this rank (the training thread, gloo's and DeepSpeed's);
    threads and processes started later inherit nice and CPU mask from their creator."""
    for tid in os.listdir("/proc/self/task"):
        apply(int(tid))


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
    stage, stages = engine.stage_id, engine.num_stages
    spec, pipeline = rank_spec(cfg, stage, stages), None
    if cfg["pipelined"]:           # the inference model's layers split over the training stages
        from launch.bubbletea.pipelined import pipeline_setup, shared_key

        pipeline = pipeline_setup(stage, stages, "127.0.0.1", shared_key(dist.group.WORLD),
                                  ahead=cfg["pipeline_ahead"])
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
    rules = rules_from(cfg)
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
        "util_off": median([it.utilisation for it in off]),
        "util_on": median([it.utilisation for it in on]),
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


def where_time_goes(its: list) -> dict:
    """Where an iteration's time goes, prefill off against on: per instruction kind the median over
    iterations of its summed time (ms); how far the on-iterations' chunks ran into training (a chunk
    still running after the wait it started in had returned: count and ms in all); and the iterations'
    median wall time (ms, count): off, on with no chunk into training, on with one or more."""
    kinds = sorted({op.kind for it in its for op in it.ops})
    out = {"ms": {k: [round(1e3 * median([sum(op.end - op.start for op in it.ops if op.kind == k)
                                          for it in its if it.prefill_on == on]), 3) for on in (False, True)]
                  for k in kinds}}
    into, into_s, walls = 0, 0.0, {"off": [], "on_clear": [], "on_into": []}
    off = [it for it in its if not it.prefill_on and len(it.ops) == len(its[0].ops)]
    usual = [median([it.ops[i].end - it.ops[i].start for it in off]) for i in range(len(its[0].ops))]
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
    out["wall_ms"] = {k: [round(1e3 * median(v), 2), len(v)] for k, v in walls.items()}
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


def rank_spec(cfg: dict, stage: int, stages: int):
    """What this rank's service prefills: :func:`prefill_spec`'s model, pipelined its layers of stage
    ``stage`` (:func:`launch.bubbletea.pipelined.split`, or ``split_hf``); with ``--sleeping-chunks`` that
    spec's chunks sleep (:class:`SleepingChunks`; pipelined, a stage still sends zero rows of the real
    shape to the next)."""
    spec = prefill_spec(cfg)
    if cfg["pipelined"]:
        from launch.bubbletea.hf_pipelined import split_hf
        from launch.bubbletea.pipelined import split

        spec = (split_hf if cfg.get("hf") else split)(spec, stages)[stage]
    return SleepingChunks(spec) if cfg["sleeping_chunks"] else spec


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
    mine = torch.tensor([median([op.end - op.start for it in its for op in it.ops if op.kind == kind])
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
