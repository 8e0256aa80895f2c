"""The alpha-beta time model of one MoE layer's forward + backward under each schedule (parm.md §2.9).

Every operation costs t(n) = α + β·n (FSMoE §6.2): a collective on n bytes (the ledger's convention: A2A
and AR the per-rank buffer, AG the gathered output, RS the input), a GEMM on n flops, a local gather or
copy on n bytes. :class:`OpCosts` holds one :class:`commweave.cost.AlphaBeta` per operation, either
fitted on the real process groups (ds_plugins.selector) or derived from a cluster's links
(:func:`cluster_costs`, for projections).

A chunked exchange (parm.md §2.6) of r chunks through stages with per-chunk times t_1..t_L runs as a
wavefront of r + L - 1 steps; a step in which several stages run at once takes

    max(t_j) + γ·(Σ t_j - max(t_j)),   γ ∈ [0, 1] the overlap inefficiency (0: perfect, 1: serial),

γ itself measured (two collectives on different groups, alone and together) or given per cluster.

Schedules modelled (b bytes per element, V = E·C_buf·M·b; forward and backward of parm.md §2, §2.7):
    "ds-installed"  DeepSpeed 0.19.8's MOELayer with a tensor-parallel expert (§2.2): drop, A2A, AG,
                    expert with AR, drop, A2A, AG; nothing overlapped
    "deepspeed"     baseline A (§2.1): A2A of V, AR inside the expert
    "s1", "s2"      Parm's schedules with the chunked exchanges

Expert rows (``skip_empty_slots``, ds_plugins.overlap). DeepSpeed's experts run on every capacity slot;
with skipping they run on the slots that hold a token, which for a source gating S_g tokens into a
capacity C are Σ_e min(n_e, C) <= min(k·S_g, E·C) of its E·C slots (n_e: routes to expert e). The model
takes the balanced case, min(k·S_g/E, C) filled slots per expert and source, an upper bound (an
imbalanced gate drops more) and about 1/f of the slots for k·f > 1. Per local expert on one rank:

    S1            s·p·C_buf slots, s·p·min(k·S_g/E, C_buf) filled   (S_g = S/N; the s ESP peers' sources
                  gate different tokens)
    S2            s·p·C_buf/n slots, p·min(k·S/E, s·C_buf/n) filled   (the s ESP peers gather s of the n
                  MP slices of one source's capacity, filled from slot 0)

plus, for S1 and S2, the forward exchange of the fill counts: A2A over EP of E int32 and AG over ESP.

S1 gates the whole batch on every MP rank (ds_plugins.routing): the gate GEMM forward on all S tokens, its
two backward GEMMs on the S/N of its block, the gating's element-wise work on all S tokens; its buffer
holds the most routes one block of S/N tokens sends one expert, min(k·S/E, C)/N in the balanced case.

The agreements on sizes (ds_plugins.agreement) are predicted as "auto" runs the schedules in a steady
state (ds_plugins.schedules.sync_free): with the fill counts and ESP = MP (or no MP) the token count and the
capacity travel in the fill counts' headers and no schedule agrees on anything else; otherwise every
schedule agrees on the token count before routing (tiny all-reduces over MP and EP, charged as their α,
the EP one as an A2A of the same bytes, its latency class; the part "agree"), and S1 on its capacity
too. The fill exchange (E + p·HEADER int32 per rank) is an A2A over EP and, in every schedule with ESP,
an AG over ESP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from commweave import cost
from commweave.cost import AlphaBeta

HEADER = 8
"""int32 words of a rank's header on the fill counts: ds_plugins.agreement.HEADER (which imports the
config, which imports this module; tests/ds_plugins/test_cost_model.py ties the two)."""
OPS = ("a2a@ep", "ag@esp", "rs@esp", "ar@esp", "ag@mp", "ar@mp", "gemm", "mem", "route", "gate")
"""Collectives on n bytes; "gemm" on n flops; "mem" a strided copy of n bytes; "route" dispatch + combine,
forward and backward, on n = (k·S + E·C)·M·b bytes: the token side (k routes of S tokens) plus the buffer;
"gate" DeepSpeed's gating of fp32 logits [S, E] (softmax, top-k, masks, cumulative sums, capacity, l_aux),
forward and backward, on n = S·E·4 bytes: some 60 small operations, so its α is some 60 calls'."""


@dataclass(frozen=True)
class OpCosts:
    ops: dict[str, AlphaBeta]
    overlap: float = 0.0
    """γ: 0 when concurrent collectives on different groups fully overlap, 1 when they serialise."""

    def __post_init__(self) -> None:
        missing = sorted(set(OPS) - set(self.ops))
        if missing:
            raise ValueError(f"OpCosts needs a model for every operation, missing {missing}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap inefficiency must be in [0, 1], got {self.overlap}")

    def __call__(self, op: str, n: float) -> float:
        return self.ops[op](n) if n > 0 else 0.0


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer on one rank: S tokens (replicated over the n MP ranks), M hidden, H FFN size."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    k: int
    capacity_factor: float
    mp: int
    ep: int
    esp: int
    chunks: int
    elem_bytes: int = 4
    min_capacity: int = 0
    skip_empty_slots: bool = True

    def capacity(self, tokens: int) -> int:
        """DeepSpeed's drop-mode capacity for ``tokens`` tokens (k folded in for k >= 2)."""
        factor = self.capacity_factor * (1 if self.k == 1 else self.k)
        return max(math.ceil(tokens / self.experts * factor), self.min_capacity)


@dataclass
class Breakdown:
    """Predicted seconds of one forward + backward, by part."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _wavefront(costs: OpCosts, chunks: int, stages: list[float]) -> float:
    stages = [t for t in stages if t > 0]
    if not stages:
        return 0.0
    total = 0.0
    for step in range(chunks + len(stages) - 1):
        active = [t for j, t in enumerate(stages) if 0 <= step - j < chunks]
        total += max(active) + costs.overlap * (sum(active) - max(active))
    return total


def _pad(c: int, multiple: int) -> int:
    return -(-c // multiple) * multiple


def _gate(costs: OpCosts, sh: LayerShape, backward_tokens: int) -> float:
    """Gate GEMM forward on all S tokens, its two backward GEMMs on ``backward_tokens``, and the gating of
    the logits [S, E], forward and backward ("gate", timed as a whole: its ~60 small operations each pay a
    call's overhead, which one "mem" pass over 60 times the bytes priced at a fifth to a tenth of the
    gate's measured time, issue 23)."""
    flops = 2 * sh.hidden * sh.experts
    return (costs("gemm", flops * sh.tokens) + 2 * costs("gemm", flops * backward_tokens)
            + costs("gate", sh.tokens * sh.experts * 4))


def sync_free(sh: LayerShape) -> bool:
    """The forward agrees on nothing of its own (ds_plugins.schedules.sync_free; "auto" without dropping
    from its second forward on): the fill counts travel and their headers reach every rank (ESP = MP, or
    no MP)."""
    return sh.skip_empty_slots and (sh.mp == 1 or sh.esp > 1)


def _agree(costs: OpCosts, sh: LayerShape, rounds: int) -> float:
    """``rounds`` agreements (ds_plugins.agreement) unless the forward is sync-free: an AR of 2n int64
    over MP, of 3n over EP."""
    mp = costs("ar@mp", 2 * 2 * 8) if sh.mp > 1 else 0.0
    ep = costs("a2a@ep", 3 * 2 * 8) if sh.ep > 1 else 0.0
    return 0.0 if sync_free(sh) else rounds * (mp + ep)


def _route(costs: OpCosts, sh: LayerShape, tokens: int, capacity: int) -> float:
    return costs("route", (sh.k * tokens + sh.experts * capacity) * sh.hidden * sh.elem_bytes)


def expert_rows(sh: LayerShape, tokens: int, capacity: int, mp_split: bool, skip: bool) -> float:
    """Rows each local expert runs on (see the module docstring): ``tokens`` gated per source into
    ``capacity`` (C_buf) slots; ``mp_split``: S2's slices of C_buf/n, of which the ESP peers gather s."""
    filled = sh.k * tokens / sh.experts                  # per source, balanced routing
    if mp_split:
        slots = sh.esp * capacity / sh.mp
        return sh.ep * (min(filled, slots) if skip else slots)
    return sh.ep * sh.esp * (min(filled, capacity) if skip else capacity)


def _experts(costs: OpCosts, sh: LayerShape, rows: float) -> float:
    """E_l local experts, each two GEMMs forward and four backward on its rows, H/s columns."""
    flops = 2 * rows * sh.hidden * (sh.ffn // sh.esp)
    act = rows * (sh.ffn // sh.esp) * sh.elem_bytes
    return sh.experts // sh.ep * (6 * costs("gemm", flops) + 3 * costs("mem", act))


def _fills(costs: OpCosts, sh: LayerShape) -> float:
    """The forward exchange of the fill counts with the headers, (E + p·HEADER) int32 (with skipping)."""
    if not sh.skip_empty_slots:
        return 0.0
    words = 4 * (sh.experts + sh.ep * HEADER)
    return (costs("a2a@ep", words) if sh.ep > 1 else 0.0) + \
        (costs("ag@esp", words * sh.esp) if sh.esp > 1 else 0.0)


def _exchanges(costs: OpCosts, sh: LayerShape, v: float, chunks: int, mp_split: bool) -> float:
    """to_experts + from_experts, forward and backward (each is the other's dual): 2·(to + from)."""
    n, s = sh.mp if mp_split else 1, sh.esp
    piece = v / (n * chunks)                            # bytes of one chunk of this rank's slice
    to = _wavefront(costs, chunks, [costs("a2a@ep", piece) if sh.ep > 1 else 0.0,
                                    costs("ag@esp", s * piece) if s > 1 else 0.0])
    back = _wavefront(costs, chunks, [costs("rs@esp", s * piece) if s > 1 else 0.0,
                                      costs("a2a@ep", piece) if sh.ep > 1 else 0.0,
                                      costs("ag@mp", n * piece) if n > 1 else 0.0])
    copies = costs("mem", v / n * (2 * s + 1) + v)      # contiguous chunks and their placement
    return 2 * (to + back + copies)


def exchange_pass(costs: OpCosts, sh: LayerShape, v: float, mp_split: bool) -> float:
    """One to_experts + from_experts pass (forward only) of a buffer of v bytes in ``sh.chunks`` chunks."""
    return _exchanges(costs, sh, v, sh.chunks, mp_split) / 2


def exchange_calls(sh: LayerShape, mp_split: bool) -> int:
    """Collective calls of that pass: per chunk A2A twice over EP, AG and RS over ESP, AG over MP (S2)."""
    per_chunk = 2 * (sh.ep > 1) + 2 * (sh.esp > 1) + (mp_split and sh.mp > 1)
    return sh.chunks * per_chunk


def predict(schedule: str, sh: LayerShape, costs: OpCosts) -> Breakdown:
    b, m, e, n, p, s = sh.elem_bytes, sh.hidden, sh.experts, sh.mp, sh.ep, sh.esp
    out = Breakdown()
    if schedule == "s1":
        mine = math.ceil(sh.tokens / n)
        c1 = max(1, math.ceil(min(sh.k * sh.tokens / e, sh.capacity(sh.tokens)) / n))
        chunks = max(1, min(sh.chunks, c1))
        cb = _pad(c1, chunks)
        v = e * cb * m * b
        out.add("gate", _gate(costs, sh, mine))
        out.add("agree", _agree(costs, sh, 2))           # the token count, then the capacity
        out.add("dispatch+combine", _route(costs, sh, mine, cb))
        out.add("exchanges", _exchanges(costs, sh, v, chunks, mp_split=False) + _fills(costs, sh))
        out.add("experts", _experts(costs, sh, expert_rows(sh, mine, cb, False, sh.skip_empty_slots)))
        if n > 1:
            rows = n * mine * m * b                      # the MP all-gather of S·M (padded blocks)
            pad = 0 if sh.tokens % n == 0 else 4 * costs("mem", rows)
            out.add("mp", 2 * costs("ag@mp", rows) + pad + costs("ar@mp", e * m * 4))
        return out
    c = sh.capacity(sh.tokens)
    out.add("gate", _gate(costs, sh, sh.tokens))
    if schedule in ("s2", "deepspeed"):
        out.add("agree", _agree(costs, sh, 1))
    if schedule == "s2":
        chunks = max(1, min(sh.chunks, math.ceil(c / n)))
        cb = _pad(c, n * chunks)
        v = e * cb * m * b
        out.add("dispatch+combine", _route(costs, sh, sh.tokens, cb))
        out.add("exchanges", _exchanges(costs, sh, v, chunks, mp_split=True) + _fills(costs, sh))
        out.add("experts", _experts(costs, sh, expert_rows(sh, sh.tokens, cb, True, sh.skip_empty_slots)))
        return out
    v = e * c * m * b
    out.add("dispatch+combine", _route(costs, sh, sh.tokens, c))
    if schedule == "deepspeed":
        # every ESP rank runs the whole (replicated) slots, s = 1 in the row count; AR of the filled rows
        rows = expert_rows(replace(sh, esp=1), sh.tokens, c, False, sh.skip_empty_slots)
        out.add("a2a", 4 * costs("a2a@ep", v) if p > 1 else 0.0)
        out.add("a2a", _fills(costs, sh))
        out.add("experts", _experts(costs, sh, rows))
        out.add("esp", 2 * e // p * costs("ar@esp", rows * m * b) if s > 1 else 0.0)
        return out
    if schedule == "ds-installed":                # DeepSpeed's own MoE: every slot, always
        out.add("a2a", 4 * costs("a2a@ep", v / n) if p > 1 else 0.0)
        out.add("mp", 4 * costs("ag@mp", v) + costs("mem", 4 * v) if n > 1 else 0.0)
        out.add("experts", _experts(costs, sh, p * c))
        out.add("esp", 2 * e // p * costs("ar@esp", p * c * m * b) if s > 1 else 0.0)
        return out
    raise ValueError(f"schedule {schedule!r} is not one of ('s1', 's2', 'deepspeed', 'ds-installed')")


@dataclass(frozen=True)
class Cluster:
    """A GPU cluster for projections: ``gpus_per_node`` GPUs on an intra-node link, nodes on a NIC link."""

    name: str
    nodes: int
    gpus_per_node: int
    intra: AlphaBeta
    inter: AlphaBeta
    flops_per_s: float
    mem_bytes_per_s: float
    overlap: float
    """γ: PCIe nodes share the bus between NIC and peer traffic, so overlap is poorer there."""


def _linear(collective, link: AlphaBeta, g: int) -> AlphaBeta:
    """The α-β of ``collective`` on g ranks of ``link`` as a function of its n bytes (it is linear in n)."""
    alpha = collective(link, 0, g)
    return AlphaBeta(alpha, collective(link, 1, g) - alpha)


def cluster_costs(cl: Cluster, sh: LayerShape) -> OpCosts:
    """MP and ESP inside a node, EP across nodes (parm.md §1: N_MP = N_ESP = GPUs per node)."""
    return OpCosts({
        "a2a@ep": _linear(cost.all_to_all, cl.inter, sh.ep),
        "ag@esp": _linear(cost.all_gather, cl.intra, sh.esp),
        "rs@esp": _linear(cost.reduce_scatter, cl.intra, sh.esp),
        "ar@esp": _linear(cost.all_reduce, cl.intra, sh.esp),
        "ag@mp": _linear(cost.all_gather, cl.intra, sh.mp),
        "ar@mp": _linear(cost.all_reduce, cl.intra, sh.mp),
        "gemm": AlphaBeta(5e-6, 1 / cl.flops_per_s),
        "mem": AlphaBeta(3e-6, 2 / cl.mem_bytes_per_s),   # read + write
        "route": AlphaBeta(20e-6, 8 / cl.mem_bytes_per_s),  # encode, decode and their backwards
        "gate": AlphaBeta(60 * 5e-6, 60 * 2 / cl.mem_bytes_per_s),  # ~60 kernels, each a launch and a pass
    }, overlap=cl.overlap)


CLUSTERS = (
    # Parm's 32-GPU cluster as FSMoE describes it (parm.md §3): 8 nodes x 4 RTX 2080 Ti on PCIe 3.0 x16
    # (about 10 GB/s achieved peer to peer), 100 Gb/s InfiniBand (12.5 GB/s); fp32 about 11 TFLOP/s
    # achieved, 616 GB/s GDDR6; NIC and peer traffic share PCIe, so overlap is poor.
    Cluster("paper: 8 nodes x 4 RTX 2080 Ti, PCIe 3.0, 100 Gb/s IB", 8, 4,
            intra=AlphaBeta.from_link(10e-6, 10e9), inter=AlphaBeta.from_link(5e-6, 12.5e9),
            flops_per_s=11e12, mem_bytes_per_s=616e9, overlap=0.5),
    # 4 nodes x 8 H200 (NVLink 4: about 360 GB/s achieved per GPU), one 400 Gb/s NIC per GPU (50 GB/s);
    # fp32 GEMMs on TF32 tensor cores at about 400 TFLOP/s, 4.8 TB/s HBM3e; NVLink and the NICs are
    # separate paths, so overlap is nearly free.
    Cluster("8x H200 nodes (x4), NVLink + 400 Gb/s IB", 4, 8,
            intra=AlphaBeta.from_link(8e-6, 360e9), inter=AlphaBeta.from_link(6e-6, 50e9),
            flops_per_s=400e12, mem_bytes_per_s=4.8e12, overlap=0.05),
)
