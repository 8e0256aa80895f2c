"""The main job's model in one process, as an oracle: full causal attention and a dense top-2 MoE.

Parameter names equal the distributed model's with one expert-parallel rank (``...deepspeed_moe.gate.wg``,
``...deepspeed_moe.experts.deepspeed_experts.<e>``), so ``examples.gpt.model.init_weights`` gives both the
same numbers. Nothing here is distributed: the MoE is the maths of DeepSpeed's ``top2gating`` without
drops (every token to its two arg-max experts, gates renormalised over the two), evaluated on each team's
tokens, as the distributed job gates them (its auxiliary loss is per team: ``mean(me·ce)·E²``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import data
from examples.gpt.model import VOCAB, expert_mlp, init_weights


def _node(**children) -> nn.Module:
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


class ReferenceGPT(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, ffn: int, experts: int, seq: int,
                 aux_loss_coef: float, world: int, tp: int) -> None:
        super().__init__()
        self.heads, self.experts, self.coef, self.world, self.tp = heads, experts, aux_loss_coef, world, tp
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(_node(
            ln1=nn.LayerNorm(hidden), ln2=nn.LayerNorm(hidden),
            attn=_node(qkv=nn.Linear(hidden, 3 * hidden), out=nn.Linear(hidden, hidden)),
            ffn=_node(moe=_node(deepspeed_moe=_node(
                gate=_node(wg=nn.Linear(hidden, experts, bias=False)),
                experts=_node(deepspeed_experts=nn.ModuleList(expert_mlp(hidden, ffn)
                                                              for _ in range(experts)))))))
            for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def attention(self, block, x: torch.Tensor) -> torch.Tensor:       # x [b, s, M], whole sequences
        b, s, m = x.shape
        q, k, v = block.attn.qkv(x).view(b, s, 3, self.heads, m // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # [b, h, s, d]
        return block.attn.out(o.transpose(1, 2).reshape(b, s, m))

    def moe(self, block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:   # x [S, M] one team's
        moe = block.ffn.moe.deepspeed_moe
        probs = F.softmax(F.linear(x.float(), moe.gate.wg.weight.float()), dim=1)   # fp32, as DeepSpeed
        first = probs.argmax(1)
        second = probs.masked_fill(F.one_hot(first, self.experts).bool(), float("-inf")).argmax(1)
        g1, g2 = probs.gather(1, first[:, None]), probs.gather(1, second[:, None])
        denom = (g1 + g2).clamp(min=torch.finfo(probs.dtype).eps)
        outs = torch.stack([e(x) for e in moe.experts.deepspeed_experts], 1)  # [S, E, M]
        rows = torch.arange(len(x))
        y = (g1 / denom) * outs[rows, first] + (g2 / denom) * outs[rows, second]
        l_aux = torch.mean(probs.mean(0) * F.one_hot(first, self.experts).float().mean(0)) * self.experts ** 2
        return y, l_aux

    def forward(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(objective the job minimises, mean cross entropy) of ``[b, seq + 1]`` windows."""
        tokens, targets = window[:, :-1], window[:, 1:]
        b, s = tokens.shape
        x = self.tokens(tokens) + self.positions(torch.arange(s))
        # The team t of the job holds the zigzag shards of ranks t·tp .. t·tp+tp-1, rank by rank.
        teams = [torch.cat([data.zigzag_index(s, self.world, r) for r in range(t * self.tp, (t + 1) * self.tp)
                            ]) for t in range(self.world // self.tp)]
        aux = x.new_zeros(())
        for block in self.blocks:
            x = x + self.attention(block, block.ln1(x))
            h, out = block.ln2(x), torch.zeros_like(x)
            for idx in teams:
                y, l_aux = self.moe(block, h[:, idx].transpose(0, 1).reshape(-1, h.shape[-1]))
                out[:, idx] = y.view(len(idx), b, -1).transpose(0, 1)
                aux = aux + l_aux / len(teams)
            x = x + out
        ce = F.cross_entropy(self.head(self.ln(x)).reshape(-1, VOCAB), targets.reshape(-1))
        return ce + self.coef * aux, ce.detach()


def reference_losses(args, corpus: data.Corpus, world: int, lr: float) -> list[float]:
    """Train losses of ``args.steps`` steps of SGD on the job's batches, in one process."""
    model = ReferenceGPT(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn,
                         experts=args.experts, seq=args.seq, aux_loss_coef=args.aux_loss_coef, world=world,
                         tp=args.tp)
    init_weights(model, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(args.steps):
        objective, ce = model(data.train_batch(corpus, step, args.batch, args.seq, args.seed))
        opt.zero_grad()
        objective.backward()
        opt.step()
        losses.append(ce.item())
    return losses
