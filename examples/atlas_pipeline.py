"""Train a small DeepSpeed PipelineModule across data centers with ATLAS.

    deepspeed-atlas --atlas-topology configs/atlas_two_dc.json --wan-connections 8 \\
        examples/atlas_pipeline.py --steps 3 --out /tmp/atlas-run

Every rank follows the plan the launcher exported (stage in its data center, WAN pairs on k TCP
connections, temporal sharing) and writes ``rank<N>.json`` to ``--out``: where it ran, the ATLAS/
NCCL/GLOO environment it saw, the TCP connections its WAN groups opened, and the losses. On CPU
(``DS_ACCELERATOR=cpu``) it uses gloo; ``--reference`` prints the single-process losses instead.

The model is HIDDEN-wide Linear+Tanh layers seeded per layer (``seed_fn=torch.manual_seed``), so
any partition into stages builds the same weights as :func:`reference_losses`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

HIDDEN, LAYERS, MICRO_BATCH, LR, BASE_SEED = 16, 4, 2, 0.1, 1234


def layer_factories() -> list:
    out = []
    for _ in range(LAYERS):
        out += [(nn.Linear, HIDDEN, HIDDEN), (nn.Tanh,)]
    return out


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` (over the whole global batch) of ``step``: inputs and regression targets."""
    g = torch.Generator().manual_seed(10_000 * step + index)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=g)
    return x, torch.sin(x.flip(-1))


def reference_losses(steps: int, micro_batches: int, lr: float = LR) -> list[float]:
    """One process: the same layers and the same global batches, gradients averaged over them all."""
    layers = []
    for i, (cls, *args) in enumerate(layer_factories()):
        torch.manual_seed(BASE_SEED + i)
        layers.append(cls(*args))
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for i in range(micro_batches):
            x, y = micro_batch(step, i)
            loss = nn.functional.mse_loss(model(x), y)
            (loss / micro_batches).backward()
            total += loss.item()
        opt.step()
        losses.append(total / micro_batches)
    return losses


def train(steps: int, plan, wan_setup=None) -> list[float]:
    """DeepSpeed pipeline training on an initialised process group; ``wan_setup(plan)`` may enable
    ATLAS after the engine exists (it returns a handle with ``undo()``)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    from launch.run.runtime import pipe_topology

    deepspeed.init_distributed(dist_backend=dist.get_backend())   # adopts the existing process group
    specs = [LayerSpec(cls, *args) for cls, *args in layer_factories()]
    model = PipelineModule(specs, topology=pipe_topology(plan), loss_fn=nn.MSELoss(),
                           partition_method="uniform", seed_layers=True, seed_fn=torch.manual_seed,
                           base_seed=BASE_SEED)
    m = plan.micro_batches
    config = {"train_batch_size": MICRO_BATCH * m * plan.dp, "train_micro_batch_size_per_gpu": MICRO_BATCH,
              "gradient_accumulation_steps": m, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    handle = wan_setup(plan) if wan_setup is not None else None
    replica = engine.grid.get_data_parallel_id()
    losses = []
    for step in range(steps):
        batches = iter([micro_batch(step, replica * m + i) for i in range(m)])
        losses.append(float(engine.train_batch(data_iter=batches)))
    if handle is not None:
        handle.undo()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="directory for rank<N>.json")
    ap.add_argument("--reference", type=int, default=0, metavar="M",
                    help="print the single-process losses for M micro-batches per step and exit")
    args = ap.parse_args()
    if args.reference:
        print(json.dumps(reference_losses(args.steps, args.reference)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import deepspeed
    import torch.distributed as dist

    import launch.run.runtime as atlas
    from launch.net.sockets import established_connections

    plan = atlas.init()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    report = {"rank": dist.get_rank(), "env_rank": os.environ.get("RANK"),
              "stage": plan.coord(dist.get_rank())[0], "dc": plan.dc_of(dist.get_rank()),
              "env": {k: v for k, v in os.environ.items() if k.startswith(("ATLAS_", "NCCL_", "GLOO_"))
                      and k != "ATLAS_PLAN"}}

    me = dist.get_rank()
    far = {h.addr for h in plan.hosts if h.dc != plan.dc_of(me) and h.addr} or None

    def enable(plan):
        # TCP connections to the other data centers that the WAN groups open (from /proc/net/tcp)
        dist.barrier()
        before = established_connections(far)
        dist.barrier()
        handle = atlas.enable_deepspeed(plan)
        dist.barrier()
        report["wan_connections_opened"] = established_connections(far) - before
        return handle

    report["losses"] = train(args.steps, plan, enable)
    report["micro_batches"] = plan.micro_batches * plan.dp
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()
