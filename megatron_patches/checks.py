"""Input validation for wallfacer_attention: one rule set, applied to every rank's metadata on every rank.

A rank that raised on its own while the others entered the first collective would leave them
waiting until the backend's timeout. So each rank encodes what it was given (shapes, dtypes,
team size, layout, causal, scale, and the options that decide the communication: backward and the
placement order) in a few integers, the group all-gathers them once, and every rank runs the
same checks over all ranks' metadata: the first violated rule is raised as the same ValueError
everywhere, before any of WallFacer's own communication.

Arguments a rank can judge alone (an unknown backward or kernel, an order that is not a permutation,
a team size or scale that is not a number) are refused locally (:func:`refusal`); the metadata then
carries a "refused" bit, and only in that case one more round (``comm.disagreement``) brings the
refusing rank's message to every rank.

The kernel and ``deterministic`` may differ between ranks (they change a rank's arithmetic, not what it
sends): they are not compared.

Field layout (``_encode``): q, k, v shapes (5 each: rank, 4 sizes), 3 dtype codes, team size, an
options word (layout | backward << 2 | refused << 8), causal | the order's CRC-32 << 1, the softmax
scale's bits, and the packed batch's documents (their CRC-32, 0 when dense; the stream's tokens).
"""

from __future__ import annotations

import math
import struct
import zlib

import torch

from commweave import comm
from megatron_patches import block
from megatron_patches.layout import LAYOUTS, team_size_error

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKWARDS = ("auto", "kv", "q")
_FIELDS = 24  # see _encode
_INT_RANGE = 2 ** 31  # team sizes (and the hybrid's U) beyond this are refused locally: never sent


def _shape(t) -> list[int]:
    if not isinstance(t, torch.Tensor):
        return [-1] * 5
    return [t.dim(), *(list(t.shape) + [-1] * 4)[:4]] if t.dim() <= 4 else [t.dim(), -1, -1, -1, -1]


def _dtype_code(t) -> int:
    return DTYPES.index(t.dtype) if isinstance(t, torch.Tensor) and t.dtype in DTYPES else -1


def _code(value, allowed: tuple, invalid: int) -> int:
    return allowed.index(value) if isinstance(value, str) and value in allowed else invalid


def _order_crc(order) -> int:
    """0 for the identity (None, empty or range(P)), else the CRC-32 of the permutation."""
    try:
        if not order or list(order) == list(range(len(order))):
            return 0
        return zlib.crc32(struct.pack(f"<{len(order)}q", *order))
    except (TypeError, struct.error):
        return 0


def _packing_key(pack) -> list[int]:
    """[CRC-32 of the documents' spans, stream tokens]: [0, 0] for a dense sequence."""
    if pack is None:
        return [0, 0]
    flat = [x for span in pack.spans for x in span]
    return [zlib.crc32(struct.pack(f"<{len(flat)}q", *flat)) | 1, pack.total]


def _encode(q, k, v, team_size: int, causal: bool, scale: float | None, layout: str, *,
            backward: str = "auto", order=None, refused: bool = False, pack=None) -> list[int]:
    try:
        scale_bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0] if scale is not None else 0
    except (TypeError, ValueError):
        scale_bits = struct.unpack("<q", struct.pack("<d", float("nan")))[0]
    options = _code(layout, LAYOUTS, 3) | _code(backward, BACKWARDS, 3) << 2 | int(refused) << 8
    team = team_size if _int_in_range(team_size) else -1
    return (_shape(q) + _shape(k) + _shape(v) + [_dtype_code(t) for t in (q, k, v)]
            + [team, options, int(causal is True) | _order_crc(order) << 1, scale_bits] + _packing_key(pack))


def _int_in_range(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and -_INT_RANGE < x < _INT_RANGE


def _options(m: list[int]) -> dict:
    o = m[19]
    return {"layout": LAYOUTS[o & 3] if o & 3 < len(LAYOUTS) else "?",
            "backward": BACKWARDS[o >> 2 & 3] if o >> 2 & 3 < len(BACKWARDS) else "?",
            "refused": bool(o >> 8 & 1), "causal": bool(m[20] & 1),
            "order": f"crc {m[20] >> 1:08x}" if m[20] >> 1 else "identity"}


def _describe(m: list[int]) -> str:
    def shape(off):
        return "not a 4-d tensor" if m[off] != 4 else f"[{', '.join(map(str, m[off + 1:off + 5]))}]"

    dts = ["?" if c < 0 else str(DTYPES[c]).replace("torch.", "") for c in m[15:18]]
    o = _options(m)
    return (f"q {shape(0)} {dts[0]}, k {shape(5)} {dts[1]}, v {shape(10)} {dts[2]}, team_size={m[18]}, "
            f"layout={o['layout']}, causal={o['causal']}, "
            f"softmax_scale={struct.unpack('<d', struct.pack('<q', m[21]))[0] if m[21] else None}, "
            f"backward={o['backward']}, order={o['order']}"
            + (f", packed: {m[23]} tokens, documents crc {m[22]:08x}" if m[22] else ""))


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
    if m[19] & 3 >= len(LAYOUTS):
        return f"layout={layout!r} is not one of {LAYOUTS}"
    error = team_size_error(world, m[18])
    if error:
        return error
    if m[22]:  # packed: the layout's rows per rank for a stream of m[23] tokens (packing.rows_per_rank)
        rows = -(-m[23] // world)
        if sq != rows:
            return (f"the packed batch is a stream of {m[23]} tokens: every rank holds ⌈{m[23]}/P⌉ = {rows} "
                    f"rows of it in the {_options(m)['layout']} layout "
                    f"(packing.get_packed_batch_on_this_cp_rank), got s_local = {sq}")
    elif sq % 2:
        return (f"sequence length {world * sq} (= P·s_local = {world}·{sq}) must be divisible by 2·P = "
                f"{2 * world}: the {_options(m)['layout']} layout cuts it into 2P chunks, "
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
    # name the rank out of line: the first that differs from what most ranks pass (rank 0's on a tie)
    common = max(metas, key=metas.count)
    odd = next((r for r, m in enumerate(metas) if m != common), None)
    if odd is None:
        return None
    ref = metas.index(common)
    return (f"ranks disagree: rank {odd} passes {_describe(metas[odd])}; rank {ref} passes "
            f"{_describe(common)}. Every rank of the group must pass the same shapes, dtypes and arguments")


def refusal(q, team_size, softmax_scale, world: int, *, layout: str = "zigzag", backward: str = "auto",
            kernel="auto", order=None, deterministic: bool = False, causal: bool = True) -> str | None:
    """What this rank alone can tell is wrong with its arguments (the value is only known here), or None.

    Integers that could not travel as int64 are refused here, so the agreement only ever carries values
    in range; flags must be bools (a string such as "false" is truthy and would silently mean True)."""
    if not isinstance(team_size, int) or isinstance(team_size, bool):
        return f"team_size={team_size!r} must be an integer (C, C² dividing P={world})"
    if not 1 <= team_size <= world:
        return team_size_error(world, team_size)
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            return (f"{name}={flag!r} must be a bool (True or False); strings and numbers are refused, not "
                    f"read as truth values")
    number = isinstance(softmax_scale, int | float) and not isinstance(softmax_scale, bool)
    if softmax_scale is not None and not (number and math.isfinite(softmax_scale) and softmax_scale > 0):
        return f"softmax_scale={softmax_scale!r} must be a finite number > 0 or None (1/sqrt(head_dim))"
    if layout not in LAYOUTS:
        return f"layout={layout!r} is not one of {LAYOUTS}"
    if backward not in BACKWARDS:
        return f"backward={backward!r} is not one of {BACKWARDS}"
    if order:
        try:
            ok = sorted(order) == list(range(world))
        except TypeError:
            ok = False
        if not ok:
            return f"order={list(order) if isinstance(order, list | tuple) else order!r} must be a " \
                   f"permutation of range({world}) (slot -> CP rank, placement.py)"
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.dtype in DTYPES:
        try:
            block.select_kernel(kernel, q.device, q.dtype, deterministic, head_dim=q.shape[3])
        except ValueError as e:
            return str(e)
    return None


def check_inputs(q, k, v, group, team_size: int, causal: bool, softmax_scale: float | None,
                 layout: str, *, backward: str = "auto", kernel="auto", order=None,
                 deterministic: bool = False, error: str | None = None, packing=None) -> None:
    """Raise the same ValueError on every rank of ``group`` if any rank's inputs break a rule.

    ``error``: a refusal the caller made itself (WallFacerAttention's forward), raised on every rank.
    ``packing``: the packed batch's documents (packing.Packing), compared across ranks by checksum.
    One all-gather of 24 int64 per rank over ``group`` (the only communication before the checks; one
    more, with the message, when a rank refused its arguments, see :func:`refusal`).
    """
    world = comm.size(group)
    refused = error or refusal(q, team_size, softmax_scale, world, layout=layout, backward=backward,
                               kernel=kernel, order=order, deterministic=deterministic, causal=causal)
    mine = _encode(q, k, v, team_size, causal, softmax_scale, layout, backward=backward, order=order,
                   refused=refused is not None, pack=packing)
    if world == 1:
        metas = [mine]
    else:
        device = q.device if isinstance(q, torch.Tensor) and q.device.type == "cuda" else torch.device("cpu")
        gathered = torch.empty(world, _FIELDS, dtype=torch.int64, device=device)
        comm.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device), group)
        metas = gathered.tolist()
    if any(_options(m)["refused"] for m in metas):
        message = refused if world == 1 else comm.disagreement(group, "wallfacer_attention", refused)
        raise ValueError(f"wallfacer_attention: {message}")
    error = input_error(metas, layout)
    if error:
        raise ValueError(f"wallfacer_attention: {error}")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
