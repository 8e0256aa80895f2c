"""Train a small MoE language model with Parm switched on from the DeepSpeed config.

CPU (gloo), 4 ranks, tensor parallel 2 x expert parallel 2:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 examples/train_moe.py \\
        --deepspeed_config configs/parm_cpu.json --tensor-parallel 2 --ep 2

GPUs: ``deepspeed --num_gpus 8 examples/train_moe.py --deepspeed_config configs/parm_gpu.json
--tensor-parallel 4 --ep 2``.

The model is an embedding, ``--layers`` pre-norm residual blocks whose feed-forward is a
``deepspeed.moe.layer.MoE`` (experts ``Linear -> GELU -> Linear``, sharded over the tensor-parallel group by
Parm), and a head; the task is a fixed random next-token map, so the loss falls within a few steps. The
model is written against DeepSpeed's MoE; ``ds_plugins.initialize`` swaps in ParmMoE when the config's
``"parm"`` section is enabled. Rank 0 prints the loss of every step, an eval loss every ``--eval-every``
steps (``engine.eval()`` under ``torch.no_grad()``, on a held-out batch) and the schedule each layer ran.

``--checkpoint-dir D --save-every K`` saves every K steps and, when D holds a committed checkpoint,
resumes from it (examples/resume.py: DeepSpeed's files, each rank's RNG state, a commit marker): the batch
of step i is a function of i alone, so a killed and restarted job retraces the undisturbed one
(``python -m examples.soak`` does exactly that, with ranks killed at random).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: `examples` importable

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from torch import nn

import ds_plugins
from examples.resume import resume, save


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, ep: int, k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.moe = MoE(hidden, expert, num_experts=experts, ep_size=ep, k=k, capacity_factor=1.25,
                       min_capacity=0, enable_expert_tensor_parallelism=True)

    def forward(self, x):
        out, l_aux, _ = self.moe(self.norm(x))
        return x + out, l_aux


class MoELM(nn.Module):
    def __init__(self, vocab: int, hidden: int, ffn: int, layers: int, experts: int, ep: int, k: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MoEBlock(hidden, ffn, experts, ep, k) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens, targets):
        x, aux = self.embed(tokens), 0.0
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) + 0.01 * aux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5, help="steps between eval passes (0: none)")
    p.add_argument("--checkpoint-dir", default=None, help="save here and resume from here")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: none)")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()

    deepspeed.init_distributed()
    if deepspeed.get_accelerator().device_name() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    else:
        deepspeed.get_accelerator().set_device(args.local_rank)
    mpu = ds_plugins.ModelParallelUnit(args.tensor_parallel)
    torch.manual_seed(0)  # the same initial weights on every rank (MP ranks must agree)
    model = MoELM(args.vocab, args.hidden, args.ffn, args.layers, args.experts, args.ep, args.k)
    engine, *_ = ds_plugins.initialize(args=args, model=model, model_parameters=model.parameters(), mpu=mpu)

    # A fixed random next-token map; the MP ranks of one data-parallel replica see the same batch, and the
    # batch of step i depends on i alone (a resumed job sees the batches the undisturbed one saw).
    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1234))
    dp_rank = mpu.get_data_parallel_rank()
    batch = engine.train_micro_batch_size_per_gpu()
    rank0 = torch.distributed.get_rank() == 0
    held_out = torch.randint(args.vocab, (batch, args.seq),
                             generator=torch.Generator().manual_seed(99 + dp_rank))
    held_out = held_out.to(engine.device)
    start = resume(engine, args.checkpoint_dir) if args.checkpoint_dir else 0
    if rank0 and start:
        print(f"resumed from step {start}", flush=True)
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1_000_003 * (dp_rank + 1) + step)
        tokens = torch.randint(args.vocab, (batch, args.seq), generator=g).to(engine.device)
        loss = engine(tokens, successor.to(engine.device)[tokens])
        engine.backward(loss)
        engine.step()
        if rank0:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            engine.eval()
            with torch.no_grad():
                eval_loss = engine(held_out, successor.to(engine.device)[held_out])
            engine.train()
            if rank0:
                print(f"step {step:3d}  eval loss {eval_loss.item():.4f}", flush=True)
        if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0:
            save(engine, args.checkpoint_dir, step + 1)
    if rank0:
        ran = [getattr(block.moe, "last_schedule", None) or "deepspeed (MoE not swapped)"
               for block in engine.module.blocks]
        schedule = engine._config._param_dict.get("parm", {}).get("schedule", "auto")
        print(f"parm schedule {schedule!r}: MoE layers ran {ran}", flush=True)


if __name__ == "__main__":
    main()
