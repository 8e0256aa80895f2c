"""Train a small DeepSpeed PipelineModule across data centers with ATLAS.

    deepspeed-atlas --atlas-topology configs/atlas_two_dc.json --wan-connections 8 \\
        examples/atlas_pipeline.py --steps 3 --out /tmp/atlas-run

Every rank follows the plan the launcher exported (stage in its data center, WAN pairs on k TCP
connections, temporal sharing) and writes ``rank<N>.json`` to ``--out``: where it ran, the ATLAS/
NCCL/GLOO environment it saw, the TCP connections its WAN groups opened, and the losses. On CPU
(``DS_ACCELERATOR=cpu``) it uses gloo; ``--reference`` prints the single-process losses instead.

The model is HIDDEN-wide Linear+Tanh layers seeded per layer (``seed_fn=torch.manual_seed``), so
any partition into stages builds the same weights as :func:`reference_losses`.

``--variants stock,1:spatial,8:temporal,...`` times the same engine under each WAN setting in turn
(``stock``: DeepSpeed's own p2p; ``K:MODE``: ATLAS with K connections and MODE sharing, undone after):
``--warmup`` untimed steps, ping-pongs on the variant's own connections (:func:`probe_link`), then
``--steps`` timed ones, and every instruction of DeepSpeed's engine timed on every rank (compute,
send/recv waits, the reduce and optimizer step); ``--passes 2`` visits the variants once more in
reverse order; its ping-pongs run with the ranks outside each pair computing their stage without
pause (launch.net.pingpong.Beside), the CPU contention of a replica computing beside a transfer at
full duty, kept apart (``pingpong_beside_s``) from the first pass's (others at a barrier). ``--hidden`` and
``--micro-batch`` set the activation each micro-batch sends: micro-batch x hidden x 4 bytes (fp32).
benchmarks/atlas_calibration.py runs this on the emulated WAN and compares it with the simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HIDDEN, LAYERS, MICRO_BATCH, LR, BASE_SEED = 16, 4, 2, 0.1, 1234


def layer_factories(hidden: int = HIDDEN) -> list:
    out = []
    for _ in range(LAYERS):
        out += [(nn.Linear, hidden, hidden), (nn.Tanh,)]
    return out


def micro_batch(step: int, index: int, hidden: int = HIDDEN, rows: int = MICRO_BATCH
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` (over the whole global batch) of ``step``: inputs and regression targets."""
    g = torch.Generator().manual_seed(10_000 * step + index)
    x = torch.randn(rows, hidden, generator=g)
    return x, torch.sin(x.flip(-1))


def reference_losses(steps: int, micro_batches: int, lr: float = LR) -> list[float]:
    """One process: the same layers and the same global batches, gradients averaged over them all."""
    layers = []
    for i, (cls, *args) in enumerate(layer_factories()):
        torch.manual_seed(BASE_SEED + i)
        layers.append(cls(*args))
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for i in range(micro_batches):
            x, y = micro_batch(step, i)
            loss = nn.functional.mse_loss(model(x), y)
            (loss / micro_batches).backward()
            total += loss.item()
        opt.step()
        losses.append(total / micro_batches)
    return losses


def engine_for(plan, hidden: int = HIDDEN, rows: int = MICRO_BATCH):
    """The DeepSpeed PipelineEngine of the plan's layout (on an initialised process group)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    from launch.run.runtime import pipe_topology

    deepspeed.init_distributed(dist_backend=dist.get_backend())   # adopts the existing process group
    specs = [LayerSpec(cls, *args) for cls, *args in layer_factories(hidden)]
    model = PipelineModule(specs, topology=pipe_topology(plan), loss_fn=nn.MSELoss(),
                           partition_method="uniform", seed_layers=True, seed_fn=torch.manual_seed,
                           base_seed=BASE_SEED)
    m = plan.micro_batches
    config = {"train_batch_size": rows * m * plan.dp, "train_micro_batch_size_per_gpu": rows,
              "gradient_accumulation_steps": m, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _step(engine, plan, step: int, hidden: int, rows: int) -> float:
    m, replica = plan.micro_batches, engine.grid.get_data_parallel_id()
    batches = iter([micro_batch(step, replica * m + i, hidden, rows) for i in range(m)])
    return float(engine.train_batch(data_iter=batches))


def train(steps: int, plan, wan_setup=None) -> list[float]:
    """DeepSpeed pipeline training on an initialised process group; ``wan_setup(plan)`` may enable
    ATLAS after the engine exists (it returns a handle with ``undo()``)."""
    engine = engine_for(plan)
    handle = wan_setup(plan) if wan_setup is not None else None
    losses = [_step(engine, plan, step, HIDDEN, MICRO_BATCH) for step in range(steps)]
    if handle is not None:
        handle.undo()
    return losses


def time_instructions(engine, seconds: dict[str, list[float]]) -> None:
    """Time every instruction DeepSpeed's engine executes, by instruction name, into ``seconds``.
    The engine looks its instructions up in ``self._INSTRUCTION_MAP``: an instance copy wraps them.
    Each OptimizerStep also records ``PipeSync`` (the seconds spent in its all-reduces over the
    pipeline's stages, mostly waiting for the other stages: the simulator models these,
    launch.plan.rendezvous) and ``PipeSync.calls`` (how many it ran)."""
    pipe_group = engine.mpu.get_model_parallel_group() if engine.num_stages > 1 else None
    _watch_pipe_all_reduce()

    def timed(name, fn):
        def run(self, **kwargs):
            if name == "OptimizerStep":
                _PIPE_SYNCS.append((pipe_group, []))
            t0 = time.perf_counter()
            try:
                fn(self, **kwargs)
            finally:
                syncs = _PIPE_SYNCS.pop()[1] if name == "OptimizerStep" else None
            seconds.setdefault(name, []).append(time.perf_counter() - t0)
            if syncs is not None:
                seconds.setdefault("PipeSync", []).append(sum(syncs))
                seconds.setdefault("PipeSync.calls", []).append(len(syncs))
        return run

    engine._INSTRUCTION_MAP = {cls: timed(cls.__name__, fn) for cls, fn in engine._INSTRUCTION_MAP.items()}


_PIPE_SYNCS: list[tuple[object, list[float]]] = []   # the running OptimizerStep: (pipe group, seconds)


def _watch_pipe_all_reduce() -> None:
    """Wrap ``deepspeed.comm.all_reduce`` (once per process) so that a call on the running
    OptimizerStep's pipe group adds its seconds there; every other call passes straight through.
    Its parameters are (tensor, op, group, ...); its ``timed_op`` wrapper hides them from inspect."""
    import functools

    import deepspeed.comm as ds_comm

    if getattr(ds_comm.all_reduce, "_atlas_pipe_sync", False):
        return
    original = ds_comm.all_reduce

    @functools.wraps(original)
    def all_reduce(*args, **kwargs):
        if not _PIPE_SYNCS or _PIPE_SYNCS[-1][0] is None:
            return original(*args, **kwargs)
        group, spent = _PIPE_SYNCS[-1]
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        if kwargs.get("group", args[2] if len(args) > 2 else None) is group:
            spent.append(time.perf_counter() - t0)
        return out

    all_reduce._atlas_pipe_sync = True
    ds_comm.all_reduce = all_reduce


def measure(plan, variants: list[str], steps: int, warmup: int, hidden: int, rows: int,
            enable, probe, passes: int = 1) -> dict:
    """Per variant: this rank's seconds per ``train_batch`` and per engine instruction (timed steps
    only), and ``probe(handle, connections, compute)`` of the link taken just before the timed steps
    (after the warm-up: the connections the steps use, in the state the steps leave them; ``compute``
    the stage's work the ranks outside each pair run in the second pass, None in the first). ``passes`` 2
    visits the variants in order and then in reverse (A B C C B A), ``steps`` timed steps each visit:
    a machine load that drifts during the launch then weighs on every variant alike."""
    engine = engine_for(plan, hidden, rows)
    work = stage_work(engine, hidden, rows)
    order = variants + variants[::-1] * (passes - 1)
    acc = {v: {"step_s": [], "seconds": {}, "pingpong_s": [], "pingpong_beside_s": [], "tcp": []}
           for v in variants}
    step = 0
    for visit, variant in enumerate(order):
        beside = visit >= len(variants)          # the second pass: the others compute
        handle, k = None, 1
        if variant != "stock":
            k, mode = variant.split(":")
            handle = enable(plan, int(k), mode)
        for _ in range(warmup):
            _step(engine, plan, step, hidden, rows)
            step += 1
        link, got = probe(handle, int(k), work if beside else None), acc[variant]
        if link["pingpong_s"]:
            got["pingpong_beside_s" if beside else "pingpong_s"].append(link["pingpong_s"])
        got["tcp"] = link["tcp"]
        time_instructions(engine, got["seconds"])
        for _ in range(steps):
            t0 = time.perf_counter()
            _step(engine, plan, step, hidden, rows)
            got["step_s"].append(time.perf_counter() - t0)
            step += 1
        del engine._INSTRUCTION_MAP          # back to the class's map
        if handle is not None:
            handle.undo()
    return {v: {"step_s": a["step_s"], "ops": {k: statistics.median(x) for k, x in a["seconds"].items()},
                "ops_total_s": sum(map(sum, a["seconds"].values())),
                "op_count": {k: len(x) for k, x in a["seconds"].items()},
                "link": {"pingpong_s": a["pingpong_s"], "pingpong_beside_s": a["pingpong_beside_s"],
                         "tcp": a["tcp"]}} for v, a in acc.items()}


def stage_work(engine, hidden: int, rows: int):
    """One micro-batch's forward and backward through a copy of this rank's stage (the same layer
    shapes, weights of its own: the engine's are untouched), for ping-pongs beside compute."""
    lo, hi = engine.module.parts[engine.stage_id], engine.module.parts[engine.stage_id + 1]
    layers = nn.Sequential(*[cls(*args) for cls, *args in layer_factories(hidden)[lo:hi]])
    x = torch.randn(rows, hidden)

    def work() -> None:
        layers(x).square().mean().backward()
    return work


def probe_link(plan, handle, connections: int, far: set[str] | None, compute=None) -> dict:
    """The link as this rank's sends see it: ping-pongs over the way the pipeline sends (DeepSpeed's
    world-group p2p without ``handle``, ATLAS's WAN groups with it; launch.net.pingpong), with the
    ranks outside each pair running ``compute`` when given, and the kernel's view of this namespace's
    connections to the far data center (launch.net.sockets.tcp_info)."""
    import torch.distributed as dist

    from commweave import comm
    from launch.net.pingpong import Beside, pipeline_pingpong
    from launch.net.sockets import tcp_info

    me = dist.get_rank()
    if handle is None:
        def send(t, peer):
            comm.send(t, peer, dist.group.WORLD)

        def recv(t, peer):
            comm.recv(t, peer, dist.group.WORLD)
    else:
        def send(t, peer):
            handle.wan.isend(t, me, peer).wait()

        def recv(t, peer):
            handle.wan.irecv(t, me, peer).wait()
    beside = None if compute is None else Beside(
        compute, lambda t, r: comm.isend(t, r, dist.group.WORLD),
        lambda t, r: comm.irecv(t, r, dist.group.WORLD),
        range(dist.get_world_size()))
    seconds = pipeline_pingpong(plan.wan_pairs(), me, send, recv, connections, dist.barrier, beside=beside)
    keep = ("snd_wnd", "rcv_space", "rcv_ssthresh", "rb", "tb", "cwnd", "minrtt", "mss", "bytes_acked",
            "bytes_received", "cc", "local", "peer")
    return {"pingpong_s": seconds, "tcp": [{k: c[k] for k in keep if k in c} for c in tcp_info(far)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="directory for rank<N>.json")
    ap.add_argument("--reference", type=int, default=0, metavar="M",
                    help="print the single-process losses for M micro-batches per step and exit")
    ap.add_argument("--variants", default=None,
                    help="comma list of stock and K:spatial|temporal to time in turn (see the docstring)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before each variant's timed steps")
    ap.add_argument("--passes", type=int, default=1, choices=(1, 2),
                    help="2: the variants in order, then in reverse (--steps timed steps each visit)")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help="rows per micro-batch")
    args = ap.parse_args()
    for name in ("steps", "hidden", "micro_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be >= 0")
    variants = args.variants.split(",") if args.variants else None
    from launch.plan.calibrated import WanSetting

    for v in variants or ():
        WanSetting.parse(v)           # ValueError naming the setting and the rule
    if args.reference:
        print(json.dumps(reference_losses(args.steps, args.reference)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import deepspeed
    import torch.distributed as dist

    import launch.run.runtime as atlas
    from launch.net.sockets import established_connections

    plan = atlas.init()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    report = {"rank": dist.get_rank(), "env_rank": os.environ.get("RANK"),
              "stage": plan.coord(dist.get_rank())[0], "dc": plan.dc_of(dist.get_rank()),
              "env": {k: v for k, v in os.environ.items() if k.startswith(("ATLAS_", "NCCL_", "GLOO_"))
                      and k != "ATLAS_PLAN"}}

    me = dist.get_rank()
    far = {h.addr for h in plan.hosts if h.dc != plan.dc_of(me) and h.addr} or None

    def enable(plan):
        # TCP connections to the other data centers that the WAN groups open (from /proc/net/tcp)
        dist.barrier()
        before = established_connections(far)
        dist.barrier()
        handle = atlas.enable_deepspeed(plan)
        dist.barrier()
        report["wan_connections_opened"] = established_connections(far) - before
        return handle

    if variants:
        def enable_variant(plan, k, mode):
            dist.barrier()
            return atlas.enable_deepspeed(plan, connections=k, sharing=mode)

        report["variants"] = measure(plan, variants, args.steps, args.warmup, args.hidden, args.micro_batch,
                                     enable_variant,
                                     lambda handle, k, work: probe_link(plan, handle, k, far, work),
                                     args.passes)
        report["act_bytes"] = args.micro_batch * args.hidden * 4
    else:
        report["losses"] = train(args.steps, plan, enable)
    report["micro_batches"] = plan.micro_batches * plan.dp
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()
