"""BubbleTea in the what-if simulator: how much of a planned iteration prefill can fill.

The training iteration comes from :func:`launch.plan.simulate.simulate` (its ops, through
:func:`launch.bubbletea.timeline.from_simulation`); its idle windows are packed with the chunked
prefill of a backlog of prompts (:func:`launch.bubbletea.packer.pack`), and the utilisation is
``(training busy + prefill busy) / (GPUs × iteration)`` (atlas.md §1.8 step 7).

The inference model is one model per GPU (every pipeline GPU holds a full copy; see
:mod:`launch.bubbletea.engine` for why), a GPT of ``params`` weights and ``layers`` × ``hidden``.
A chunk of c tokens ending at position hi costs ``(2·params·c + 4·layers·hidden·c·hi) / flops``
(the matmuls, then attention scores and values against the hi cached keys), on the GPU's sustained
FLOP/s from the topology file. The defaults are a 1.3B model (24 layers, hidden 2048) with 2048-token
prompts in 512-token chunks and a 2 ms guard band: our choices, the paper's are not known (atlas.md
§1.8 [GAP]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launch.bubbletea.packer import Chunk, Packing, Request, pack
from launch.bubbletea.timeline import Op, extract_windows, from_simulation, utilisation


@dataclass(frozen=True, slots=True)
class InferenceSpec:
    params: float = 1.3e9
    layers: int = 24
    hidden: int = 2048
    prompt_tokens: int = 2048
    chunk_tokens: int = 512
    guard: float = 2e-3            # seconds kept free before every training op
    dtype_bytes: int = 2           # bf16 weights

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "prompt_tokens", "chunk_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"InferenceSpec.{name} must be positive, got {getattr(self, name)!r}")
        if self.guard < 0:
            raise ValueError(f"InferenceSpec.guard must be >= 0 seconds, got {self.guard!r}")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    def kv_bytes(self, tokens: int) -> float:
        """One prompt's KV cache: k and v, every layer, every token."""
        return 2 * self.layers * self.hidden * tokens * self.dtype_bytes

    def chunk_seconds(self, chunk: Chunk, flops: float) -> float:
        c = chunk.tokens
        return (2 * self.params * c + 4 * self.layers * self.hidden * c * chunk.hi) / flops


@dataclass
class BubbleTeaEstimate:
    iteration: float
    utilisation_training: float
    utilisation: float             # with BubbleTea
    prefill_tokens_per_s: float    # all GPUs together
    requests_per_s: float          # prompts finished per second (their first token is out)
    training_ops: list[Op]
    packing: Packing
    spec: InferenceSpec
    memory_fits: bool = True       # weights + one prompt's KV cache beside the training state, every GPU


def simulate_bubbletea(pipe, result, stage_flops: list[float], spec: InferenceSpec | None = None,
                       gpus_per_lane: int = 1) -> BubbleTeaEstimate:
    """Fill one simulated iteration's bubbles (``pipe``: the :class:`launch.plan.simulate.Job` or
    ``Pipeline`` simulated, ``result`` its result). ``stage_flops[s]``: a GPU's FLOP/s at stage s;
    ``gpus_per_lane``: the tp GPUs behind each (stage, replica) lane (each runs its own model copy,
    so the lane's prefill throughput is that many times one GPU's)."""
    spec = spec or InferenceSpec()
    S, D = len(pipe.t_f), pipe.replicas
    if len(stage_flops) != S:
        raise ValueError(f"stage_flops has {len(stage_flops)} entries for {S} stages")
    ops = from_simulation(result)
    every = [(s, d) for s in range(S) for d in range(D)]
    fastest = max(stage_flops)
    smallest = spec.chunk_seconds(Chunk(0, 0, min(spec.chunk_tokens, spec.prompt_tokens), spec.prompt_tokens),
                                  fastest)
    windows = extract_windows(ops, result.iteration, min_window=smallest + spec.guard, all_lanes=every)
    # A backlog that cannot run dry: every window second at the fastest GPU's rate, plus a prompt per lane.
    idle = sum(w.length for w in windows)
    per_prompt = sum(spec.chunk_seconds(c, fastest)
                     for c in Request(0, spec.prompt_tokens).chunks(spec.chunk_tokens))
    backlog = [Request(i, spec.prompt_tokens) for i in range(math.ceil(idle / per_prompt) + len(every))]

    packing = _pack_heterogeneous(windows, backlog, spec, stage_flops)
    prefill = packing.ops()
    tokens = sum(p.chunk.tokens for p in packing.placements) * gpus_per_lane
    done = sum(p.chunk.last for p in packing.placements) * gpus_per_lane
    train = [op for op in ops if op.kind in ("F", "B")]
    return BubbleTeaEstimate(result.iteration, utilisation(train, result.iteration, n_lanes=len(every)),
                             utilisation(train, result.iteration, prefill, n_lanes=len(every)),
                             tokens / result.iteration, done / result.iteration, ops, packing, spec)


def _pack_heterogeneous(windows, backlog, spec: InferenceSpec, stage_flops: list[float]) -> Packing:
    """Stages in data centers of different GPUs run the same chunk at different speeds: pack each
    stage's lanes with its own cost, the backlog shared in FIFO order."""
    out, queue = Packing(), list(backlog)
    for s, flops in enumerate(stage_flops):
        mine = [w for w in windows if w.lane[0] == s]
        if not mine:
            continue
        part = pack(mine, queue, spec.chunk_tokens, lambda c, f=flops: spec.chunk_seconds(c, f), spec.guard)
        out.placements += part.placements
        started = {p.chunk.request for p in part.placements}
        queue = [r for r in queue if r.id not in started]
    out.deferred = [c for r in queue for c in r.chunks(spec.chunk_tokens)]
    return out


def for_plan(topo, model, plan, window: float | None = None,
             spec: InferenceSpec | None = None, engine: str | None = None) -> BubbleTeaEstimate:
    """BubbleTea on an ATLAS plan (:func:`launch.plan.placement.make_plan`): its layout simulated once
    more in the call order of ``engine``, the training engine the plan was made for (``make_plan``'s
    ``engine``; default DeepSpeed's), its bubbles filled. ``window`` is the per-connection TCP window the
    plan was made with (default: ``launch.plan.socket_limits.DEFAULT_WINDOW``, as ``make_plan``)."""
    from launch.plan.estimate import build, memory
    from launch.plan.placement import DEFAULT_ENGINE, ENGINES, layout_of
    from launch.plan.simulate import simulate
    from launch.plan.socket_limits import DEFAULT_WINDOW

    engine = DEFAULT_ENGINE if engine is None else engine
    if engine not in ENGINES:
        raise ValueError(f"for_plan: engine={engine!r}: one of {', '.join(ENGINES)}")
    window = DEFAULT_WINDOW if window is None else window
    spec = spec or InferenceSpec()
    lay = layout_of(plan, engine)
    job = build(topo, model, lay, window)
    flops = [topo.dc(d).gpu_flops for d in plan.stage_dc]
    est = simulate_bubbletea(job, simulate(job), flops, spec, gpus_per_lane=plan.tp)
    capacity = min(topo.dc(d).gpu_memory for d in plan.stage_dc)
    need = memory(topo, model, lay) + spec.weight_bytes + spec.kv_bytes(spec.prompt_tokens)
    est.memory_fits = need <= capacity
    return est


def render_line(est: BubbleTeaEstimate) -> str:
    """The plan's BubbleTea line (``python -m launch.plan TOPOLOGY --bubbletea``)."""
    spec = est.spec
    fits = "fits" if est.memory_fits else "DOES NOT FIT"
    return (f"  bubbletea GPU utilisation {100 * est.utilisation_training:.1f}% -> "
            f"{100 * est.utilisation:.1f}% with prefill in the bubbles ({est.prefill_tokens_per_s:,.0f} "
            f"prefill tokens/s, {est.requests_per_s:.1f} prompts/s; a {spec.params / 1e9:g}B-parameter model "
            f"on every GPU ({spec.weight_bytes / 2**30:.1f} GiB, {fits} beside the training state), "
            f"{spec.prompt_tokens}-token prompts in {spec.chunk_tokens}-token chunks, "
            f"{spec.guard * 1e3:g} ms guard)")
