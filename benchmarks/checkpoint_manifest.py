"""What the checkpoint manifest (ds_plugins.manifest) adds to a save of the main job's model.

    flock /tmp/commweave-bench.lock python -m benchmarks.checkpoint_manifest [--rounds 12]

The main job's commweave run (examples/train_gpt.py defaults: 2 layers, hidden 128, 4 experts of FFN 512,
top-2, Parm tp 2 x ep 2, ZeRO-1, AdamW, 4 CPU ranks) after one training step, saved with
``engine.save_checkpoint`` into a fresh tag, without a manifest and with each checksum
(``COMMWEAVE_CHECKPOINT_MANIFEST``: crc32, the default, or sha256), the arms interleaved and rotated so
that load changes hit all alike. A save's time is the slowest rank's, from a barrier before
to the end of ``save_checkpoint`` (which ends in DeepSpeed's barrier). The table gives medians; the last
line is one JSON object with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from commweave.world import World


def _rank(rounds: int, directory: str) -> dict:
    import deepspeed
    import torch.distributed as dist

    import ds_plugins
    from ds_plugins import manifest
    from examples.gpt import data
    from examples.gpt.layout import SequenceParallelUnit, deepspeed_moe_on_gloo, expert_parallel_rank
    from examples.gpt.model import ByteGPT, init_weights

    deepspeed_moe_on_gloo()
    mpu = SequenceParallelUnit(2)
    torch.manual_seed(1234)
    model = ByteGPT(layers=2, hidden=128, heads=4, ffn=512, experts=4, ep=2, k=2, capacity_factor=2.0,
                    seq=256, aux_loss_coef=0.01, cp_group=mpu.cp_group, team_size=2,
                    mp_group=mpu.get_tensor_model_parallel_group())
    init_weights(model, 1234, expert_parallel_rank(2, 2) * 4 // 2)
    config = json.loads((Path(__file__).resolve().parents[1] / "configs" / "gpt_cpu.json").read_text())
    engine, *_ = ds_plugins.initialize(model=model, model_parameters=model.parameters(), mpu=mpu,
                                       config=config)
    window = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(0))
    tokens, targets, positions = data.shard(window, dist.get_world_size(), dist.get_rank())
    loss, _, _ = engine(tokens, positions, targets)
    engine.backward(loss)
    engine.step()
    arms = ["without", "crc32", "sha256"]
    times = {arm: [] for arm in arms}
    for r in range(rounds):
        arm = arms[(r + r // len(arms)) % len(arms)]   # every arm in every position of a round in turn
        manifest.uninstall(engine)
        if arm != "without":
            manifest.install(engine, arm)
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(directory, tag=f"r{r}", save_latest=False)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times[arm].append(float(elapsed))
    deepspeed.comm.barrier()
    tag = Path(directory) / "r0"
    size = sum(p.stat().st_size for p in tag.iterdir() if not p.name.startswith("commweave_manifest"))
    return {"times": times, "bytes": size, "files": len(list(tag.iterdir()))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=18, help="saves in all, a third per arm")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d, World(4, timeout=1800, start_timeout=900) as world:
        res = world.run(_rank, args.rounds, d)[0]
    med = {arm: statistics.median(t) for arm, t in res["times"].items()}
    print(f"main job's checkpoint: {res['bytes'] / 2**20:.2f} MiB in {res['files']} files, 4 ranks; "
          f"load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| save | median ms | min ms | max ms | saves |\n|---|---|---|---|---|")
    for arm, t in res["times"].items():
        print(f"| {arm} | {med[arm] * 1e3:.1f} | {min(t) * 1e3:.1f} | {max(t) * 1e3:.1f} | {len(t)} |")
    print(json.dumps({"crc32_over_plain": round(med["crc32"] / med["without"], 4),
                      "sha256_over_plain": round(med["sha256"] / med["without"], 4),
                      "checkpoint_mib": round(res["bytes"] / 2**20, 3)}))


if __name__ == "__main__":
    main()
