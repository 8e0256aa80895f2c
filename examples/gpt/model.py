"""A byte-level GPT whose feed-forward layers are DeepSpeed MoE layers and whose attention is WallFacer.

Shape legend: s = seq / P tokens on this rank (zigzag shard), b sequences, M hidden, h heads, d = M / h,
E experts, tp MP ranks per MoE team. Activations are sequence-first, ``[s, b, M]``, as in Megatron.

    embed(bytes) + embed(global positions)
    L x  [ x += attn(LN(x)):  qkv -> wallfacer_attention over the CP group (team size C; C = 1 is ring
                              attention) -> out
           x += moe(LN(x)):   gather the team's tokens [tp·s, b, M] -> deepspeed.moe.layer.MoE (top-k
                              gate, experts Linear-GELU-Linear) -> keep this rank's rows [s, b, M] ]
    LN -> head -> cross entropy on this rank's tokens

The model is written against DeepSpeed's MoE only: ``ds_plugins.initialize`` swaps in ParmMoE when the
config's "parm" section is enabled. The gate never drops a token (capacity factor >= E/k, checked), and
the second expert is the arg-max, not sampled, so DeepSpeed's MoE and every Parm schedule route every
token identically: the two runs compute the same function (layout.py for the gradient bookkeeping).

Weights are initialised from seeds by parameter name and by *global* expert id (:func:`init_weights`),
not by construction order, so a rank's experts, the single-process reference of the tests and both runs
start from the same numbers.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from torch import nn

from commweave import comm
from ds_plugins.collectives import copy_to, gather_rows, split_rows
from megatron_patches import wallfacer_attention

VOCAB = 256


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, cp_group, team_size: int) -> None:
        super().__init__()
        self.heads, self.cp_group, self.team_size = heads, cp_group, team_size
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, m = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, m // self.heads).unbind(2)   # [s, b, h, d] each
        o = wallfacer_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.cp_group, self.team_size,
                                causal=True)
        return self.out(o.reshape(s, b, m))


def expert_mlp(hidden: int, ffn: int) -> nn.Sequential:
    """Parm shards this plain MLP over ESP (fc1 by columns, fc2 by rows) by itself."""
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class MoEFeedForward(nn.Module):
    """The team's tokens through ``deepspeed.moe.layer.MoE``; returns this rank's rows and l_aux."""

    def __init__(self, hidden: int, ffn: int, experts: int, ep: int, k: int, capacity_factor: float,
                 mp_group) -> None:
        super().__init__()
        if capacity_factor * k < experts:
            raise ValueError(f"capacity factor {capacity_factor} x k {k} must be >= --experts {experts}: the "
                             "job compares runs whose gates must drop no token (DeepSpeed and Parm's S1 "
                             "would drop different ones)")
        self.mp_group, self.tp = mp_group, comm.size(mp_group)
        self.moe = MoE(hidden, expert_mlp(hidden, ffn), num_experts=experts, ep_size=ep, k=k,
                       capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor, min_capacity=0,
                       enable_expert_tensor_parallelism=True, top2_2nd_expert_sampling=False)
        # Every MP rank holds the team's whole gate gradient and DeepSpeed sums over all ranks (layout.py).
        self.moe.deepspeed_moe.gate.wg.weight.register_hook(self._gate_share)

    def _gate_share(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.tp

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        team = gather_rows(x, self.mp_group, self.tp * x.shape[0])                # [tp·s, b, M], replicated
        out, l_aux, _ = self.moe(team)
        return split_rows(out, self.mp_group), copy_to(l_aux, self.mp_group)     # [s, b, M]; l_aux grad: sum


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, ep: int, k: int,
                 capacity_factor: float, cp_group, team_size: int, mp_group) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, cp_group, team_size)
        self.ffn = MoEFeedForward(hidden, ffn, experts, ep, k, capacity_factor, mp_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        out, l_aux = self.ffn(self.ln2(x))
        return x + out, l_aux


class ByteGPT(nn.Module):
    """``forward(tokens [s, b], positions [s], targets [s, b])`` -> (loss to backpropagate, mean CE of
    this rank's tokens, summed l_aux); ``logits(tokens, positions)`` -> ``[s, b, 256]``."""

    def __init__(self, *, layers: int, hidden: int, heads: int, ffn: int, experts: int, ep: int, k: int,
                 capacity_factor: float, seq: int, aux_loss_coef: float, cp_group, team_size: int,
                 mp_group) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"--hidden {hidden} must be divisible by --heads {heads}")
        self.aux_loss_coef, self.tp = aux_loss_coef, comm.size(mp_group)
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, experts, ep, k, capacity_factor, cp_group,
                                          team_size, mp_group) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor):
        """(final hidden states [s, b, M] after the last norm, summed l_aux)."""
        x = self.tokens(tokens) + self.positions(positions)[:, None]
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return self.ln(x), aux

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden_states(tokens, positions)[0])

    def forward(self, tokens, positions, targets):
        x, aux = self.hidden_states(tokens, positions)
        ce = F.cross_entropy(self.head(x).float().view(-1, VOCAB), targets.reshape(-1))
        # DeepSpeed divides the summed gradients by W / tp (layout.py): ce / tp makes them the gradient
        # of the mean over all W ranks' tokens; l_aux is the team's, replicated, counted once per team.
        return (ce + self.aux_loss_coef * aux) / self.tp, ce.detach(), aux.detach()


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def init_tensor(t: torch.Tensor, seed: int, kind: str, fan_in: int) -> None:
    """GPT-2-like: weights N(0, 1/fan_in) (embeddings N(0, 0.02²)), biases 0, norms 1; from ``seed``."""
    with torch.no_grad():
        if kind in ("bias", "norm_bias"):
            t.zero_()
        elif kind == "norm_weight":
            t.fill_(1.0)
        else:
            std = 0.02 if kind == "embedding" else 1 / math.sqrt(fan_in)
            g = torch.Generator().manual_seed(seed)
            t.copy_(torch.randn(t.shape, generator=g) * std)


def _kind(name: str) -> str:
    owner = name.split(".")[-2]          # "tokens" in "tokens.weight" and in a pipeline's "0.tokens.weight"
    if owner in ("tokens", "positions"):
        return "embedding"
    if owner.startswith("ln"):
        return "norm_weight" if name.endswith("weight") else "norm_bias"
    return "weight" if name.endswith("weight") else "bias"


def param_seed(name: str, seed: int, first_expert: int = 0) -> int:
    """The seed of parameter ``name``; in ``...deepspeed_experts.<j>.<rest>`` the local expert j is
    renamed to its global id ``first_expert + j``, so the seed does not depend on the expert layout."""
    parts = name.split(".")
    if "deepspeed_experts" not in parts:
        return _seed(seed, name)
    j = parts.index("deepspeed_experts")
    parts[j + 1] = str(first_expert + int(parts[j + 1]))
    return _seed(seed, ".".join(parts))


def init_weights(model: nn.Module, seed: int, first_expert: int = 0) -> None:
    """Seeded init of every parameter; local expert j of this rank is global expert ``first_expert + j``."""
    for name, p in model.named_parameters():
        init_tensor(p, param_seed(name, seed, first_expert), _kind(name), p.shape[-1] if p.dim() > 1 else 1)
