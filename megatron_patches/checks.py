"""Input validation for wallfacer_attention: one rule set, applied to every rank's metadata on every rank.

A rank that raised on its own while the others entered the first collective would leave them
waiting until the backend's timeout. So each rank encodes what it was given (shapes, dtypes,
team size, layout, causal, scale) in a few integers, the group all-gathers them once, and every
rank runs the same checks over all ranks' metadata: the first violated rule is raised as the same
ValueError everywhere, before any of WallFacer's own communication.
"""

from __future__ import annotations

import math
import struct

import torch

from commweave import comm
from megatron_patches.layout import LAYOUTS, team_size_error

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = 22  # see _encode


def _shape(t) -> list[int]:
    if not isinstance(t, torch.Tensor):
        return [-1] * 5
    return [t.dim(), *(list(t.shape) + [-1] * 4)[:4]] if t.dim() <= 4 else [t.dim(), -1, -1, -1, -1]


def _dtype_code(t) -> int:
    return DTYPES.index(t.dtype) if isinstance(t, torch.Tensor) and t.dtype in DTYPES else -1


def _encode(q, k, v, team_size: int, causal: bool, scale: float | None, layout: str) -> list[int]:
    scale_bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0] if scale is not None else 0
    return (_shape(q) + _shape(k) + _shape(v) + [_dtype_code(t) for t in (q, k, v)]
            + [int(team_size), LAYOUTS.index(layout) if layout in LAYOUTS else -1, int(bool(causal)),
               scale_bits])


def _describe(m: list[int]) -> str:
    def shape(off):
        return "not a 4-d tensor" if m[off] != 4 else f"[{', '.join(map(str, m[off + 1:off + 5]))}]"

    dts = ["?" if c < 0 else str(DTYPES[c]).replace("torch.", "") for c in m[15:18]]
    return (f"q {shape(0)} {dts[0]}, k {shape(5)} {dts[1]}, v {shape(10)} {dts[2]}, team_size={m[18]}, "
            f"layout={LAYOUTS[m[19]] if m[19] >= 0 else '?'}, causal={bool(m[20])}, "
            f"softmax_scale={struct.unpack('<d', struct.pack('<q', m[21]))[0] if m[21] else None}")


def _rule_error(m: list[int], world: int, layout: str) -> str | None:
    """The first rule one rank's metadata breaks (wallfacer.md §2, §6, Megatron's [s, b, heads, dim])."""
    if m[0] != 4 or m[5] != 4 or m[10] != 4:
        return "q, k and v must be 4-d tensors [s_local, batch, heads, head_dim] (Megatron's layout)"
    (sq, bq, hq, dq), (sk, bk, hk, dk), vshape = m[1:5], m[6:10], m[11:15]
    if list(vshape) != [sk, bk, hk, dk]:
        return f"v has shape {vshape}, k has {[sk, bk, hk, dk]}: k and v must have the same shape"
    if (sq, bq, dq) != (sk, bk, dk):
        return (f"q [{sq}, {bq}, {hq}, {dq}] and k [{sk}, {bk}, {hk}, {dk}] must agree on s_local, batch "
                f"and head_dim (self-attention)")
    if min(sq, bq, hq, dq, hk) < 1:
        return f"q [{sq}, {bq}, {hq}, {dq}] and k [{sk}, {bk}, {hk}, {dk}] must have no empty dimension"
    if hq % hk:
        return (f"q has {hq} heads and k/v have {hk}: the query heads must be a multiple of the K/V heads "
                f"(GQA/MQA)")
    if -1 in m[15:18] or len(set(m[15:18])) != 1:
        return (f"q, k, v dtypes must be one of {[str(d).replace('torch.', '') for d in DTYPES]} and equal, "
                f"got {_describe(m).split(', team_size')[0]}")
    if m[19] < 0:
        return f"layout={layout!r} is not one of {LAYOUTS}"
    error = team_size_error(world, m[18])
    if error:
        return error
    if sq % 2:
        return (f"sequence length {world * sq} (= P·s_local = {world}·{sq}) must be divisible by 2·P = "
                f"{2 * world}: the {LAYOUTS[m[19]]} layout cuts it into 2P chunks, "
                f"two per rank")
    scale = struct.unpack("<d", struct.pack("<q", m[21]))[0] if m[21] else None
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return f"softmax_scale={scale} must be a finite number > 0"
    return None


def input_error(metas: list[list[int]], layout: str) -> str | None:
    """The error every rank raises for the gathered metadata of all ranks, or None."""
    world = len(metas)
    for r, m in enumerate(metas):
        error = _rule_error(m, world, layout)
        if error:
            where = "" if all(x == m for x in metas) else f"rank {r}: "
            return where + error
    for r, m in enumerate(metas[1:], start=1):
        if m != metas[0]:
            return (f"ranks disagree: rank {r} passes {_describe(m)}; rank 0 passes {_describe(metas[0])}. "
                    f"Every rank of the group must pass the same shapes, dtypes and arguments")
    return None


def check_inputs(q, k, v, group, team_size: int, causal: bool, softmax_scale: float | None,
                 layout: str) -> None:
    """Raise the same ValueError on every rank of ``group`` if any rank's inputs break a rule.

    One all-gather of 22 int64 per rank over ``group`` (the only communication before the checks).
    """
    mine = _encode(q, k, v, team_size, causal, softmax_scale, layout)
    world = comm.size(group)
    if world == 1:
        metas = [mine]
    else:
        device = q.device if isinstance(q, torch.Tensor) and q.device.type == "cuda" else torch.device("cpu")
        gathered = torch.empty(world, _FIELDS, dtype=torch.int64, device=device)
        comm.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device), group)
        metas = gathered.tolist()
    error = input_error(metas, layout)
    if error:
        raise ValueError(f"wallfacer_attention: {error}")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
