"""The main job: a byte-level GPT-MoE on the Python standard library, with Parm and WallFacer, side by side.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 examples/train_gpt.py          # 4 CPU ranks (gloo)
    deepspeed examples/train_gpt.py --deepspeed_config configs/gpt_gpu.json  # every GPU here (NCCL)

One command trains the same model twice, same seed, same data order:

- **commweave**: the feed-forward layers are ``deepspeed.moe.layer.MoE``, which the ``"parm"`` section of
  the DeepSpeed config swaps for Parm (MP = ESP over teams of ``--tp`` ranks, EP across them); attention
  is WallFacer over all ranks with teams of ``--wallfacer-team-size``;
- **DeepSpeed**: the same config with ``"parm": {"enabled": false}`` (DeepSpeed's own MoE) and ring
  attention (WallFacer with team size 1, which is ring attention),

then prints a table (tokens/s, ms per step, bytes per step by kind, train and held-out loss, and whether
the losses agree within the tolerance), and writes the table, a PNG chart, the results and the config
to ``runs/<timestamp>/``. ``--quick`` is the CI size (about a minute on 2 cores). Layout and gradient
bookkeeping: examples/gpt/layout.py; the model: examples/gpt/model.py; the data: examples/gpt/data.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run as a script by the launcher: make `examples.gpt` importable

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ds_plugins import ParmConfig  # noqa: E402
from examples.gpt import data, report  # noqa: E402
from examples.gpt.agreement import Tolerance  # noqa: E402
from examples.gpt.layout import (  # noqa: E402
    SequenceParallelUnit,
    check_layout,
    deepspeed_moe_on_gloo,
    init_distributed,
)
from examples.gpt.train import Job  # noqa: E402

QUICK = {"steps": 30, "layers": 1, "hidden": 64, "ffn": 256, "seq": 128, "batch": 4, "eval_every": 10,
         "eval_batches": 2, "sample_bytes": 24, "warmup_steps": 2}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--quick", action="store_true", help=f"CI size: {QUICK}")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512, help="expert hidden size")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factor", type=float, default=2.0, help="must be >= experts / k (no drops)")
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--seq", type=int, default=256, help="bytes per sequence, split over all ranks")
    p.add_argument("--batch", type=int, default=8,
                   help="sequences per step (replaces the config's train_micro_batch_size_per_gpu)")
    p.add_argument("--tp", type=int, default=2, help="MoE tensor-parallel (MP = ESP) size: ranks per team")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: world / tp)")
    p.add_argument("--wallfacer-team-size", type=int, default=2,
                   help="WallFacer team size C of the commweave run (C² divides the world); 1 = ring")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--sample-bytes", type=int, default=120)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=ROOT / "runs", help="where runs/<timestamp>/ goes")
    p.add_argument("--atlas", action="store_true",
                   help="add the MoE model as a 2-stage pipeline across two emulated data centers, through "
                        "deepspeed-atlas, without and with ATLAS (root: network namespaces)")
    p.add_argument("--atlas-steps", type=int, default=10, help="training steps of each pipeline run")
    p = deepspeed.add_config_arguments(p)
    argv = sys.argv[1:] if argv is None else argv
    if "--quick" in argv:
        p.set_defaults(**QUICK)       # what the command line states still wins
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
        args.deepspeed_config = str(ROOT / "configs" / ("gpt_gpu.json" if gpu else "gpt_cpu.json"))
    for name in ("steps", "eval_every", "eval_batches", "batch", "layers", "atlas_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if not 0 <= args.warmup_steps < args.steps:
        raise ValueError(f"--warmup-steps {args.warmup_steps} must be in [0, --steps {args.steps})")
    return args


def load_config(path: str, batch: int) -> tuple[dict, dict]:
    """The DeepSpeed config (features on) and its copy with Parm off; ValueError on a bad "parm" section."""
    with open(path) as f:
        config = json.load(f)
    parm = ParmConfig.from_deepspeed(config)
    if not parm.enabled:
        raise ValueError(f'{path}: the "parm" section must be enabled: the job runs it, then the same config '
                         'with Parm off')
    clip = config.get("gradient_clipping", 1.0)   # DeepSpeed's default is 1.0
    if clip:
        raise ValueError(f'{path}: "gradient_clipping": {clip} must be 0: DeepSpeed computes the global norm '
                         "assuming its data-parallel and tensor-parallel groups are disjoint, and this job's "
                         "gradient group spans the MoE's MP ranks (examples/gpt/layout.py)")
    config["train_micro_batch_size_per_gpu"] = batch
    off = copy.deepcopy(config)
    off["parm"]["enabled"] = False
    return config, off


def main(argv=None) -> None:
    args = parse(argv)
    init_distributed()
    world = dist.get_world_size()
    args.ep = args.ep or max(1, world // args.tp)
    check_layout(world, args.tp, args.ep, args.experts, args.heads, args.seq, args.wallfacer_team_size)
    if deepspeed.get_accelerator().device_name() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", world))))
    else:
        deepspeed.get_accelerator().set_device(args.local_rank)
    config_on, config_off = load_config(args.deepspeed_config, args.batch)
    corpus = data.Corpus.load()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(corpus.describe(), flush=True)
    deepspeed_moe_on_gloo()
    job = Job(args, corpus, SequenceParallelUnit(args.tp))
    c = args.wallfacer_team_size
    runs = [("DeepSpeed", config_off, 1, f"DeepSpeed MoE, ring attention (P={world})"),
            ("commweave", config_on, c, f"Parm '{config_on['parm'].get('schedule', 'auto')}', "
                                        f"WallFacer C={c} (P={world})")]
    results = []
    for name, config, team_size, what in runs:
        with tqdm(total=args.steps, desc=f"{name:>10}", disable=not rank0, file=sys.stderr) as bar:
            results.append((job.train(name, config, team_size, bar), what))
    tolerance = Tolerance.for_config(config_on)
    pipeline = None
    if args.atlas and rank0:      # the other ranks wait at the barrier below
        from examples.gpt.atlas import pipeline_rows

        print("pipeline across two emulated data centers (deepspeed-atlas): stock, then ATLAS", flush=True)
        pipeline = pipeline_rows(args.deepspeed_config, job_args=(
            "--steps", str(args.atlas_steps), "--warmup-steps", str(min(2, args.atlas_steps - 1))))
    if rank0:
        text = report.table(results, tolerance, pipeline)
        schedules = ", ".join(f"{r.name}: {r.schedules}" for r, _ in results)
        text += f"\nMoE layers ran: {schedules}"
        print("\n" + text, flush=True)
        for res, _ in results:
            print(f"--- {res.name} sample ---\n{res.sample.decode('utf-8', 'replace')}", flush=True)
        record = {"deepspeed_config": config_on, "features_off": {"parm": config_off["parm"],
                  "wallfacer_team_size": 1}, "args": {k: str(v) if isinstance(v, Path) else v
                                                     for k, v in vars(args).items()},
                  "world_size": world, "tolerance": tolerance.describe_rule()}
        run_dir = report.write(args.out, results, record, text, pipeline)
        print(f"wrote {run_dir}/ (table.md, chart.png, config.json, results.json, sample.txt)", flush=True)
    agree = tolerance.agree(results[0][0], results[-1][0])
    dist.barrier()
    if not agree:
        sys.exit(3)


if __name__ == "__main__":
    main()
