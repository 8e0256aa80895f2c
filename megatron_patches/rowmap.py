"""A team's rows sorted by stream position, and the kernel calls between two teams' rows.

Pure integer maths over packing.py's runs. A team all-gathers its C members' rows ("all-gather order":
member after member, each in its own row order); the team tensors hold the same rows sorted by stream
position (team.gather_team), so that

- every document's rows are one contiguous range (documents are contiguous in the stream, and a
  document's padding follows its valid tokens), and
- inside a document, row order is position order: a causal block of one document is a kernel call with
  the causal flag on a square block, and the earlier keys of any query run are a prefix of its
  document's keys.

The rule between a query run and a key run (both of document d, disjoint ranges of positions, or the same
run): keys entirely before the queries: full; the same run: causal diagonal; after: skipped. Different
documents (or padding) are never paired: a packed batch computes only the scores of its documents.
Accumulators that are reduce-scattered stay in all-gather order; ``TeamRows.pieces`` says where a sorted
row range lives there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from megatron_patches.packing import PAD

Runs = tuple[tuple[int, int, int], ...]  # (stream start, length, doc) in row order (packing.py)
Call = tuple[int, int, int, int, bool]  # (q0, q1, k0, k1, diagonal): sorted rows of a query and a key team


@dataclass(frozen=True)
class TeamRows:
    """One team's sorted rows. ``copies``: (sorted row, member, member row, length) — maximal runs that are
    consecutive both in the sorted rows and in one member's rows; ``runs``: (sorted row, length, stream
    start, doc) — maximal runs of one document (or of padding) consecutive in both rows and stream."""

    rows: int
    copies: tuple[tuple[int, int, int, int], ...]
    runs: tuple[tuple[int, int, int, int], ...]

    @property
    def identity(self) -> bool:
        """The sorted rows are the all-gather order (one member, already ascending): no copy needed."""
        return len(self.copies) == 1

    def pieces(self, first: int, stop: int) -> list[tuple[slice, slice, int, slice]]:
        """Where sorted rows [first, stop) live in the all-gather order: (rows of a result over the range,
        sorted rows, member, that member's rows), for each copy run the range meets."""
        out = []
        for row, member, mrow, n in self.copies:
            a, b = max(first, row), min(stop, row + n)
            if a < b:
                out.append((slice(a - first, b - first), slice(a, b), member,
                            slice(mrow + a - row, mrow + b - row)))
        return out

    def doc_ranges(self) -> dict[int, tuple[int, int]]:
        """doc → its [first, stop) sorted rows (padding left out)."""
        out: dict[int, tuple[int, int]] = {}
        for row, n, _, doc in self.runs:
            if doc != PAD:
                a = out.get(doc, (row, row))[0]
                out[doc] = (a, row + n)
        return out


@lru_cache(maxsize=1024)
def team_rows(member_runs: tuple[Runs, ...]) -> TeamRows:
    """The TeamRows of members whose runs (in all-gather order) are ``member_runs``."""
    pieces = []  # (stream start, length, doc, member, member row)
    for member, runs in enumerate(member_runs):
        row = 0
        for start, n, doc in runs:
            pieces.append((start, n, doc, member, row))
            row += n
    pieces.sort()
    copies: list[tuple[int, int, int, int]] = []
    runs_out: list[tuple[int, int, int, int]] = []
    row = 0
    for start, n, doc, member, mrow in pieces:
        last = copies[-1] if copies else None
        if last and last[1] == member and last[2] + last[3] == mrow:
            copies[-1] = (last[0], member, last[2], last[3] + n)
        else:
            copies.append((row, member, mrow, n))
        lr = runs_out[-1] if runs_out else None
        if lr and lr[3] == doc and lr[2] + lr[1] == start:
            runs_out[-1] = (lr[0], lr[1] + n, lr[2], doc)
        else:
            runs_out.append((row, n, start, doc))
        row += n
    return TeamRows(row, tuple(copies), tuple(runs_out))


@lru_cache(maxsize=4096)
def block_calls(q: TeamRows, k: TeamRows, causal: bool, same: bool) -> tuple[Call, ...]:
    """The kernel calls ``(q0, q1, k0, k1, diagonal)`` (sorted rows) covering one team's queries ``q`` against
    one team's keys ``k`` (``same``: the same team, the same rows), document by document.

    Each query row is in at most one call. Non-causal: a document's queries × its keys. Causal, same team:
    one causal call per document (rows sorted by position, so causal by row is causal by position).
    Causal, different teams: each query run × the keys of its document before it — a prefix of the
    document's keys, since they are sorted; neighbouring runs that see the same prefix are one call.
    """
    k_docs = k.doc_ranges()
    if not causal or same:
        return tuple((a, b, *k_docs[doc], causal) for doc, (a, b) in q.doc_ranges().items() if doc in k_docs)
    k_runs: dict[int, list[tuple[int, int, int]]] = {}
    for row, n, start, doc in k.runs:
        if doc != PAD:
            k_runs.setdefault(doc, []).append((start, row, row + n))
    calls: list[tuple[int, int, int, int, bool]] = []
    for row, n, start, doc in q.runs:
        if doc == PAD or doc not in k_runs:
            continue
        before = [stop for s, _, stop in k_runs[doc] if s < start]
        if not before:
            continue
        k0, k1 = k_docs[doc][0], max(before)
        if calls and calls[-1][1] == row and calls[-1][2:4] == (k0, k1):
            calls[-1] = (calls[-1][0], row + n, k0, k1, False)
        else:
            calls.append((row, row + n, k0, k1, False))
    return tuple(calls)


def call_scores(calls: Sequence[Call]) -> int:
    """Scores the calls compute (a causal n x n block: n(n+1)/2; flash-attention and ATen skip the rest)."""
    return sum((q1 - q0) * (q1 - q0 + 1) // 2 if diag else (q1 - q0) * (k1 - k0)
               for q0, q1, k0, k1, diag in calls)


def rank_scores(shards: Sequence[Runs], lay, causal: bool = True) -> list[int]:
    """The scores each rank of WallFacer's layout ``lay`` (layout.Layout) computes in one forward on rows
    ``shards`` (the backward's block calls are the same): rank (t, a) attends team t's queries to the K/V
    of the teams its sub-ring brings (lay.kv_team)."""
    rows = [team_rows(tuple(shards[r] for r in lay.team_ranks(t))) for t in range(lay.teams)]
    out = []
    for r in range(lay.world):
        t = lay.team_of(r)
        teams = [lay.kv_team(r, i) for i in range(lay.ring_len)]
        out.append(sum(call_scores(block_calls(rows[t], rows[k], causal, t == k)) for k in teams))
    return out
