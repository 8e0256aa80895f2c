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

Every path stays inside ``ckpt_dir`` (issue 22): ``committed`` must name a checkpoint of this directory,
``step<N>`` (a marker holding ``../outside_ckpt`` or a symlink out is refused with a clear error, on every
rank), the marker is written without following a symlink (commweave.files.write_atomic; a symlink
planted at ``committed`` is refused on every rank before anything is saved), and pruning
touches only this directory's own ``step<N>`` directories (a stray ``step_backup`` or a symlink is left
alone). With an engine from ``ds_plugins.initialize`` each rank's RNG file is listed in a manifest of its
own, beside DeepSpeed's files' (ds_plugins.manifest), and verified on load with them.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from commweave import comm, files, values
from ds_plugins import manifest

COMMITTED = "committed"
_TAG = re.compile(r"step(\d{1,19})", re.ASCII)
_MARKER_BYTES = 64


def _tag(step: int) -> str:
    return f"step{values.integer(step, 'step', lo=0)}"


def _checkpoints(root: Path) -> list[Path]:
    """This directory's own checkpoints: real directories named step<N>, oldest first."""
    found = [p for p in root.iterdir() if _TAG.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step")))


def _save_error(root: Path, step, keep) -> str | None:
    """This rank's refusal of save's arguments, None when they are fine."""
    try:
        _tag(step)
        values.integer(keep, "keep", lo=1, unit="checkpoints kept")
        manifest.setting()
        if root.exists() or root.is_symlink():
            values.directory(root, "ckpt_dir")
            values.write_target(root / COMMITTED, "the commit marker")
    except ValueError as e:
        return str(e)
    return None


def save(engine, ckpt_dir: str | os.PathLike, step: int, keep: int = 2) -> None:
    """Save after ``step`` steps (collective: every rank calls it; a refusal raises on every rank before
    anything is written)."""
    root = Path(ckpt_dir)
    error = _save_error(root, step, keep)
    comm.agree(dist.group.WORLD, "resume.save", error, step=-1 if error else step)
    tag = _tag(step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
    rng = f"rng_rank{dist.get_rank()}.pt"
    torch.save(torch.get_rng_state(), root / tag / rng)
    if (checksum := manifest.setting()) != "off":
        manifest.write(root / tag, [rng], dist.get_rank(), part="_rng", checksum=checksum)
    dist.barrier()
    if dist.get_rank() == 0:
        files.write_atomic(root / COMMITTED, tag, "the commit marker")
        old = [p for p in _checkpoints(root) if p.name != tag]
        for path in old[:max(0, len(old) - keep + 1)]:
            shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _committed(root: Path) -> tuple[str | None, str | None]:
    """(the committed tag or None, this rank's refusal of the marker or None)."""
    marker = root / COMMITTED
    if not marker.exists() and not marker.is_symlink():
        return None, None
    try:
        if marker.is_symlink() or not marker.is_file():
            values.refuse(f"the commit marker {str(marker)!r}", "<not a file>",
                          "must be a regular file of the checkpoint directory, not a symlink")
        with open(marker, "rb") as f:
            text = f.read(_MARKER_BYTES + 1).decode("ascii", errors="replace").strip()
        if len(text) > _MARKER_BYTES or _TAG.fullmatch(text) is None:
            values.refuse(f"the commit marker {str(marker)!r}", text[:_MARKER_BYTES],
                          "must name a checkpoint of this directory, step<N>")
        values.directory(values.confined(root, text, f"the commit marker {str(marker)!r}"),
                         f"the checkpoint named by {str(marker)!r}")
    except (ValueError, OSError) as e:
        return None, str(e)
    return text, None


def resume(engine, ckpt_dir: str | os.PathLike) -> int:
    """Load the last committed checkpoint, if any; returns the number of steps it holds (0 if none).
    Collective: a marker one rank refuses raises on every rank before anything is loaded."""
    root = Path(ckpt_dir)
    tag, error = _committed(root)
    comm.agree(dist.group.WORLD, "resume", error, committed=-1 if tag is None else int(tag[4:]))
    if tag is None:
        return 0
    _, client = engine.load_checkpoint(str(root), tag=tag)
    if client is None:
        raise RuntimeError(f"checkpoint {root / tag} (named by {root / COMMITTED}) could not be loaded")
    torch.set_rng_state(torch.load(root / tag / f"rng_rank{dist.get_rank()}.pt"))
    return int(client["step"])
