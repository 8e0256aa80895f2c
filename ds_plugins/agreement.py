"""Sizes a layer's ranks agree on before any collective depends on them (parm.md §2.8; issue 9).

The exchanges of a Parm layer have sizes that come from each rank's own data: the token count S (the
drop-mode capacity is a function of S and of the train / eval capacity factor) and, without token
dropping, the capacity, the largest number of routes one expert receives. Two ranks that meet in a
collective with different sizes hang on NCCL (gloo may fail or hang too). So every forward first agrees
on them, with all-reduces on the layer's own groups only, never the world (under pipeline parallelism the
other stages are busy with other layers):

    t = [v, -v]                    MAX over MP -> the MP group's max and -min of every value
    u = [max, -min, max - min]     MAX over EP -> max and -min over the MP groups the EP group meets, and
                                                  the largest spread inside one of them

3n int64 per group for n values. Every rank of the layer (the MP groups its EP groups meet) gets the same
answer: in DeepSpeed's E+M+D layout and in its E+D layout where tp and ep divide one another, the EP
groups of all MP lanes meet the same MP groups. So a disagreement raises the same error on all of them,
before any collective whose sizes differ.

Two rounds use it: :func:`tokens` (every schedule, before routing: S and the training flag) and
:func:`capacity` (after routing, where the capacity depends on the routes: no-drop mode, and S1, whose
capacity is the largest number of routes one block of tokens sends one expert).

A rank whose input is refused (ds_plugins.inputs) says so in the training flag's slot (2 instead of 0 or
1), so no extra value travels: when the MAX shows a refusal, every rank of the layer takes one more,
error-only round that carries the refusing rank's message over MP, then EP (:func:`relay`), and raises
it. :func:`settings` agrees once, at set-up, on the layer's arguments (the schedule, the sizes) in the same
two hops.

Where the fill counts travel anyway (``skip_empty_slots``), each rank's S, flag, route hash, capacity and
schedule ride on them as a header (:data:`HEADER`, :func:`check_headers`): a fixed-size exchange every rank
issues whatever its shape, so a forward of any schedule ("auto" included; without dropping from its
second forward on, deciding from the previous forward's headers) needs no agreement of its own
(ds_plugins.schedules.sync_free) and reads the host once, and a rank whose shape changed still
meets its peers in that exchange and raises with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commweave import comm
from ds_plugins.config import SCHEDULES, path_id
from ds_plugins.groups import ParmGroups
from ds_plugins.inputs import NOISY_GATE_POLICIES

_REFUSED = 2  # the training flag's slot: 0 eval, 1 training, 2 this rank refused its input


@dataclass(frozen=True)
class Spread:
    """Per value: the minimum and maximum over the layer's ranks, and the largest max - min inside one MP
    group."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    mp: tuple[int, ...]


def spread(values: Sequence[int], g: ParmGroups, device: torch.device) -> Spread:
    """Agree on ``values`` over the layer's MP, then EP group (collective on both; module docstring)."""
    n = len(values)
    v = torch.tensor(list(values), dtype=torch.int64, device=device)
    t = torch.cat([v, -v])
    if g.mp is not None:
        comm.all_reduce(t, g.mp, op="max")
    u = torch.cat([t, t[:n] + t[n:]])
    if g.ep is not None:
        comm.all_reduce(u, g.ep, op="max")
    u = u.tolist()
    return Spread(lo=tuple(-x for x in u[n: 2 * n]), hi=tuple(u[:n]), mp=tuple(u[2 * n:]))


def relay(message: str | None, groups: Sequence, what: str = "parm MoE", **values: int) -> str | None:
    """``comm.disagreement`` over the first group, its verdict passed on verbatim over the next (MP, then EP),
    then once more over the first: a disagreement found in the EP round names that EP group's ranks, and
    the last round gives every rank the message of the first MP lane's EP group, so every rank of the layer
    ends with the same text (module docstring). Collective on each."""
    live = [group for group in groups if group is not None and comm.size(group) > 1]
    for i, group in enumerate(live + live[:1] if len(live) > 1 else live):
        message = comm.disagreement(group, what, message, relay=i > 0, **(values if i < len(live) else {}))
    return message


def tokens(num_tokens: int, training: bool, drop_tokens: bool, g: ParmGroups, device: torch.device,
           error: str | None = None) -> int:
    """The token count every rank of the layer works with (the largest; in drop mode they are all equal).

    Raises on every rank of the layer if a rank refused its input (``error``, this rank's reason, see
    ds_plugins.inputs; every rank raises the first refusing rank's), if the MP ranks hold different token
    counts (the MoE input is replicated over tensor-parallel ranks), if some ranks are in training and
    others in eval mode (the capacity factor differs), or, with ``drop_tokens``, if any two ranks hold
    different token counts (each rank's capacity, which sizes every exchange, is computed from its own
    count).
    """
    s = spread([num_tokens, _REFUSED if error is not None else int(training)], g, device)
    if s.hi[1] == _REFUSED:
        raise ValueError(relay(error, (g.mp, g.ep)) or error)
    _check_counts(s.lo[0], s.hi[0], bool(s.mp[0]), s.lo[1] != s.hi[1], drop_tokens)
    return s.hi[0]


def _check_counts(lo: int, hi: int, mp_differ: bool, modes_differ: bool, drop_tokens: bool) -> None:
    """The verdict on the layer's token counts (between ``lo`` and ``hi``) and modes, the same text from
    :func:`tokens` and from the headers (:func:`check_headers`)."""
    if mp_differ:
        raise ValueError("parm MoE: the tensor-parallel (MP) ranks of this layer hold different token "
                         f"counts (between {lo} and {hi}): the input of an MoE layer must be "
                         "replicated over the tensor-parallel ranks")
    if modes_differ:
        raise RuntimeError("parm MoE: some ranks of this layer are in training mode and others in eval "
                           "mode (their capacity factors differ): call model.train() / model.eval() on "
                           "every rank")
    if drop_tokens and lo != hi:
        raise ValueError("parm MoE: with drop_tokens=True every rank of a layer must hold the same number "
                         f"of tokens (the capacity, which sizes every exchange, is computed from it); got "
                         f"between {lo} and {hi}: give every rank batches of one size, or set "
                         "drop_tokens=False")


# The header (issue 23, item 4): HEADER int32 words every rank sends along its fill counts
# (ds_plugins.overlap.FillExchange), the same words to each EP peer, which all-gathers what it received
# over ESP:
#     [S, training flag (0, 1, or _REFUSED), global rank, first global rank of its MP group, routes' hash,
#      capacity, schedule (its index in ds_plugins.config.SCHEDULES), its MP rank]
# After the A2A over EP and the AG over ESP = MP, rank r holds the headers of the EP groups of its MP
# peers: in DeepSpeed's layouts that is every rank of the layer (the MP groups its EP groups meet, the
# set the two-hop :func:`spread` covers), so every rank reaches the same verdict from the same words,
# before any collective whose size depends on them. Where ESP = 1 < MP the AG is missing and a rank sees
# its EP group's headers only: there :func:`tokens` agrees first (ds_plugins.schedules.sync_free).
# The capacity word makes the capacity agreement (:func:`capacity`) unnecessary where the headers reach
# every rank: the layer's capacity is the largest of them (S1's, the no-drop C; ds_plugins.schedules). The
# schedule word: ranks that ran different schedules past the fill exchange would mix up their exchanges.
# The MP rank: S2 exchanges the slots [lo, lo + r·c_r) of its MP rank's slice, and where the capacity rides
# on the headers the sources send their whole fills before lo is known; the experts subtract each
# source's lo (ds_plugins.overlap.FillExchange.rows).
HEADER = 8
LANE = 7
"""The header word with the sender's MP rank."""
_PRIME = 2**31 - 1


def route_hash(indices: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
    """[1] int32 on the routes' device: sum over routes i of word_i · weight_i mod P = 2**31 - 1 (a prime),
    word_i = (expert + 2) · 1000003 + slot, weight_i = 40503 · i + 1, all in int64 without overflow (each
    product < 2**62, the sum of k·S < 2**31 of them reduced < 2**62). Equal routes hash equal; routes that
    differ hash equal with a chance of about 2**-31. Device ops only (no host read)."""
    words = ((indices.long().reshape(-1) + 2) * 1000003 + locations.long().reshape(-1)) % _PRIME
    weights = (torch.arange(words.numel(), device=words.device, dtype=torch.int64) * 40503 + 1) % _PRIME
    return ((words * weights % _PRIME).sum() % _PRIME).to(torch.int32).reshape(1)


def header(num_tokens: int, training: bool, error: str | None, hashed: torch.Tensor | None, g: ParmGroups,
           device: torch.device, capacity: int | torch.Tensor = 0, schedule: str = "auto") -> torch.Tensor:
    """This rank's header, [HEADER] int32 on ``device``, built with scalar fills and device copies (kernel
    launches, no host-to-device copy that would wait for the stream). ``hashed``: :func:`route_hash` of
    the full-batch routes the MP ranks share, or None where no MP peer sees this header; ``capacity``:
    this rank's (an int, or a 0-d device tensor: S1's, the no-drop C); ``schedule``: the one it runs."""
    rank = dist.get_rank()
    head = torch.zeros(HEADER, dtype=torch.int32, device=device)
    head[0] = num_tokens
    head[1] = _REFUSED if error is not None else int(training)
    head[2] = rank
    head[3] = rank if g.mp is None else comm.global_rank(g.mp, 0)
    if hashed is not None:
        head[4:5] = hashed
    head[5:6] = capacity.reshape(1) if isinstance(capacity, torch.Tensor) else capacity
    head[6] = SCHEDULES.index(schedule)
    head[LANE] = g.mp_rank
    return head


def check_headers(heads: Sequence[Sequence[int]], g: ParmGroups, drop_tokens: bool,
                  error: str | None = None) -> int:
    """Raise on every rank that holds the same ``heads`` (the :data:`HEADER` words of the ranks it saw,
    host ints) what :func:`tokens` and :func:`capacity` raise, and a RuntimeError when two MP ranks of one
    group hashed different routes (they would exchange buffers of different sizes: "deepspeed"'s
    all-reduce of the filled rows inside the experts aborts gloo) or ranks run different schedules.
    Returns the largest capacity.
    Collective only when a rank refused (:func:`relay`)."""
    seen = {h[2]: h for h in heads}                                  # by global rank, each once
    if any(h[1] == _REFUSED for h in seen.values()):
        raise ValueError(relay(error, (g.mp, g.ep)) or error)
    by_mp: dict[int, list[Sequence[int]]] = {}
    for h in seen.values():
        by_mp.setdefault(h[3], []).append(h)
    counts = [h[0] for h in seen.values()]
    _check_counts(min(counts), max(counts), any(len({h[0] for h in hs}) > 1 for hs in by_mp.values()),
                  len({h[1] for h in seen.values()}) > 1, drop_tokens)
    ran = {r: SCHEDULES[h[6]] for r, h in sorted(seen.items())}
    if len(set(ran.values())) > 1:
        raise RuntimeError(f"parm MoE: the ranks of this layer run different schedules ({ran} by global "
                           "rank): every rank of a layer must take the same schedule ('auto' decides from "
                           "the token count, the mode, the input dtype and the fitted costs: give every rank "
                           "the same of each)")
    capacities = [h[5] for h in seen.values()]
    if any(len({h[5] for h in hs}) > 1 for hs in by_mp.values()):
        _routing_differs(f"capacities between {min(capacities)} and {max(capacities)}")
    split = sorted(r for hs in by_mp.values() if len({h[4] for h in hs}) > 1 for r in (h[2] for h in hs))
    if split:
        _routing_differs(f"ranks {split}: their routes hash differently")
    return max(capacities)


def _routing_differs(why: str) -> None:
    raise RuntimeError("parm MoE: routing differs across the tensor-parallel (MP) ranks of this layer "
                       f"({why}): give every MP rank the same input and gate weights and seed their RNGs "
                       "identically before the MoE layer (the gate draws random numbers)")


def capacity(local: int, g: ParmGroups, device: torch.device) -> int:
    """The capacity of the layer's buffers: the largest ``local`` over its ranks. The MP ranks route the
    same tokens, so theirs must be equal: if not, routing differs across them and this raises on every
    rank of the layer (instead of hanging in an exchange of mismatched sizes)."""
    s = spread([local], g, device)
    if s.mp[0]:
        _routing_differs(f"capacities between {s.lo[0]} and {s.hi[0]}")
    return s.hi[0]


def settings(layer, mp_group, ep_group, error: str | None = None) -> None:
    """At set-up: raise on every rank of the layer if one refused its arguments (``error``) or the ranks
    built the layer differently (schedule, chunks, sizes, gating: a rank running S1 while its peers run S2
    would hang or mix up their exchanges). Two ``comm.disagreement`` rounds, over MP then EP."""
    gate = layer.gate
    values = dict(schedule=SCHEDULES.index(layer.schedule), overlap_chunks=layer.overlap_chunks,
                  skip_empty_slots=int(layer.skip_empty_slots), debug=int(layer.debug),
                  hidden_size=gate.wg.in_features, num_experts=layer.num_experts, ep_size=layer.ep_size,
                  k=gate.k, min_capacity=gate.min_capacity, capacity_factor=float(gate.capacity_factor),
                  eval_capacity_factor=float(gate.eval_capacity_factor), drop_tokens=int(gate.drop_tokens),
                  use_rts=int(gate.use_rts), use_residual=int(layer.use_residual),
                  expert_tensor_parallel=int(layer.enable_expert_tensor_parallelism),
                  noisy_gate_policy=NOISY_GATE_POLICIES.index(gate.noisy_gate_policy),
                  cost_cache=path_id(layer.cost_cache))
    message = relay(error, (mp_group, ep_group), "ParmMoE layer settings", **values)
    if message is not None:
        raise ValueError(message)
