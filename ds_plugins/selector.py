"""The "auto" schedule: S1 or S2 per layer shape, by the alpha-beta model fitted on the layer's own groups.

The choice is a pure function of values every rank of the layer agrees on, so that no two ranks can pick
different schedules (which would deadlock) and no forward issues a collective outside the layer's groups
(under pipeline parallelism the other stages are busy with other layers):

- the fitted costs: when the layer is set up (``set_deepspeed_parallelism``, which ``deepspeed.initialize``
  and ``ds_plugins.initialize`` call), every rank of the layer runs a short micro-benchmark (a few seconds
  on CPU): each collective the schedules use, on the layer's own process groups, from 64 B to 8 MiB (FSMoE
  §6.2: fp32 buffers, α and β by least squares); two collectives on different groups at once, for the
  overlap inefficiency γ; a GEMM, a copy and dispatch + combine forward and backward (called directly,
  without autograd) and DeepSpeed's gating of a batch of logits (the one point timed with autograd), for
  the local work, each run repeating its call back to back for at least
  :data:`WINDOW_S` (the share of a core a step's compute gets); one pass of the schedules' own chunked
  exchange code on a tiny buffer, for the per-call overhead δ that the lined-up collectives miss. Each rank
  keeps the median of 5 runs per point, the ranks agree on the median of those over the layer's MP and EP
  groups, and only the agreed times are fitted (relative-error least squares, :func:`fit_relative`), so
  every rank holds bit-identical numbers; they are MAX-reduced over the same groups (a no-op on fitted
  numbers, the agreement for read ones), cached in this process per layout and, when ``cost_cache`` names a
  file, in that JSON file (ds_plugins.cost_cache: every rank reads it, and their outcomes are agreed before
  any is used; a bad or uneven file is one warning on every rank, then the costs are measured);
- the layer shape: a token count every rank of the layer holds alike (never the local count alone where
  the ranks' may differ): in drop mode its own, which the headers check equal on every rank; without
  dropping the largest of the previous forward's headers (ds_plugins.schedules.sync_free), or in the
  first forward the largest agreed by ds_plugins.agreement; and the layer's configuration.

Fitting needs no autograd, so it also works under ``torch.no_grad()`` and ``torch.inference_mode()``, and
leaves the RNG state as it found it (its random buffers must not change the gate's draws); a layer
switched to "auto" after its set-up fits at its first forward, on its own groups. The choice is cached
per (layout, shape); for each new one the choice and both predicted times are printed once, by the
layer's first rank.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.sharded_moe import TopKGate

from commweave import comm, cost
from ds_plugins import agreement, cost_cache, cost_model, experts, overlap, reference, routing
from ds_plugins.cost_model import LayerShape, OpCosts
from ds_plugins.dispatch import backend, combine, dispatch

SIZES = (16, 1 << 12, 1 << 15, 1 << 18, 1 << 21)
"""fp32 elements per collective micro-benchmark buffer, 64 B to 8 MiB: the regime of the layers' calls,
from the agreements and fill counts (tens of bytes) through one chunk of a small layer (tens of kB) to a
whole exchange (MBs). Fitted on 256 KiB and up alone, α was the intercept of a line through large
messages, not a small call's cost: 3.5 ms for an all-reduce on 4 CPU ranks whose small calls took about
7 ms, 0.6 ms for their all-gather, whose small calls took 4.7 (issue 23, notes/reports/parm-auto-3.md)."""
REPEATS = 5
"""Timing runs per micro-benchmark point; each rank keeps the median, and the layer's ranks then agree on
the median of those (:func:`_median_over_layer`) before anything is fitted. A real step meets the
machine's typical contention, not its luckiest moment: the fastest of 5 (the previous rule) tracked how
idle the machine happened to be, and its fits moved 0.29-2.11x between two runs (issue 23)."""
GEMM_ROWS = (16, 128, 1024, 2048)
"""Rows of the [rows, 512] x [512, 512] GEMMs fitted for "gemm": from one sparse expert's rows up."""
COPY_ELEMENTS = (1 << 12, 1 << 16, 1 << 19, 1 << 21)
ROUTE_TOKENS = (64, 256, 1024, 4096)
GATE_LOGITS = ((64, 4), (256, 8), (1024, 8), (4096, 16))
"""(S, E) of the gating points: DeepSpeed's top-2 gating of fp32 logits [S, E], forward and backward."""
EXCHANGE_CHUNKS = 4
"""Chunks of the exchange pass timed for the per-call overhead (:meth:`_Bench.exchange`)."""
WINDOW_S = 0.02
"""Seconds each timed run of a local-work point lasts at least (:meth:`_Bench.steady`): calls repeated
back to back, the time divided by their number. A layer's step computes for tens to hundreds of ms at
a stretch, and where the ranks outnumber the cores each rank then gets its share of a core; a lone call
shorter than the scheduler's slice (a few ms) runs on a core of its own. Timed one call at a time, the
GEMM points of 4 ranks on 2 cores gave 0.015 ns/flop below 1 ms and 0.028 above 15 ms, and the fit,
weighted to every point alike, priced a step's GEMMs at 0.55-0.6x their time (issue 23, parm-6)."""

_fitted: dict[str, OpCosts] = {}
_decisions: dict[tuple, dict] = {}


def layout_key(g) -> str:
    world = comm.size(dist.group.WORLD)
    return f"world{world}-mp{g.mp_size}-esp{g.esp_size}-ep{g.ep_size}-{dist.get_backend()}"


def _call(kind: str, group, x: torch.Tensor):
    """(a call of collective ``kind`` on ``x``, the bytes n it is modelled on)."""
    g, n = comm.size(group), x.numel() * x.element_size()
    if kind == "a2a":
        out = torch.empty_like(x)
        return (lambda async_op=False: comm.all_to_all(out, x, group, async_op=async_op)), n
    if kind == "ag":
        out = x.new_empty(g * x.numel())
        return (lambda async_op=False: comm.all_gather(out, x, group, async_op=async_op)), g * n
    if kind == "rs":
        out = x.new_empty(x.numel() // g)
        return (lambda async_op=False: comm.reduce_scatter(out, x, group, async_op=async_op)), n
    return (lambda async_op=False: comm.all_reduce(x, group, async_op=async_op)), n


def _nbytes(name: str, groups: dict, elements: int) -> int:
    """The bytes n that :func:`_call` models collective ``name`` on for a buffer of fp32 ``elements``."""
    kind, group = name.split("@")
    return elements * 4 * (comm.size(groups[group]) if kind == "ag" else 1)


def _route_step(tokens: int, device: torch.device, hidden: int = 512, experts: int = 8, k: int = 2):
    """(dispatch + combine forward and backward of ``tokens`` top-k routes, its n bytes: (k·S + E·C)·M·4).

    The backward kernels are called directly, not through autograd, so that fitting works in any grad mode.
    """
    per_route = -(-tokens // experts)
    capacity = k * per_route
    x = torch.randn(tokens, hidden, device=device)
    t, j = torch.arange(tokens, device=device), torch.arange(k, device=device)[:, None]
    indices = ((t + j) % experts).int()                    # route j of token t: expert t + j, each slot once
    locations = (j * per_route + t // experts).int()
    gates = torch.rand(k, tokens, device=device)
    torch_path = backend(device) == "torch"

    def step() -> None:
        buf = dispatch(x, indices, locations, experts, capacity)
        dy = combine(buf, indices, locations, gates)
        if torch_path:
            grad_buf, _ = reference.combine_backward(dy, buf, indices, locations, gates)
            reference.dispatch_backward(grad_buf, indices, locations, tokens)
        else:
            grad_buf, _ = torch.ops.commweave.combine_backward(dy, buf, indices, locations, gates, True, True)
            torch.ops.commweave.dispatch_backward(grad_buf, indices, locations, tokens)
    return step, (k * tokens + experts * capacity) * hidden * 4


def _gate_step(tokens: int, experts: int, device: torch.device):
    """(DeepSpeed's top-2 gating of random logits [S, E] forward and backward, its n bytes: S·E·4).

    The gating's ~60 operations are timed as autograd runs them (the backward through l_aux and the
    gates), so autograd is switched on for this point alone, whatever the caller's grad mode."""
    gate = TopKGate(16, experts, k=2, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4)
    with torch.inference_mode(False):
        leaf = torch.randn(tokens, experts, device=device, requires_grad=True)

    def step() -> None:
        with torch.inference_mode(False), torch.enable_grad():
            r = routing.gating(gate, leaf.clone())      # a GEMM's output in the layer: not a leaf
            torch.autograd.backward([r.l_aux, r.gates], [torch.ones_like(r.l_aux), torch.ones_like(r.gates)])
        leaf.grad = None
    return step, tokens * experts * 4


def _ranks_per_host() -> int:
    """Ranks on this machine: the launchers' LOCAL_SIZE / LOCAL_WORLD_SIZE, else the whole world."""
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return comm.size(dist.group.WORLD)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fit_relative(sizes, times) -> cost.AlphaBeta:
    """α + β·n by least squares on the relative error, Σ_i ((α + β·n_i) / t_i - 1)², both clamped at 0.

    The sizes span five orders of magnitude: an ordinary least-squares line is set by the largest points,
    and its intercept is their noise, 50x off the small calls' measured times; weighting each point by
    1/t_i² fits every point to about the same relative error, so α holds the small calls and β the large.
    """
    w = [1.0 / max(t, 1e-12) ** 2 for t in times]
    s0 = sum(w)
    s1 = sum(wi * n for wi, n in zip(w, sizes, strict=True))
    s2 = sum(wi * n * n for wi, n in zip(w, sizes, strict=True))
    t0 = sum(wi * t for wi, t in zip(w, times, strict=True))
    t1 = sum(wi * n * t for wi, n, t in zip(w, sizes, times, strict=True))
    det = s0 * s2 - s1 * s1
    beta = (s0 * t1 - s1 * t0) / det if det > 0 else 0.0
    alpha = (t0 - beta * s1) / s0
    if beta < 0:                         # flat within the noise: the weighted mean
        return cost.AlphaBeta(t0 / s0, 0.0)
    if alpha < 0:                        # through the origin
        return cost.AlphaBeta(0.0, t1 / s2)
    return cost.AlphaBeta(alpha, beta)


def _median_over_layer(t: torch.Tensor, g) -> torch.Tensor:
    """The median over the layer's ranks of every entry of ``t``: over MP, then over EP. After the MP
    round an MP group holds one value, and every EP group holds one rank of each MP group, so every rank
    of the layer ends with the same numbers (the same inputs through the same arithmetic)."""
    for group in (g.mp, g.ep):
        if group is not None:
            size = comm.size(group)
            out = t.new_empty(size * t.numel())
            comm.all_gather(out, t.contiguous(), group)
            t = out.view(size, -1).quantile(0.5, dim=0)
    return t


class _Bench:
    """Micro-benchmarks on the device the layer runs on (CUDA work is synchronised before each clock read).

    :meth:`measure` times every point first (each rank its own median of :data:`REPEATS`), agrees on the
    medians over the layer's ranks, and only then fits: every rank fits the same numbers.
    """

    def __init__(self, g, device: torch.device) -> None:
        self.g, self.device = g, device
        self.groups = {"ep": g.ep, "esp": g.esp, "mp": g.mp}

    def _sync(self) -> None:
        if self.device.type != "cpu":
            get_accelerator().synchronize()

    def time(self, fn, groups=()) -> float:
        """Median of :data:`REPEATS` wall times of ``fn`` on this rank; the ranks of ``groups`` line up
        (one-element all-reduces) before each."""
        times = []
        for _ in range(REPEATS):
            for group in groups:
                comm.all_reduce(torch.zeros(1, device=self.device), group)
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def steady(self, fn) -> float:
        """Seconds per call of ``fn`` over runs of at least :data:`WINDOW_S` (as many calls back to back
        as that takes, counted from one untimed call), the median of :data:`REPEATS` runs."""
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        calls = max(1, math.ceil(WINDOW_S / max(time.perf_counter() - t0, 1e-6)))

        def run() -> None:
            for _ in range(calls):
                fn()
        return self.time(run) / calls

    def collective(self, name: str) -> tuple[list[float], list[float]]:
        """(bytes n as the ledger counts them, times) of one modelled collective ("a2a@ep", "ag@esp", ...)
        at :data:`SIZES`; no points for a group this layer does not have."""
        kind, group_key = name.split("@")
        group = self.groups[group_key]
        sizes, times = [], []
        if group is not None:
            for n in SIZES:
                fn, nbytes = _call(kind, group, torch.randn(n, device=self.device))
                sizes.append(nbytes)
                times.append(self.time(fn, [group]))
        return sizes, times

    def overlap_pair(self) -> tuple[float, tuple[str, str] | None, float]:
        """(γ where it is not measured, else the two collectives overlapped and their time together at the
        largest size): A2A on EP with AG on ESP, or without EP, RS on ESP with AG on MP (S2's combine chain).

        CPU ranks that fill the cores (ranks x threads >= cores) get γ = 1 without measuring: gloo moves
        data with the CPU, so a concurrent collective takes its cores from the other ranks' compute. In
        isolation the two collectives do overlap, which is why measuring would mislead there. A layer
        with fewer than two groups never overlaps two collectives: γ = 0, unused.
        """
        if self.device.type == "cpu" and _ranks_per_host() * torch.get_num_threads() >= _cores():
            return 1.0, None, 0.0
        pairs = [("a2a@ep", "ag@esp"), ("a2a@ep", "ag@mp"), ("rs@esp", "ag@mp")]
        live = [p for p in pairs if all(self.groups[name.split("@")[1]] is not None for name in p)]
        if not live:
            return 0.0, None, 0.0
        x = torch.randn(SIZES[-1], device=self.device)
        first, second = (_call(name.split("@")[0], self.groups[name.split("@")[1]], x)[0] for name in live[0])

        def both():
            comm.wait_all([first(async_op=True), second(async_op=True)])
        lineup = [group for group in (self.g.mp, self.g.ep) if group is not None]
        return 0.0, live[0], self.time(both, lineup)

    def local(self) -> dict[str, tuple[list[float], list[float]]]:
        """GEMM (per flop), strided copy (per byte) and dispatch + combine (per buffer byte) on this rank."""
        gemm, mem, route, gate = ([], []), ([], []), ([], []), ([], [])
        w = torch.randn(512, 512, device=self.device)
        for rows in GEMM_ROWS:
            x = torch.randn(rows, 512, device=self.device)
            gemm[0].append(2 * rows * 512 * 512)
            gemm[1].append(self.steady(lambda x=x: x @ w))
        for n in COPY_ELEMENTS:
            src = torch.randn(8, n // 2048, 256, device=self.device)
            mem[0].append(n * 4)
            mem[1].append(self.steady(lambda src=src: src.transpose(0, 1).contiguous()))
        for tokens in ROUTE_TOKENS:
            fn, n = _route_step(tokens, self.device)
            route[0].append(n)
            route[1].append(self.steady(fn))
        for tokens, width in GATE_LOGITS:
            fn, n = _gate_step(tokens, width, self.device)
            gate[0].append(n)
            gate[1].append(self.steady(fn))
        return {"gemm": gemm, "mem": mem, "route": route, "gate": gate}

    def exchange(self) -> tuple[cost_model.LayerShape, float]:
        """(its shape, the time) of one to_experts + from_experts pass of the schedules' own exchange code
        (ds_plugins.overlap, the S2 layout with MP, else S1's) on a buffer of one slot per chunk, E = 2·p
        experts, M = 16: a pass of :data:`EXCHANGE_CHUNKS` chunks that is nothing but calls."""
        g = self.g
        sh = cost_model.LayerShape(tokens=1, hidden=16, ffn=16, experts=2 * g.ep_size, k=1,
                                   capacity_factor=1.0, mp=g.mp_size, ep=g.ep_size, esp=g.esp_size,
                                   chunks=EXCHANGE_CHUNKS)
        lay = overlap.Layout(g, sh.experts, EXCHANGE_CHUNKS, 1, mp_split=g.mp is not None)
        rows = overlap.Rows.every(lay, self.device)
        buf = torch.randn(sh.experts, lay.capacity, sh.hidden, device=self.device)
        lineup = [group for group in (g.mp, g.ep) if group is not None]
        return sh, self.time(lambda: overlap._from_experts(overlap._to_experts(buf, lay, rows), lay, rows),
                             lineup)

    def measure(self) -> OpCosts:
        points = {name: self.collective(name) for name in ("a2a@ep", "ag@esp", "rs@esp", "ag@mp", "ar@mp")}
        points.update(self.local())
        gamma, pair, together = self.overlap_pair()
        live = self.g.mp is not None or self.g.ep is not None
        shape, passed = self.exchange() if live else (None, 0.0)
        names = [name for name in points if points[name][1]]
        mine = [t for name in names for t in points[name][1]] + ([together] if pair else []) + [passed]
        agreed = _median_over_layer(torch.tensor(mine, dtype=torch.float64, device=self.device), self.g)
        agreed = agreed.cpu().tolist()
        ops = {name: cost.AlphaBeta(0.0, 0.0) for name in points}
        for name in names:
            sizes = points[name][0]
            ops[name] = fit_relative(sizes, agreed[:len(sizes)])
            agreed = agreed[len(sizes):]
        ops["ar@esp"] = ops["ar@mp"]
        if pair is not None:
            alone = [ops[name](_nbytes(name, self.groups, SIZES[-1])) for name in pair]
            gamma = min(max((agreed[0] - max(alone)) / max(min(alone), 1e-9), 0.0), 1.0)
        costs = OpCosts(ops, gamma)
        return costs if shape is None else _with_call_overhead(costs, shape, agreed[-1])


def _with_call_overhead(costs: OpCosts, sh: cost_model.LayerShape, measured: float) -> OpCosts:
    """``costs`` with the exchanges' collectives' α raised by δ, the time per call that the exchange pass
    ``sh`` took beyond its fitted collectives: δ = (measured - modelled) / calls (α kept >= 0). The
    all-reduces (the agreements, the deepspeed order's inside the experts) are plain blocking calls, not
    the exchanges' launched-and-waited ones, and keep their α.

    The α-β points time one call between line-ups; inside a schedule every call also pays for its launch,
    its wait and the slicing around it, while the ranks reach it at their own pace. Those costs are paid
    per call, and the schedules differ most in their number of calls: on 4 CPU ranks S2 makes 44 per
    step where the deepspeed order makes 15, and on the issue-23 sweep the chunked schedules lost by up
    to 4x what the α-β terms predicted for their extra calls. δ is measured on the schedules' own code.
    """
    v = sh.experts * EXCHANGE_CHUNKS * (sh.mp if sh.mp > 1 else 1) * sh.hidden * 4
    modelled = cost_model.exchange_pass(costs, sh, v, mp_split=sh.mp > 1)
    calls = cost_model.exchange_calls(sh, mp_split=sh.mp > 1)
    delta = (measured - modelled) / calls
    ops = dict(costs.ops)
    for op in ("a2a@ep", "ag@esp", "rs@esp", "ag@mp"):
        if ops[op].alpha > 0 or ops[op].beta > 0:
            ops[op] = cost.AlphaBeta(max(ops[op].alpha + delta, 0.0), ops[op].beta)
    return OpCosts(ops, costs.overlap)


def _to_tensor(c: OpCosts) -> torch.Tensor:
    return torch.tensor([v for op in cost_model.OPS for v in (c.ops[op].alpha, c.ops[op].beta)] + [c.overlap],
                        dtype=torch.float64)


def _from_tensor(t: torch.Tensor) -> OpCosts:
    v = t.tolist()
    return OpCosts({op: cost.AlphaBeta(max(v[2 * i], 0.0), max(v[2 * i + 1], 0.0))
                    for i, op in enumerate(cost_model.OPS)}, overlap=min(max(v[-1], 0.0), 1.0))


def _max_over_layer(t: torch.Tensor, g) -> torch.Tensor:
    """MAX over the layer's MP then EP group: the same on every rank of the layer (ds_plugins.agreement)."""
    for group in (g.mp, g.ep):
        if group is not None:
            comm.all_reduce(t, group, op="max")
    return t


def _own_rng(device: torch.device):
    """The micro-benchmark's random buffers must not move the model's RNG: "auto" must route (Gumbel
    sampling, RTS, jitter) exactly as every other schedule and as DeepSpeed's MoE."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def fitted_costs(g, cache_file: str | None = None, device: torch.device | None = None) -> OpCosts:
    """The layout's fitted costs: from this process, else the JSON cache, else measured.

    Collective over the layer's groups ``g`` (never the world) unless this process has them already;
    needs no autograd.
    """
    device = torch.device("cpu") if device is None else device
    key = layout_key(g)
    if key in _fitted:
        return _fitted[key]
    cached, problem = cost_cache.read(cache_file, key)
    # Every rank's outcome agreed before any of it is used: a file that one rank cannot read, or reads
    # differently, is the same warning on every rank of the layer, and they all measure (a rank that used
    # the file while its peers measured would leave them waiting in the micro-benchmark's collectives).
    message = agreement.relay(problem, (g.mp, g.ep), "parm cost_cache", entry=int(cached is not None))
    if message is not None:
        warnings.warn(f"parm: {message}; the file is ignored and the costs are measured on this run's "
                      "groups", RuntimeWarning, stacklevel=2)
        cached = None
    if cached is not None:
        params = torch.tensor(cached, dtype=torch.float64)
    else:
        with torch.no_grad(), _own_rng(device):
            params = _to_tensor(_Bench(g, device).measure())
    _fitted[key] = _from_tensor(_max_over_layer(params.to(device), g).cpu())
    if cache_file is not None and g.mp_rank == 0 and g.ep_rank == 0 and cached is None:
        cost_cache.write(cache_file, key, _to_tensor(_fitted[key]).tolist())
    return _fitted[key]


def candidates(g) -> tuple[str, ...]:
    """The schedules "auto" chooses from: every schedule computes the same function (ds_plugins.schedules),
    so the choice is only speed. Without MP, S1 and S2 are one schedule; without MP and EP every schedule
    is local work alone. The ``deepspeed`` order is a candidate too: it exchanges in one piece, and on the
    issue-23 sweep it was the fastest Parm schedule in 23 of 54 cells (small layers, where the chunked
    exchanges' extra latencies outweigh their overlap)."""
    if g.mp_size > 1:
        return ("deepspeed", "s1", "s2")
    return ("deepspeed", "s2") if g.ep_size > 1 else ("s2",)


def fit(layer) -> None:
    """Fit the layer's layout at set-up (nothing to fit when there is one candidate)."""
    if len(candidates(layer.parm_groups)) > 1:
        fitted_costs(layer.parm_groups, layer.cost_cache, layer.gate.wg.weight.device)


def layer_shape(layer, tokens: int, dtype: torch.dtype) -> LayerShape:
    g, gate = layer.parm_groups, layer.gate
    ffn = experts.ffn_size(layer.local_experts[0], gate.wg.weight.shape[1])
    return LayerShape(tokens=tokens, hidden=gate.wg.weight.shape[1], ffn=ffn, experts=layer.num_experts,
                      k=gate.k,
                      capacity_factor=gate.capacity_factor if gate.training else gate.eval_capacity_factor,
                      mp=g.mp_size, ep=g.ep_size, esp=g.esp_size, chunks=layer.overlap_chunks,
                      elem_bytes=torch.empty((), dtype=dtype).element_size(), min_capacity=gate.min_capacity,
                      skip_empty_slots=layer.skip_empty_slots)


def choose(layer, tokens: int, dtype: torch.dtype) -> str:
    """The schedule (:func:`candidates`) for this layer and ``tokens``, a count every rank of the layer
    holds alike (module docstring), with the least predicted forward + backward time.

    A pure function of that count, the layer's configuration and the costs fitted at set-up, so it
    is the same on every rank of the layer and issues no collective (unless the layer was switched to
    "auto" after its set-up: then the first call fits, on the layer's own groups).
    """
    g = layer.parm_groups
    options = candidates(g)
    if len(options) == 1:
        return options[0]
    sh = layer_shape(layer, tokens, dtype)
    key = (layout_key(g), sh)
    if key not in _decisions:
        costs = fitted_costs(g, layer.cost_cache, layer.gate.wg.weight.device)
        t = {s: cost_model.predict(s, sh, costs).total for s in options}
        choice = min(t, key=t.get)
        _decisions[key] = {"choice": choice, "predicted_s": t}
        if g.mp_rank == 0 and g.ep_rank == 0:
            print(f"[parm] auto: {choice} for tokens={tokens} M={sh.hidden} H={sh.ffn} E={sh.experts} "
                  f"k={sh.k} cf={sh.capacity_factor} mp={sh.mp} esp={sh.esp} ep={sh.ep}: predicted "
                  "forward+backward " + ", ".join(f"{s} {v * 1e3:.2f} ms" for s, v in t.items()), flush=True)
    return _decisions[key]["choice"]


def decisions() -> dict[tuple, dict]:
    """Every (layout, shape) decided in this process: {"choice", "predicted_s": {"s1", "s2"}}."""
    return dict(_decisions)
