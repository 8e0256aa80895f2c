"""The three schedules of a Parm MoE layer, each the table of parm.md §2 as code.

Shape legend: S tokens on this rank (replicated over the N MP ranks), M hidden, E experts, E_l local
experts, p = EP size, s = ESP size, C the gate's capacity, C_buf the padded buffer capacity, r chunks.
V = E·C_buf·M. Wire volumes per rank (forward; the backward mirrors them, §2.7):

    deepspeed  A2A(ep) 2·V(p-1)/p            AR(esp) inside the expert 2·F·M(s-1)/s
               (ESP = 1 with MP > 1: A2A(ep) 2·(V/N)(p-1)/p, AG(mp) V(N-1)/N, DeepSpeed's drop/gather)
    s2         A2A(ep) 2·(V/N)(p-1)/p        AG(esp) + RS(esp) 2·V(N-1)/N      AG(mp) V(N-1)/N
    s1         A2A(ep) 2·V₁(p-1)/p           AG(esp) + RS(esp) 2·V₁(N-1)       AG(mp) S·M(N-1)/N
               (V₁ = E·C₁·M, C₁ ≈ C/N: the most routes one block of S/N tokens sends one expert; the gate
               on all S tokens on every MP rank, as DeepSpeed's: no logits to gather)

plus, with ``skip_empty_slots`` (the default), the fill counts that let the experts skip the empty slots
(ds_plugins.overlap), each EP peer's with this rank's header (ds_plugins.agreement.HEADER int32 words):
A2A(ep) W·(p-1)/p and AG(esp) W·(s-1) bytes, W = (E + p·HEADER)·4, forward only. The experts then run on
the F rows that hold a token instead of all of them (F ≤ k·S·p·s/E rows per expert where the slots number
p·s·C_buf; "deepspeed" all-reduces F·M per expert, not C·p·M); the exchanges keep their fixed sizes.

And the agreement on sizes (ds_plugins.agreement), forward only: none where the forward is sync-free
(:func:`sync_free`: every fixed schedule, and "auto" (without dropping from its second forward on), with
the fill counts and ESP = MP or no MP), whose headers carry S, the mode and the capacity; elsewhere S and
the training flag before routing (AR(mp) of 4 int64, AR(ep) of 6) and, where the capacity depends on the
routes (no token dropping; always in S1), the capacity after routing (AR(mp) of 2 int64, AR(ep) of 3). The
headers are checked in every forward that sends them, the route hashes included: MP ranks that route
differently raise on every rank instead of mixing their slices (S2, S1) or all-reducing rows of different
sizes ("deepspeed").

Every schedule routes exactly as DeepSpeed's gate on all S tokens (ds_plugins.routing) and returns
``(output [S, M] replicated over MP, l_aux, exp_counts)``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from deepspeed.moe.sharded_moe import FIRST_ALLTOALL_TIMER, SECOND_ALLTOALL_TIMER

from ds_plugins import agreement, collectives, experts, moe_timers, overlap, routing, selector
from ds_plugins.dispatch import combine, dispatch


def _pad(capacity: int, multiple: int) -> int:
    return -(-capacity // multiple) * multiple


def _layout(layer, capacity: int, mp_split: bool) -> overlap.Layout:
    """Pad C so that every MP slice splits into equal chunks (parm.md §2.8); r is capped by the slots."""
    g, n = layer.parm_groups, layer.parm_groups.mp_size if mp_split else 1
    chunks = max(1, min(layer.overlap_chunks, math.ceil(capacity / n)))
    c_buf = _pad(capacity, n * chunks)
    return overlap.Layout(g, layer.num_experts, chunks, c_buf // (n * chunks), mp_split)


def _expert_pass(layer, x: torch.Tensor, r: routing.Routes, layout, capacity, schedule: str, run=None, *,
                 tokens: int | None = None, gather=None, shared: routing.Routes | None = None):
    """dispatch -> exchange to the experts -> the experts on their filled rows -> exchange back -> combine.

    ``layout(c)``: the overlap.Layout for the layer's capacity c; ``capacity``: this rank's, an int where it
    is the same on every rank by construction (the drop-mode C), else a 0-d device tensor (S1's most routes
    per block, the no-drop C): then the layer's (their largest) rides on the fill counts' headers where
    they reach every rank, and the layout and the dispatch wait for the headers; elsewhere it is agreed
    first (AR(mp), AR(ep)). ``run(xs)`` computes the local experts' partial sums (default: ESP-sharded, no
    all-reduce inside). With ``skip_empty_slots`` the fill counts travel with this rank's header
    (``tokens``, default S of ``x``; the hash of ``shared``, the routes the MP ranks must share;
    ``schedule``), gathered over ``gather`` (default the layer's ESP), and the headers are checked before
    the first exchange whose size depends on them.
    """
    g, e, s = layer.parm_groups, layer.num_experts, layer.parm_groups.esp_size
    deferred = not isinstance(capacity, int) and layer.skip_empty_slots and _full_view(g)
    if not isinstance(capacity, int) and not deferred:
        capacity = agreement.capacity(int(capacity), g, x.device)
    fills = None
    if layer.skip_empty_slots:
        hashed = None if shared is None else agreement.route_hash(shared.indices, shared.locations)
        head = agreement.header(x.shape[0] if tokens is None else tokens, layer.gate.training, None, hashed,
                                g, x.device, capacity, schedule)
        fills = overlap.FillExchange(routing.fill(r, e), head, g, g.esp if gather is None else gather)  # A2A
    if not deferred:                      # dispatch overlaps the fill counts' all-to-all
        lay = layout(capacity)
        buf = dispatch(x, r.indices, r.locations, e, lay.capacity)                # [E, C_buf, M]
    if fills is None:
        rows = overlap.Rows.every(lay, x.device)
    else:
        heads, counts = fills.read()                                              # AG(esp) of E int32
        agreed = agreement.check_headers(heads, g, layer.gate.drop_tokens)
        if _full_view(g):                 # every rank of the layer saw these headers, and passed them
            layer.seen_tokens = max(h[0] for h in heads)
        if deferred:
            lay = layout(agreed)
            buf = dispatch(x, r.indices, r.locations, e, lay.capacity)
        rows = fills.rows(counts, lay)
    with moe_timers.timed(layer.deepspeed_moe, FIRST_ALLTOALL_TIMER):
        hs = overlap.to_experts(buf, lay, rows)                                   # E_l x [F_j, M]
    ys = experts.partial_sums(layer.local_experts, hs, s) if run is None else run(hs)
    with moe_timers.timed(layer.deepspeed_moe, SECOND_ALLTOALL_TIMER):
        out = overlap.from_experts(ys, lay, rows)                                 # [E, C_buf, M]
    return combine(out, r.indices, r.locations, r.gates)


def _full_view(g) -> bool:
    """The fill exchange's headers reach every rank of the layer: it all-gathers over ESP = MP, or there is
    no MP (ds_plugins.agreement, HEADER)."""
    return g.mp is None or g.esp is not None


def sync_free(layer) -> bool:
    """Whether the layer's forward skips the token agreement (ds_plugins.agreement.tokens): its header
    travels with the fill counts instead, and is checked before any exchange whose size depends on it.

    Safe where (1) every schedule starts with the same fixed-size collectives, the fill exchange, after
    routing, which issues none (S1 gates the whole batch on every MP rank, ds_plugins.routing; the debug
    routing check all-gathers the routes, sized by S, so ``debug`` is off); (2) every rank of the layer
    runs the same schedule whatever its shape: a fixed one, or "auto" in drop mode, where every rank must
    hold the same S anyway (the headers raise otherwise; the header's schedule word catches the rest); in
    no-drop mode the EP groups may hold different counts, and "auto" decides from a count every rank
    holds alike (below); (3) the headers reach every rank of the layer: the fill exchange all-gathers over
    ESP = MP, or there is no MP (with ESP = 1 < MP a rank sees its EP group's headers only); (4) the fill
    counts travel at all (``skip_empty_slots``). A capacity that depends on the routes (S1's, the no-drop
    C) rides on the headers too (:func:`_expert_pass`). The layer's settings are agreed at set-up, so
    every rank of it decides alike.

    "auto" without dropping decides from the largest S of the layer's previous forward
    (``layer.seen_tokens``): every rank of the layer read the same headers there and passed the same
    check (or all raised and kept the value before), so every rank holds the same number and picks the
    same schedule, whatever its own S now. Its first forward, before any header was seen, agrees first.
    When the shapes repeat this is the pick from this forward's largest S; after a change the pick lags
    by one forward (a speed difference only: every schedule computes the same function).
    """
    g = layer.parm_groups
    chooses = layer.schedule == "auto" and len(selector.candidates(g)) > 1
    return (layer.skip_empty_slots and not layer.debug and _full_view(g)
            and (layer.gate.drop_tokens or not chooses or layer.seen_tokens is not None))


def refuse(layer, error: str) -> None:
    """A sync-free forward on a rank that refused its input (ds_plugins.inputs): it sends the header that
    says so where its peers send their fill counts (the same collectives), and raises what they raise."""
    g, device = layer.parm_groups, layer.gate.wg.weight.device
    head = agreement.header(0, layer.gate.training, error, None, g, device)
    fills = overlap.FillExchange(torch.zeros(layer.num_experts, dtype=torch.int32, device=device), head, g,
                                 g.esp)
    agreement.check_headers(fills.read()[0], g, layer.gate.drop_tokens, error)


def deepspeed(layer, x: torch.Tensor, used_token: torch.Tensor | None):
    """Baseline A (§2.1): everything on all S tokens on every MP rank, AR inside the expert."""
    g, e = layer.parm_groups, layer.num_experts
    r = routing.route(layer.gate, x, used_token)                                 # duplicated N×
    if layer.debug:
        routing.check_consistent(r, g.mp)
    if g.mp is not None and g.esp is None:
        # TP attention, unsharded experts: DeepSpeed then already dropped the MP duplicates before the A2A
        # and gathered after it (PR #2074, §2.1), in one piece: no chunks, nothing overlapped.
        n = g.mp_size
        out = _expert_pass(layer, x, r, lambda c: overlap.Layout(g, e, 1, _pad(c, n) // n, mp_split=True),
                           r.capacity, "deepspeed")
        return out, r.l_aux, r.exp_counts
    # Every MP rank sends its whole (duplicate) buffer over EP in one piece, and the ESP ranks' experts,
    # which thus receive the same rows, all-reduce their partial sums: A2A(ep) V, AR(esp) V.
    ep_only = replace(g, esp=None, esp_size=1, esp_rank=0)
    out = _expert_pass(layer, x, r, lambda c: overlap.Layout(ep_only, e, 1, c, mp_split=False), r.capacity,
                       "deepspeed", lambda hs: experts.tensor_parallel(layer.local_experts, hs, g.esp,
                                                                       g.esp_size),
                       gather=g.esp, shared=r if g.esp is not None else None)
    return out, r.l_aux, r.exp_counts


def s2(layer, x: torch.Tensor, used_token: torch.Tensor | None):
    """S2 (§2.4): gate on all S tokens, MP off after the gate (capacity split), on before combine."""
    g = layer.parm_groups
    r = routing.route(layer.gate, x, used_token)                                 # 1: duplicated N×
    if layer.debug:
        routing.check_consistent(r, g.mp)
    out = _expert_pass(layer, x, r, lambda c: _layout(layer, c, mp_split=True), r.capacity, "s2",  # 2-8
                       shared=r if g.esp is not None else None)                  # split, A2A, AG, RS, A2A,
    return out, r.l_aux, r.exp_counts                                            # AG(mp); 9


def s1(layer, x: torch.Tensor, used_token: torch.Tensor | None):
    """S1 (§2.3): MP off before the experts (token split), on after combine (AG over MP)."""
    g, tokens = layer.parm_groups, x.shape[0]
    x_l = collectives.split_rows(x, g.mp)                                        # 0: S -> S/N tokens
    r, most, full = routing.route_shard(layer.gate, x, x_l, used_token, g.mp, g.mp_rank, g.mp_size)
    out_l = _expert_pass(layer, x_l, r, lambda c: _layout(layer, c, mp_split=False), most, "s1",   # 1: gating
                         tokens=tokens, shared=full if g.esp is not None else None)  # on S; 2-7
    return collectives.gather_rows(out_l, g.mp, tokens), r.l_aux, r.exp_counts   # 8: AG(mp), S·M


SCHEDULES = {"deepspeed": deepspeed, "s1": s1, "s2": s2}
