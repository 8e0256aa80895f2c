"""Checkpoints a job can be killed and restarted from: DeepSpeed's own files plus each rank's RNG state,
and a commit marker written only once every rank has finished writing.

    step = resume(engine, ckpt_dir)          # 0 when there is nothing to resume from
    for step in range(step, steps):
        ...train...
        if (step + 1) % save_every == 0:
            save(engine, ckpt_dir, step + 1)

``engine.save_checkpoint`` alone is not enough for a job that a SIGKILL can stop at any instruction:
DeepSpeed writes its ``latest`` file from rank 0 while other ranks may still be writing their shards
(or be dead), so ``latest`` can name a checkpoint that is not whole. Here every rank writes its files
and its RNG state (the gate's random token selection and jitter draw from it, so an exact resume needs
it), all ranks meet in a barrier, and only then rank 0 replaces ``committed`` atomically. ``resume``
reads ``committed``, never ``latest``. Older checkpoints are pruned, keeping ``keep``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

COMMITTED = "committed"


def _tag(step: int) -> str:
    return f"step{step}"


def save(engine, ckpt_dir: str | os.PathLike, step: int, keep: int = 2) -> None:
    """Save after ``step`` steps (collective: every rank calls it)."""
    root = Path(ckpt_dir)
    tag = _tag(step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
    torch.save(torch.get_rng_state(), root / tag / f"rng_rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / f"{COMMITTED}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / COMMITTED)
        old = sorted((p for p in root.glob("step*") if p.is_dir() and p.name != tag),
                     key=lambda p: int(p.name.removeprefix("step")))
        for path in old[:max(0, len(old) - keep + 1)]:
            shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def resume(engine, ckpt_dir: str | os.PathLike) -> int:
    """Load the last committed checkpoint, if any; returns the number of steps it holds (0 if none)."""
    marker = Path(ckpt_dir) / COMMITTED
    if not marker.exists():
        return 0
    tag = marker.read_text().strip()
    _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if client is None:
        raise RuntimeError(f"checkpoint {Path(ckpt_dir) / tag} (named by {marker}) could not be loaded")
    torch.set_rng_state(torch.load(Path(ckpt_dir) / tag / f"rng_rank{dist.get_rank()}.pt"))
    return int(client["step"])
