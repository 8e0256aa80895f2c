"""Pipeline training with BubbleTea: prefill of a small causal LM in the bubbles of a DeepSpeed pipeline.

    deepspeed --num_gpus 4 examples/bubbletea_pipeline.py --steps 12 --wan-ms 20

4 ranks = 2 pipeline stages x 2 data-parallel replicas (rank r: stage r // 2, replica r % 2). Each
rank keeps a queue of ``--outstanding`` prompts full (a new one is submitted when one finishes) and
prints, per rank, the requests prefilled, their time to first token and the losses.
``--wan-ms`` puts an emulated one-way WAN latency on every pipeline transfer (:func:`emulate_wan_latency`):
on CPU ranks the stages' bubbles are then the wait on the WAN, as across data centers.

The functions here are also what the 4-rank test and ``python -m benchmarks.bubbletea`` run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

BASE_SEED = 4321


def layer_factories(hidden: int, layers: int) -> list:
    out = []
    for _ in range(layers):
        out += [(nn.Linear, hidden, hidden), (nn.Tanh,)]
    return out


def seed_rng(seed: int) -> None:
    """The pipeline's per-layer reseeding (DeepSpeed's ``seed_layers``: every layer of every forward).
    On a torch without CUDA, ``torch.manual_seed`` also queues lazy CUDA, XPU and MTIA seeds, each
    capturing a formatted stack trace: 0.27 ms a call at this stack depth, more for every frame a wrapper
    adds (benchmarks.bubbletea's stock step fell from about 118 to 103 ms without them). The CPU
    generator is the only one there is to seed then."""
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def micro_batch(step: int, index: int, batch: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + index)
    x = torch.randn(batch, hidden, generator=g)
    return x, torch.sin(x.flip(-1))


def prompt(request: int, tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(77 + request))


class _Stamp:
    """One float64 tensor per transfer: the sender's wall clock."""

    def __init__(self) -> None:
        self.t = torch.zeros(1, dtype=torch.float64)


def emulate_wan_latency(seconds: float):
    """Give every DeepSpeed pipeline transfer a one-way latency: the sender sends its clock first, the
    receiver returns from ``recv`` no earlier than that clock + ``seconds`` (one machine, one clock).
    The waiting rank sleeps (no CPU), as a rank waiting on a WAN does. Returns a handle with ``undo()``."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe import p2p

    from commweave import comm
    from launch.net.wan_p2p import Patch

    if seconds < 0:
        raise ValueError(f"emulate_wan_latency: seconds={seconds} must be >= 0")
    send, recv = p2p.send, p2p.recv
    world = dist.group.WORLD

    def delayed_send(tensor, dest_stage, async_op=False):
        comm.send(torch.tensor([time.time()], dtype=torch.float64),
                  p2p._grid.stage_to_global(stage_id=dest_stage), world)
        return send(tensor, dest_stage, async_op)

    def delayed_recv(tensor, src_stage, async_op=False):
        stamp = _Stamp()
        comm.recv(stamp.t, p2p._grid.stage_to_global(stage_id=src_stage), world)
        out = recv(tensor, src_stage, async_op)
        time.sleep(max(0.0, float(stamp.t) + seconds - time.time()))
        return out

    patches = [Patch.install(p2p, "send", delayed_send, ["tensor", "dest_stage", "async_op"]),
               Patch.install(p2p, "recv", delayed_recv, ["tensor", "src_stage", "async_op"])]
    return _Undo(patches)


class _Undo:
    def __init__(self, patches: list) -> None:
        self.patches = patches

    def undo(self) -> None:
        while self.patches:
            self.patches.pop().undo()


def build_engine(hidden: int, layers: int, micro_batches: int, batch: int, stages: int = 2):
    """A DeepSpeed PipelineEngine over the initialised world: ``stages`` x (world / stages) replicas."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    dp = dist.get_world_size() // stages
    specs = [LayerSpec(cls, *args) for cls, *args in layer_factories(hidden, layers)]
    model = PipelineModule(specs, topology=PipeDataParallelTopology(num_pp=stages, num_dp=dp),
                           loss_fn=nn.MSELoss(), partition_method="uniform", seed_layers=True,
                           seed_fn=seed_rng, base_seed=BASE_SEED)
    config = {"train_batch_size": batch * micro_batches * dp, "train_micro_batch_size_per_gpu": batch,
              "gradient_accumulation_steps": micro_batches, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                      config=config)
    return engine


def data(engine, step: int, batch: int, hidden: int):
    m, replica = engine.micro_batches, engine.grid.get_data_parallel_id()
    return iter([micro_batch(step, replica * m + i, batch, hidden) for i in range(m)])


class ClosedLoop:
    """Keeps ``outstanding`` prompts queued on this rank: a finished one is replaced at once."""

    def __init__(self, server, outstanding: int, tokens: int, first_id: int, keep: bool = False) -> None:
        self.server, self.tokens, self.next = server, tokens, first_id
        self.results = []
        self.keep = keep
        for _ in range(outstanding):
            self.submit()

    def submit(self) -> None:
        self.server.submit(self.next, prompt(self.next, self.tokens, self.server.config.vocab))
        self.next += 1

    def __call__(self, result) -> None:
        if not self.keep:
            result.cache = None                 # the hand-off point: a decode service would take it here
        self.results.append(result)
        self.submit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--wan-ms", type=float, default=20.0, help="one-way latency of every pipeline transfer")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4, help="Linear+Tanh pairs, split over 2 stages")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--chunk", type=int, default=64, help="tokens per prefill chunk")
    ap.add_argument("--outstanding", type=int, default=2, help="prompts kept queued per rank")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import deepspeed
    import torch.distributed as dist

    from launch.bubbletea import LMConfig, PrefillServer
    from launch.bubbletea.engine import enable

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    engine = build_engine(args.hidden, args.layers, args.micro_batches, args.batch)
    wan = emulate_wan_latency(args.wan_ms / 1e3)
    server = PrefillServer(LMConfig(max_seq=max(args.prompt, 16)), args.chunk, callback=lambda r: loop(r))
    loop = ClosedLoop(server, args.outstanding, args.prompt, first_id=dist.get_rank() * 1_000_000)
    bt = enable(engine, server)
    losses = [float(engine.train_batch(data(engine, step, args.batch, args.hidden)))
              for step in range(args.steps)]
    bt.wait_idle()
    report = {"rank": dist.get_rank(), "losses": losses, "prefilled": len(loop.results),
              "ttft_s": [r.ttft for r in loop.results], "prefill_tokens": server.stats.tokens,
              "step_s": [it.wall for it in bt.iterations],
              "prefill_on": [it.prefill_on for it in bt.iterations]}
    print(json.dumps(report), flush=True)
    bt.undo()
    server.stop()
    wan.undo()
    dist.barrier()


if __name__ == "__main__":
    main()
