"""Real text on every machine, no download: the Python standard library's own ``.py`` files, as bytes.

Vocabulary: the 256 byte values (no tokenizer). The files under ``sysconfig``'s ``stdlib`` path (minus
``site-packages``, which differs between environments) are sorted by their relative path; a file is
held out when the first byte of the SHA-256 of its relative path is below 256/10, about 10% of the
files, so the split depends on the file names only and is the same on every rank and in every run.
Train and held-out files are each concatenated into one byte string, files separated by a NUL byte.

Batches. Step ``i`` draws ``batch`` windows of ``seq + 1`` bytes at offsets from a generator seeded with
``(seed, i)``: inputs are the first ``seq`` bytes, targets the last ``seq``. Every rank draws the same
windows, and the run with the features off draws the same ones too (same seed, same order). The
held-out set is a fixed list of windows drawn once.

Context-parallel shards follow Megatron's zigzag layout (``get_batch_on_this_cp_rank``): the sequence
is cut into 2P chunks and rank r of P keeps chunks r and 2P-1-r, which balances causal attention work.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELD_OUT_PERCENT = 10
SEPARATOR = b"\0"


def held_out(relative_path: str) -> bool:
    """Whether a file belongs to the held-out split (by the hash of its path relative to the stdlib)."""
    return hashlib.sha256(relative_path.encode()).digest()[0] < 256 * HELD_OUT_PERCENT // 100


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every ``.py`` file of the standard library, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = [(p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
             if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library path {root}: the job trains on "
                                "the Python standard library's source, which this Python does not ship")
    return sorted(files)


@dataclass(frozen=True)
class Corpus:
    """The train and held-out byte streams (uint8 tensors) and the number of files in each."""

    train: torch.Tensor
    held_out: torch.Tensor
    train_files: int
    held_out_files: int

    @classmethod
    def load(cls, root: Path | None = None) -> Corpus:
        parts: dict[bool, list[bytes]] = {False: [], True: []}
        for rel, path in stdlib_files(root):
            parts[held_out(rel)].append(path.read_bytes())
        train, test = (SEPARATOR.join(parts[k]) for k in (False, True))
        return cls(torch.frombuffer(bytearray(train), dtype=torch.uint8),
                   torch.frombuffer(bytearray(test), dtype=torch.uint8), len(parts[False]), len(parts[True]))

    def describe(self) -> str:
        return (f"Python {sysconfig.get_python_version()} standard library: {self.train_files} train files "
                f"({self.train.numel() / 1e6:.1f} MB), {self.held_out_files} held-out files "
                f"({self.held_out.numel() / 1e6:.1f} MB)")


def windows(stream: torch.Tensor, count: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` windows of ``seq + 1`` bytes at random offsets: ``[count, seq + 1]`` int64."""
    if stream.numel() <= seq + 1:
        raise ValueError(f"seq={seq} needs more than {seq + 1} bytes of text, the stream has "
                         f"{stream.numel()}")
    starts = torch.randint(stream.numel() - seq - 1, (count,), generator=generator)
    return torch.stack([stream[s: s + seq + 1] for s in starts.tolist()]).long()


def train_batch(corpus: Corpus, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Step ``step``'s ``[batch, seq + 1]`` windows of training text (the same on every rank and run)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return windows(corpus.train, batch, seq, g)


def eval_batches(corpus: Corpus, count: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """The fixed held-out set: ``count`` batches of ``[batch, seq + 1]`` windows."""
    g = torch.Generator().manual_seed(seed * 1_000_003 - 1)
    return [windows(corpus.held_out, batch, seq, g) for _ in range(count)]


def zigzag_index(seq: int, world: int, rank: int) -> torch.Tensor:
    """The global positions rank ``rank`` of ``world`` holds: chunks r and 2P-1-r of 2P (zigzag)."""
    if seq % (2 * world):
        raise ValueError(f"seq={seq} must be divisible by 2 x context-parallel size = {2 * world} "
                         "(the zigzag layout gives each rank two of 2P equal chunks)")
    chunk = seq // (2 * world)
    first, second = rank * chunk, (2 * world - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard(window: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets, positions) of ``[batch, seq + 1]`` windows, sequence-first as
    Megatron lays activations out: inputs and targets ``[seq / P, batch]``, positions ``[seq / P]``."""
    seq = window.shape[1] - 1
    pos = zigzag_index(seq, world, rank)
    return window[:, pos].t().contiguous(), window[:, pos + 1].t().contiguous(), pos
