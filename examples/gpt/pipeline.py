"""The MoE model as a 2-stage DeepSpeed pipeline across two data centers, one process per rank under
``deepspeed-atlas`` (examples/gpt/atlas.py starts it on two emulated data centers):

    python -m launch --atlas-topology T --wan-connections 8 --no_ssh --atlas-host w0 \\
        examples/gpt/pipeline.py --deepspeed_config configs/gpt_cpu.json --out DIR [--rows stock,atlas]

The plan puts stage 0 in one data center and stage 1 in the other, DP 2 inside each; the blocks are
those of the main job (examples/gpt/model.py) with the whole sequence on every rank (plain causal
attention: context parallelism stays inside a data center) and DeepSpeed MoE layers (swapped to Parm
by the config) whose experts are spread over the two DP ranks of their stage (EP 2, all-to-all inside
the data center). Stage 0 sends [seq, micro, hidden] activations across the WAN, stage 1 their
gradients back. ``--rows stock,atlas`` trains twice in one launch, each time from the same seeded
weights with a fresh engine: ``stock`` keeps DeepSpeed's pipeline sends (one TCP connection per pair,
both pipelines on the WAN at once), ``atlas`` has ``launch.run.runtime.enable_deepspeed`` stripe them
over the launcher's ``--wan-connections``, sharing the WAN as ``--atlas-sharing`` says (one launch for
both saves a launcher and four ranks starting DeepSpeed: about a minute on this loaded machine).

Every rank writes ``rank<N>.json`` to ``--out``, per row: train losses, held-out loss, step times, bytes sent
per step by kind, the median seconds of each instruction of DeepSpeed's engine over the timed steps
and the ping-pongs of its WAN pair just before them (what launch.plan.calibrated predicts the step
time from: examples.atlas_pipeline.probe_link), and the WAN settings it ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # run as a script by the launcher

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from examples.gpt import data  # noqa: E402
from examples.gpt.model import VOCAB, expert_mlp, init_weights  # noqa: E402


class EmbedPipe(nn.Module):
    def __init__(self, hidden: int, seq: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq, hidden)

    def forward(self, tokens):                      # [b, s] -> ([s, b, M], l_aux so far [1])
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens.t()) + self.positions(positions)[:, None]
        return x, x.new_zeros(1, requires_grad=True)


class BlockPipe(nn.Module):
    """The main job's block with local causal attention (the whole sequence is on this rank)."""

    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, ep: int, k: int,
                 capacity_factor: float) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.moe = MoE(hidden, expert_mlp(hidden, ffn), num_experts=experts, ep_size=ep, k=k,
                       capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor, min_capacity=0,
                       top2_2nd_expert_sampling=False)

    def forward(self, inputs):
        x, aux = inputs
        s, b, m = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, m // self.heads).permute(2, 1, 3, 0, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # [b, h, s, d]
        x = x + self.out(o.permute(2, 0, 1, 3).reshape(s, b, m))
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, aux + l_aux


class HeadPipe(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def forward(self, inputs):
        x, aux = inputs
        return self.head(self.ln(x)), aux


def make_loss(aux_loss_coef: float):
    def loss_fn(outputs, targets):                  # logits [s, b, V], targets [b, s]
        logits, aux = outputs
        ce = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.t().reshape(-1))
        return ce + aux_loss_coef * aux.sum()
    return loss_fn


def _batches(corpus, stream: str, step: int, replica: int, args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP replica's micro-batches of ``step``: rows of the step's global batch."""
    m, dp = args.micro_batches, args.dp
    if stream == "train":
        window = data.train_batch(corpus, step, args.micro * m * dp, args.seq, args.seed)
    else:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 - 2)
        window = data.windows(corpus.held_out, args.micro * m * dp, args.seq, g)
    rows = window[replica * m * args.micro: (replica + 1) * m * args.micro]
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in rows.split(args.micro)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    for name, default in (("steps", 12), ("warmup-steps", 2), ("layers", 2), ("hidden", 128), ("heads", 4),
                          ("ffn", 512), ("experts", 4), ("k", 2), ("seq", 256), ("micro", 2),
                          ("micro-batches", 4), ("seed", 1234)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--capacity-factor", type=float, default=2.0)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--rows", default="atlas",
                   help="comma list of runs, each from the same initial weights: stock (DeepSpeed's own "
                        "pipeline sends) and/or atlas")
    p.add_argument("--deepspeed_config", default=str(ROOT / "configs" / "gpt_cpu.json"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist

    import launch.run.runtime as atlas

    plan = atlas.init()
    if plan is None or plan.pp != 2:
        raise ValueError("examples/gpt/pipeline.py runs under deepspeed-atlas with a 2-stage plan")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    args.dp = plan.dp
    rows = args.rows.split(",")
    if not rows or any(r not in ("stock", "atlas") for r in rows) or len(set(rows)) != len(rows):
        raise ValueError(f"--rows {args.rows!r}: a comma list of distinct 'stock' and 'atlas'")
    corpus = data.Corpus.load()
    far = {h.addr for h in plan.hosts if h.dc != plan.dc_of(dist.get_rank()) and h.addr} or None
    out = {"rank": dist.get_rank(), "rows": {}}
    for row in rows:
        out["rows"][row] = train_row(args, plan, corpus, far, stock=row == "stock")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.barrier()


def train_row(args, plan, corpus, far, stock: bool) -> dict:
    """One run from the seeded initial weights (a fresh model and engine): this rank's report."""
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_plugins
    import launch.run.runtime as atlas
    from commweave import ledger
    from examples.atlas_pipeline import probe_link, time_instructions
    from examples.gpt.train import counted

    specs = [LayerSpec(EmbedPipe, args.hidden, args.seq)]
    specs += [LayerSpec(BlockPipe, args.hidden, args.heads, args.ffn, args.experts, plan.dp, args.k,
                        args.capacity_factor) for _ in range(args.layers)]
    specs += [LayerSpec(HeadPipe, args.hidden)]
    model = PipelineModule(specs, topology=atlas.pipe_topology(plan), loss_fn=make_loss(args.aux_loss_coef),
                           partition_method="type:BlockPipe")
    stage, replica = model._topo.get_coord(dist.get_rank()).pipe, model._topo.get_coord(dist.get_rank()).data
    init_weights(model, args.seed, first_expert=replica * args.experts // plan.dp)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    config.update(train_micro_batch_size_per_gpu=args.micro, gradient_accumulation_steps=args.micro_batches,
                  train_batch_size=args.micro * args.micro_batches * plan.dp)
    config.pop("scheduler", None)
    engine, *_ = ds_plugins.initialize(model=model, model_parameters=model.parameters(), config=config)
    wan = None if stock else atlas.enable_deepspeed(plan)
    book, losses, step_ms, op_seconds, link = ledger.Ledger(), [], [], {}, None
    for step in range(args.steps):
        if step == args.warmup_steps:
            # the link as the timed steps' sends see it, measured just before them (launch.net.pingpong)
            link = probe_link(plan, wan, 1 if wan is None else wan.wan.connections, far)
            time_instructions(engine, op_seconds)
        batches = iter(_batches(corpus, "train", step, replica, args))
        start = time.perf_counter()
        with counted(book if step >= args.warmup_steps else ledger.Ledger()):
            loss = engine.train_batch(data_iter=batches)
        if step >= args.warmup_steps:
            step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss))
    if "_INSTRUCTION_MAP" in vars(engine):
        del engine._INSTRUCTION_MAP
    held_out = float(engine.eval_batch(iter(_batches(corpus, "held_out", 0, replica, args))))
    timed = args.steps - args.warmup_steps
    report = {"stage": stage, "replica": replica, "dc": plan.dc_of(dist.get_rank()),
              "losses": losses, "held_out": held_out, "step_ms": step_ms,
              "tokens_per_step": args.micro * args.micro_batches * plan.dp * args.seq,
              "sent": {k: v["sent"] / timed for k, v in book.as_dict().items() if v["sent"]},
              "ops": {k: statistics.median(v) for k, v in op_seconds.items()},
              "act_bytes": args.seq * args.micro * args.hidden * 4,      # [s, b, h] fp32 (the CPU config)
              "wan_connections": 1 if stock else wan.wan.connections,
              "sharing": os.environ.get(atlas.ENV_SHARING, "spatial"), "stock_p2p": stock,
              "link": link, "micro_batches": args.micro_batches}
    if wan is not None:
        wan.undo()
    dist.barrier()
    return report


if __name__ == "__main__":
    main()
