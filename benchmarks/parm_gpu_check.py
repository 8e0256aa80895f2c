"""Parm's checks for the GPU run of benchmarks/gpu_check.sh (issue 9 item 8), on one device:

    dispatch-combine   the extension's dispatch and combine, forward and backward, against the pure-torch
                       reference (ds_plugins.reference) in fp32 and bf16, for odd hidden sizes (33, 65), an
                       input that is a view at a storage offset (and one with a row stride), and on CUDA
                       inside a non-default stream
    bf16-layer         a ParmMoE (schedules s2 and "deepspeed") in bf16, forward + backward, against
                       DeepSpeed's MoE in bf16 on the same weights and input
    eval-auto          ``model.eval()`` and ``torch.no_grad()``: a forward of schedule "auto" against
                       DeepSpeed's MoE

    python -m benchmarks.parm_gpu_check --device cuda   # gpu_check.sh, step "parm" (the GPU machine)
    python -m benchmarks.parm_gpu_check --device cpu    # the same on the CPU (gpu_check.sh --dry-run,
                                                        # tests/benchmarks/test_parm_gpu_check.py)

One process, one rank (a one-rank process group is started when none is). Prints one line per check,
PASS / FAIL / SKIP with the largest error, then one JSON line; exit status 0 when no check failed. The
layer checks need deepspeed (the GPU run installs it from the carried wheels; without it they SKIP).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

ODD_HIDDEN = (33, 65)
DTYPES = (torch.float32, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _routes(k: int, tokens: int, experts: int, capacity: int, device, seed: int):
    """Random routes in DeepSpeed's sparse format: every live route its own slot, about 1/4 dropped."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(experts * capacity, generator=g)[: k * tokens].view(k, tokens)
    indices, locations = (slots // capacity).int(), (slots % capacity).int()
    dropped = torch.rand(k, tokens, generator=g) < 0.25
    indices[dropped], locations[dropped] = -1, capacity + 1
    gates = torch.rand(k, tokens, generator=g) + 0.1
    return indices.to(device), locations.to(device), gates.to(device)


def _inputs(tokens: int, hidden: int, dtype, device, layout: str, seed: int) -> torch.Tensor:
    """x [S, M]: contiguous, a view at a storage offset, or rows with a stride larger than M."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(tokens + 3, hidden + 5, generator=g).to(device=device, dtype=dtype)
    if layout == "offset":
        x = big.reshape(-1)[7: 7 + tokens * hidden].view(tokens, hidden)
        assert x.storage_offset() == 7 and x.is_contiguous()
    elif layout == "strided":
        x = big[2: 2 + tokens, 1: 1 + hidden]
        assert not x.is_contiguous()
    else:
        x = big[:tokens, :hidden].contiguous()
    return x


def _dispatch_combine(x, routes, experts: int, capacity: int, impl):
    """Forward and gradients of sum(w · combine(f(dispatch(x)))) with f a fixed scaling of each slot."""
    indices, locations, gates = routes
    x = x.detach().requires_grad_()  # the same view: its storage offset and strides stay
    gates = gates.detach().clone().requires_grad_()
    buf = impl.dispatch(x, indices, locations, experts, capacity)
    scale = torch.linspace(0.5, 1.5, buf.shape[1], device=x.device, dtype=buf.dtype).view(1, -1, 1)
    y = impl.combine(buf * scale, indices, locations, gates)
    w = torch.linspace(-1, 1, y.numel(), device=x.device).view_as(y).to(y.dtype)
    (y * w).float().sum().backward()
    return [t.float() for t in (buf, y, x.grad, gates.grad)]


def check_dispatch_combine(device: str) -> dict:
    from ds_plugins import dispatch, reference

    worst, cases = 0.0, 0
    stream = torch.cuda.Stream() if device == "cuda" else None
    for hidden in ODD_HIDDEN:
        for dtype in DTYPES:
            for layout in ("contiguous", "offset", "strided"):
                routes = _routes(2, 48, 6, 20, device, seed=hidden)
                x = _inputs(48, hidden, dtype, device, layout, seed=hidden + 1)
                want = _dispatch_combine(x, routes, 6, 20, reference)
                if stream is None:
                    got = _dispatch_combine(x, routes, 6, 20, dispatch)
                else:  # produced, consumed and differentiated on a side stream, read after a sync
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        got = _dispatch_combine(x, routes, 6, 20, dispatch)
                    torch.cuda.current_stream().wait_stream(stream)
                    torch.cuda.synchronize()
                for name, a, b in zip(("buffer", "output", "grad x", "grad gates"), got, want, strict=True):
                    err = ((a - b).abs().max() / b.abs().max().clamp_min(1)).item()
                    worst = max(worst, err)
                    if err > TOL[dtype]:
                        raise AssertionError(f"{name}: relative error {err:.3g} for M={hidden} {dtype} "
                                             f"{layout}")
                cases += 1
    return {"cases": cases, "max_rel_err": worst, "backend": dispatch.backend(device),
            "stream": "side stream" if stream is not None else "n/a (CPU)"}


def _layers(device: str, dtype, schedule: str, hidden: int = 32, ffn: int = 64, experts: int = 4):
    """DeepSpeed's MoE and a ParmMoE made from a copy of it (the same weights), on ``device`` in ``dtype``."""
    import copy

    from deepspeed.moe.layer import MoE
    from torch import nn

    from ds_plugins import ParmConfig, ParmMoE

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    ds = MoE(hidden, expert, num_experts=experts, k=2, capacity_factor=1.25, min_capacity=0)
    parm = ParmMoE.from_moe(copy.deepcopy(ds), ParmConfig(schedule=schedule))
    for layer in (ds, parm):
        layer.set_deepspeed_parallelism()
        layer.to(device=device, dtype=dtype)
    return ds, parm


def _run(layer, x, go, train: bool):
    x = x.detach().clone().requires_grad_(train)
    torch.manual_seed(3)  # the gate's random numbers (top-2 sampling) alike in both layers
    out, l_aux, _ = layer(x)
    if train:
        ((out.float() * go).sum() + l_aux).backward()
        return [out.float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()]
    return [out.float()]


def check_bf16_layer(device: str) -> dict:
    worst = 0.0
    for schedule in ("s2", "deepspeed"):
        ds, parm = _layers(device, torch.bfloat16, schedule)
        x = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
        go = torch.randn(64, 32, device=device)
        for a, b in zip(_run(parm, x, go, True), _run(ds, x, go, True), strict=True):
            err = ((a - b).abs().max() / b.abs().max().clamp_min(1)).item()
            worst = max(worst, err)
            if not torch.isfinite(a).all() or err > TOL[torch.bfloat16]:
                raise AssertionError(f"schedule {schedule}: relative error {err:.3g} against DeepSpeed's MoE")
    return {"schedules": ["s2", "deepspeed"], "max_rel_err": worst}


def check_eval_auto(device: str) -> dict:
    ds, parm = _layers(device, torch.float32, "auto")
    ds.eval()
    parm.eval()
    x = torch.randn(64, 32, device=device)
    with torch.no_grad():
        (want,), (got,) = _run(ds, x, None, False), _run(parm, x, None, False)
    err = (got - want).abs().max().item()
    if err > 1e-5 or got.requires_grad:
        raise AssertionError(f"no_grad forward with 'auto': max error {err:.3g} against DeepSpeed's MoE")
    return {"schedule_chosen": parm.last_schedule, "max_err": err}


CHECKS = {"dispatch-combine": (check_dispatch_combine, False), "bf16-layer": (check_bf16_layer, True),
          "eval-auto": (check_eval_auto, True)}
"""name: (check, needs deepspeed)"""


def _start_group(device: str) -> None:
    """A one-rank process group (and DeepSpeed's, when installed) for ParmMoE.set_deepspeed_parallelism."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from commweave.world import free_port

        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{free_port()}")


def run_checks(device: str) -> dict:
    """Every check on ``device``: {name: {"status": PASS|FAIL|SKIP, ...}}."""
    try:
        import deepspeed
    except ImportError as error:
        deepspeed, missing = None, str(error)
    results = {}
    for name, (check, needs_deepspeed) in CHECKS.items():
        if needs_deepspeed and deepspeed is None:
            results[name] = {"status": "SKIP", "why": f"deepspeed is not installed ({missing})"}
            continue
        try:
            if needs_deepspeed:
                _start_group(device)
                deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
                from deepspeed.utils import groups

                groups.mpu, groups.expert_tensor_parallel_world_size = None, 1
            results[name] = {"status": "PASS", **check(device)}
        except Exception as error:  # a failed check is reported, the others still run
            results[name] = {"status": "FAIL", "error": repr(error), "trace": traceback.format_exc()}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: --device cuda but torch sees no CUDA device")
        return 1
    results = run_checks(args.device)
    for name, r in results.items():
        detail = {k: v for k, v in r.items() if k not in ("status", "trace")}
        print(f"{r['status']} parm {name} on {args.device}: {detail}")
        if r["status"] == "FAIL":
            print(r["trace"])
    summary = {"benchmark": "parm_gpu_check", "device": args.device,
               "results": {name: {k: v for k, v in r.items() if k != "trace"} for name, r in results.items()}}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
