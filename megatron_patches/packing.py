"""Which stream positions each context-parallel rank's rows hold: dense sequences and packed documents.

Pure integer maths (no tensors, no communication). A *stream* is the micro-batch's sequence as one line of
positions 0 … T−1: a dense sequence, or Megatron's packed (THD) batch, whose documents are concatenated,
document i on [cu_seqlens_padded[i], cu_seqlens_padded[i+1]) with its cu_seqlens[i+1] − cu_seqlens[i]
valid tokens first (``PackedSeqParams``: global cumulative lengths, the same on every CP rank; without
``cu_seqlens_padded`` the documents touch). A rank's rows are *runs* ``(start, length, doc)``: ``length``
consecutive positions from ``start``, all of document ``doc`` or all padding (doc −1); ``shards(...)`` gives
every rank's runs in row order, each rank the same number of rows s.

Layouts (``layout``):

- ``zigzag``, per document: document d's span of L tokens is cut into 2P chunks; rank r holds chunks r and
  2P−1−r of every document, document after document. When 2P divides L the chunks are equal: that is
  TransformerEngine's ``thd_get_partitioned_indices``, what Megatron's ``get_thd_batch_on_this_cp_rank``
  hands each rank (and, with one document, ``get_batch_on_this_cp_rank``'s dense zigzag). Otherwise the
  chunks are q = ⌊L/2P⌋ tokens and ρ = L mod 2P of them one longer: the ρ extra tokens go to ranks in
  round-robin order across the whole batch (a rank gets at most two per document, one in each chunk; a
  single one alternates between its low and its high chunk from document to document), so after every
  document the ranks' row counts differ by at most one, and the batch needs (−T) mod P padding rows at
  the end — none when P divides T. TE instead pads every document to a multiple of 2P: up to 2P−1 rows
  per document, all of which every layer's projections and MLP then compute.
- ``contiguous``: rank r holds positions [r·s, (r+1)·s) (DeepSpeed-Ulysses', or a user's own split);
  padding (−T) mod P rows at the end.

Why per-document zigzag balances causal work (rows attend the earlier rows of their document, so a token
at offset i of its document costs i + 1 scores). With equal chunks of q tokens, rank r's two chunks of a
document cost q·(r·q) + q(q+1)/2 + q·((2P−1−r)·q) + q(q+1)/2 = 2P·q² + q, the same for every r: ring
attention (C = 1) is balanced document by document, whatever the lengths. With teams of C (rank (t, a)
attends team t's queries to the K/V of teams a, C + a, …, (G−1)·C + a, layout.py), team t holds chunks
tC … tC+C−1 and their mirrors, so for another team t′ one document adds (C·q)² for the low chunks of the
earlier team, (C·q)² for the high chunks of the later one and (C·q)² for every high × low pair: 2C²q²
for every (t, t′), and 2C²q² + Cq for t′ = t. Each rank's share is then G·2C²q² (+ Cq on the rank that
meets its own team's K/V): balanced to a relative 1/(2CqG). Uneven chunks move a document's share of a
rank by at most two tokens' worth (≤ 2L of ≈ L²/2P scores), and the round robin spreads those moves
over the ranks; tests/megatron_patches/test_packing.py measures the spread.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

LAYOUTS = ("zigzag", "contiguous")
PAD = -1  # the doc of padding rows: they attend nothing and nothing attends them


@dataclass(frozen=True)
class Packing:
    """Documents in one stream: ``spans[i] = (start, valid, length)``: document i's span starts at
    ``start`` and is ``length`` long, its first ``valid`` tokens real. ``total`` = the stream's length."""

    spans: tuple[tuple[int, int, int], ...]
    total: int

    @property
    def docs(self) -> int:
        return len(self.spans)

    @property
    def valid(self) -> int:
        return sum(v for _, v, _ in self.spans)

    def doc_start(self, doc: int) -> int:
        return self.spans[doc][0]


def dense(tokens: int) -> Packing:
    """One document of ``tokens`` tokens: a dense sequence."""
    return Packing(((0, tokens, tokens),), tokens)


def packing_error(cu: Sequence[int], padded: Sequence[int] | None) -> str | None:
    """Why cumulative lengths ``cu`` (and ``padded``) do not describe a packed batch, or None."""
    def bad(name, xs):
        if len(xs) < 2 or xs[0] != 0:
            return f"{name} must start at 0 and hold at least one document, got {list(xs)[:8]}"
        if any(b < a for a, b in itertools.pairwise(xs)):
            return f"{name} must be non-decreasing, got {list(xs)[:8]}{' ...' if len(xs) > 8 else ''}"
        if xs[-1] >= 2 ** 40:
            return f"{name} ends at {xs[-1]} tokens, more than 2**40"
        return None

    error = bad("cu_seqlens", cu)
    if error or padded is None:
        return error
    error = bad("cu_seqlens_padded", padded)
    if error:
        return error
    if len(padded) != len(cu):
        return f"cu_seqlens_padded has {len(padded)} entries, cu_seqlens {len(cu)}: one per document boundary"
    for i in range(len(cu) - 1):
        if cu[i + 1] - cu[i] > padded[i + 1] - padded[i]:
            return (f"document {i} has {cu[i + 1] - cu[i]} tokens but a padded span of "
                    f"{padded[i + 1] - padded[i]}: cu_seqlens_padded must leave room for every document")
    return None


def from_cu_seqlens(cu: Sequence[int], padded: Sequence[int] | None = None) -> Packing:
    """The Packing of Megatron's global cumulative lengths (ValueError if they are not one)."""
    cu = [int(x) for x in cu]
    padded = None if padded is None else [int(x) for x in padded]
    error = packing_error(cu, padded)
    if error:
        raise ValueError(error)
    ref = padded or cu
    spans = tuple((ref[i], cu[i + 1] - cu[i], ref[i + 1] - ref[i]) for i in range(len(cu) - 1))
    return Packing(spans, ref[-1])


def rows_per_rank(packing: Packing, world: int) -> int:
    """s: the rows every rank holds, ⌈T/P⌉ (both layouts)."""
    return -(-packing.total // world)


def padding(packing: Packing, world: int) -> int:
    """Rows of padding the layout adds at the end of the stream: (−T) mod P."""
    return rows_per_rank(packing, world) * world - packing.total


def _doc_runs(span: tuple[int, int, int], doc: int, start: int, length: int) -> list[tuple[int, int, int]]:
    """Positions [start, start+length) of one document's span as runs, cut where its padding begins."""
    first, valid, _ = span
    cut = min(max(first + valid - start, 0), length)
    runs = [(start, cut, doc)] if cut else []
    return runs + ([(start + cut, length - cut, PAD)] if length > cut else [])


def _zigzag(packing: Packing, world: int) -> list[list[tuple[int, int, int]]]:
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    nxt, toggle = 0, [0] * world  # the round robin's next rank; which chunk a rank's single extra takes
    for doc, span in enumerate(packing.spans):
        q, extra = divmod(span[2], 2 * world)
        got = [0] * world
        for _ in range(extra):
            got[nxt] += 1
            nxt = (nxt + 1) % world
        sizes = [q] * (2 * world)
        for r in range(world):
            lo = got[r] == 2 or (got[r] == 1 and toggle[r] == 0)
            if got[r] == 1:
                toggle[r] ^= 1
            sizes[r] += int(lo)
            sizes[2 * world - 1 - r] += got[r] - int(lo)
        starts = [span[0]]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        for r in range(world):
            for chunk in (r, 2 * world - 1 - r):
                if sizes[chunk]:
                    ranks[r] += _doc_runs(span, doc, starts[chunk], sizes[chunk])
    # The round robin gave ranks 0 … nxt−1 one more row than the others (if nxt > 0): one row of
    # padding each for ranks nxt … P−1, at the end of the stream.
    end = packing.total
    for r in range(nxt, world if nxt else 0):
        ranks[r].append((end, 1, PAD))
        end += 1
    return ranks


def _contiguous(packing: Packing, world: int) -> list[list[tuple[int, int, int]]]:
    s = rows_per_rank(packing, world)
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for r in range(world):
        lo, hi = r * s, (r + 1) * s
        for doc, span in enumerate(packing.spans):
            a, b = max(lo, span[0]), min(hi, span[0] + span[2])
            if a < b:
                ranks[r] += _doc_runs(span, doc, a, b - a)
        if hi > packing.total:
            a = max(lo, packing.total)
            ranks[r].append((a, hi - a, PAD))
    return ranks


def merge_runs(runs: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Adjacent runs of one document (or of padding) that continue each other, as one."""
    out: list[tuple[int, int, int]] = []
    for start, n, doc in runs:
        if out and out[-1][2] == doc and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n, doc)
        else:
            out.append((start, n, doc))
    return tuple(out)


@lru_cache(maxsize=64)
def shards(packing: Packing, layout: str, world: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Every rank's runs ``(start, length, doc)`` in row order, each rank ``rows_per_rank`` rows."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if world < 1:
        raise ValueError(f"the context-parallel group must have >= 1 rank, got P={world}")
    ranks = (_zigzag if layout == "zigzag" else _contiguous)(packing, world)
    return tuple(merge_runs(runs) for runs in ranks)


def rank_index(runs: Sequence[tuple[int, int, int]]) -> list[int]:
    """The stream position of each of a rank's rows (its batch is ``stream[:, index]``; positions past the
    stream's end are the layout's padding)."""
    return [start + i for start, n, _ in runs for i in range(n)]


def rank_positions(packing: Packing, runs: Sequence[tuple[int, int, int]], reset: bool) -> list[int]:
    """Each row's position id: its stream position, or (``reset``, Megatron's --reset-position-ids) its
    offset in its document; -1 for padding rows (any position is accepted there)."""
    return [-1 if doc == PAD else start + i - (packing.doc_start(doc) if reset else 0)
            for start, n, doc in runs for i in range(n)]


def causal_work(packing: Packing) -> int:
    """Scores of causal attention inside the documents: Σ L(L+1)/2 over valid lengths."""
    return sum(v * (v + 1) // 2 for _, v, _ in packing.spans)


def host_ints(x, name: str) -> list[int] | None:
    """A cumulative-lengths argument as Python ints: a 1-d integer tensor (or [1, n], as Megatron-LM's
    batch broadcast gives it), a list or tuple; None stays None."""
    if x is None:
        return None
    if hasattr(x, "tolist") and hasattr(x, "dim"):
        if x.dim() == 2 and x.shape[0] == 1:
            x = x[0]
        if x.dim() != 1 or x.is_floating_point() or x.is_complex():
            raise ValueError(f"{name} must be a 1-d integer tensor, got {x.dim()}-d {x.dtype}")
        return [int(v) for v in x.tolist()]
    if isinstance(x, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        return list(x)
    raise ValueError(f"{name} must be a 1-d integer tensor, got {type(x).__name__}")


def from_packed_seq_params(params) -> Packing:
    """The Packing of Megatron's ``PackedSeqParams`` (THD; self-attention: q and kv alike; no hybrid-CP
    group), or a ValueError naming what is wrong. Read once per object and tensor version: Megatron passes
    one object to every layer of a forward (one host copy of the lengths per batch, not per layer)."""
    keys = [getattr(params, n, None) for n in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                                                "cu_seqlens_kv_padded")]
    stamp = tuple((id(t), getattr(t, "_version", 0)) for t in keys)
    cached = getattr(params, "_commweave_packing", None)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    fmt = getattr(params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"qkv_format={fmt!r}: packed sequences come as 'thd' (Megatron's THD batch)")
    if getattr(params, "local_cp_size", None) is not None or getattr(params, "cp_group", None) is not None:
        raise ValueError("local_cp_size / cp_group (Megatron's hybrid context parallelism) are not supported")
    cu_q, cu_kv, pad_q, pad_kv = (host_ints(t, n) for t, n in zip(keys, ("cu_seqlens_q", "cu_seqlens_kv",
                                  "cu_seqlens_q_padded", "cu_seqlens_kv_padded"), strict=True))
    if cu_q is None:
        raise ValueError("packed sequences (THD, packed_seq_params) are not supported without cu_seqlens_q "
                         "(the global cumulative document lengths)")
    if (cu_kv is not None and cu_kv != cu_q) or (pad_kv is not None and pad_kv != pad_q):
        raise ValueError("cu_seqlens_kv (and cu_seqlens_kv_padded) must equal cu_seqlens_q (and _padded): "
                         "WallFacer is self-attention")
    pack = from_cu_seqlens(cu_q, pad_q)
    with contextlib.suppress(AttributeError):  # a frozen or slotted stand-in: read again next time
        params._commweave_packing = (stamp, pack)
    return pack
