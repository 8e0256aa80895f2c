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

In one process tree, after ``--warmup`` iterations (:mod:`benchmarks.bubbletea_rank`, each rank's run):
- ``--pairs`` cycles of three iterations: *stock* (DeepSpeed's own PipelineEngine), *on* (BubbleTea
  prefilling), *profile* (BubbleTea's tracing without prefill), in their 6 orders in turn. The slowdown
  is the median over cycles of on / stock step time (rank 0's ``train_batch`` wall time; every rank's is
  within the noise of it), profile / stock is the A/A control;
- ``--steady`` iterations (or more, up to 10x, until every rank finished 3 prompts submitted in this
  phase) with BubbleTea on: time to first token of the prompts submitted and finished there.

Prints a table and ends with one JSON line of ratios (:mod:`benchmarks.bubbletea_report`). The machine's
load average is printed too: figures taken on a busy 2-core machine are not worth much. This module is
the command line: options, their checks, the ranks' world (or ``--atlas``'s two namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

from benchmarks.bubbletea_rank import atlas_plan, bench_rank, prefill_spec
from benchmarks.bubbletea_report import report
from benchmarks.start_rules import check_pairs
from commweave.world import World
from launch.bubbletea.pipelined import AHEAD

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def core_shares(cpus: list[int], ranks: int) -> list[list[int]]:
    """``deepspeed --bind_cores_to_rank``'s split: rank r gets the r-th run of len(cpus) // ranks cores."""
    k = len(cpus) // ranks
    if k < 1:
        raise ValueError(f"{ranks} ranks cannot each have a core of {len(cpus)} ({cpus})")
    return [cpus[r * k:(r + 1) * k] for r in range(ranks)]


def _ahead(text: str) -> int | None:
    """--pipeline-ahead: a whole number of requests, at least 1, or ``none`` (no bound)."""
    if text == "none":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of requests, at least 1, or none (no bound)")
    return int(text)


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
                         "windows, messages and hand-offs without the chunks' work (SleepingChunks); "
                         "with --pipelined a stage still sends zero rows of the real shape to the next")
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
    ap.add_argument("--pipeline-ahead", type=_ahead, default=argparse.SUPPRESS, metavar="N|none",
                    help="--pipelined: a stage admits no new request while N it started are unfinished "
                         f"downstream (default {AHEAD}, launch.bubbletea.pipelined.AHEAD; none: no bound)")
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
    if "pipeline_ahead" in cfg and not cfg["pipelined"]:
        raise SystemExit(f"--pipeline-ahead={cfg['pipeline_ahead']}: only with --pipelined")
    cfg.setdefault("pipeline_ahead", AHEAD)
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
