"""The Megatron-LM route as the README prints it: Megatron-LM's own pretrain_gpt.py training loop with
WallFacer (``python -m megatron_patches.megatron_lm``), against a Megatron-LM source tree named by
$MEGATRON_LM_PATH (skipped without it; tested with the core_v0.16.1 tag).

The README's command runs on 4 CPU ranks through tests/megatron_patches/megatron_lm_cpu.py (which points
Megatron-LM's CUDA calls at the CPU) with the CPU-only flags below added; its per-iteration loss must
equal that of stock Megatron-LM (megatron-core's DotProductAttention, CP = 1, one rank) on the same
data. Megatron-LM's Python needs beyond megatron-core (six, regex, pyyaml, triton, pybind11 for its
dataset helper) must be importable, e.g. from a folder on PYTHONPATH.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch.run.runner import _drop_option

REPO = Path(__file__).resolve().parents[2]
ROOT = os.environ.get("MEGATRON_LM_PATH")

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slow,
              pytest.mark.skipif(not ROOT, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout "
                                                  "(core_v0.16.1) to run Megatron-LM's training loop")]

# What CPU ranks need beyond the README's (GPU) command: gloo, megatron-core's local modules, CPU
# weights, no CUDA fusions, learned positions (megatron-core's RoPE calls CUDA), no dropout and no
# gradient clipping (its norm asserts CUDA tensors). The oracle run takes the same.
CPU_FLAGS = shlex.split(
    "--distributed-backend gloo --transformer-impl local --use-cpu-initialization "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
    "--position-embedding-type learned_absolute --hidden-dropout 0 --clip-grad 0")
LAUNCHER = str(REPO / "tests/megatron_patches/megatron_lm_cpu.py")


def readme_command() -> tuple[dict, int, list[str]]:
    """The README's Megatron-LM command: its environment, --nproc-per-node and the arguments."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"^ {4}MEGATRON_LM_PATH=.*?(?=\n(?! {4}))", text, re.M | re.S)
    assert block, "README.md lost its Megatron-LM command"
    words = shlex.split(block.group(0).replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words[:words.index("torchrun")])
    rest = words[words.index("torchrun") + 1:]
    assert rest[:2] == ["--nproc-per-node", "4"] and rest[2:4] == ["-m", "megatron_patches.megatron_lm"], rest
    return env, 4, rest[4:]


def _run(args: list[str], nproc: int, port: int, env: dict, tmp_path) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, "MEGATRON_LM_PATH": ROOT, "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(port), LAUNCHER, *args]
    return subprocess.run(cmd, env=full, cwd=tmp_path, capture_output=True, text=True, timeout=900)


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out)]


@pytest.mark.parametrize("extra", [[], ["--qk-layernorm"]], ids=["readme", "qk-layernorm"])
def test_readme_command_trains_like_stock_megatron_lm(tmp_path, extra):
    """Loss equal to stock Megatron-LM's, iteration by iteration; with --qk-layernorm too, which a spec
    not built from the run's arguments would drop (and the losses would differ)."""
    env, nproc, args = readme_command()
    assert env["MEGATRON_LM_PATH"] and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    port = 29741 + 4 * len(extra)
    run = _run(args + CPU_FLAGS + extra, nproc, port, env, tmp_path)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "WallFacerAttention is the core attention of 2 layers (team size 2)" in log, log[-4000:]
    ours = _losses(log)
    assert len(ours) == 3, log[-3000:]
    stock_args = _drop_option(args, "--context-parallel-size", "--wallfacer-team-size") + CPU_FLAGS + extra
    stock = _run(["--stock", *stock_args], 1, port + 1, env, tmp_path)
    assert stock.returncode == 0, (stock.stdout + stock.stderr)[-4000:]
    want = _losses(stock.stdout + stock.stderr)
    assert ours == pytest.approx(want, rel=1e-5), (ours, want)


def _document_data(tmp_path, vocab=128, docs=400, seed=0) -> str:
    """An indexed dataset (Megatron's .bin/.idx) of short documents, 2 … 40 tokens, each ending with
    NullTokenizer's end-of-document token (its id is the vocabulary size): what tools/preprocess_data.py
    --append-eod writes."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "documents")
    gen = torch.Generator().manual_seed(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(docs):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        tokens = torch.cat([torch.randint(0, vocab, (n,), generator=gen), torch.tensor([vocab])])
        builder.add_document(tokens.to(torch.int32), [n + 1])
    builder.finalize(prefix + ".idx")
    return prefix


def test_packed_documents_train_like_stock_megatron_lm(tmp_path):
    """--reset-attention-mask --reset-position-ids on a dataset of short documents: stock Megatron-LM at
    CP = 1 attends inside each document through the dataset's dense document mask (DotProductAttention);
    the route at CP = 4 takes the same documents as a packed batch (from the end-of-document tokens, no
    mask: the README's --no-create-attention-mask-in-dataloader) — the same loss iteration by iteration,
    and not the loss of the same data without the document boundaries."""
    env, nproc, args = readme_command()
    data = ["--data-path", _document_data(tmp_path), "--split", "100,0,0"]
    args = [a for a in args if a != "--mock-data"] + data + ["--reset-attention-mask", "--reset-position-ids"]
    run = _run(args + CPU_FLAGS, nproc, 29761, env, tmp_path)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "documents of the first batch go to WallFacer as a packed batch" in log, log[-4000:]
    ours = _losses(log)
    assert len(ours) == 3, log[-3000:]
    stock_args = [a for a in _drop_option(args, "--context-parallel-size", "--wallfacer-team-size")
                  if a != "--no-create-attention-mask-in-dataloader"] + CPU_FLAGS
    stock = _run(["--stock", *stock_args], 1, 29762, env, tmp_path)
    assert stock.returncode == 0, (stock.stdout + stock.stderr)[-4000:]
    assert ours == pytest.approx(_losses(stock.stdout + stock.stderr), rel=1e-5)
    resets = ("--reset-attention-mask", "--reset-position-ids")
    blind = _run(["--stock", *[a for a in stock_args if a not in resets]], 1, 29763, env, tmp_path)
    assert blind.returncode == 0, (blind.stdout + blind.stderr)[-4000:]
    assert ours[0] != pytest.approx(_losses(blind.stdout + blind.stderr)[0], rel=1e-4)


def test_attention_dropout_is_refused_naming_the_argument(tmp_path):
    env, nproc, args = readme_command()
    args = _drop_option(args, "--attention-dropout") + CPU_FLAGS + ["--attention-dropout", "0.1"]
    run = _run(args, nproc, 29751, env, tmp_path)
    assert run.returncode != 0
    want = "--attention-dropout 0.1: WallFacer has no attention dropout; set --attention-dropout 0"
    assert want in run.stderr, run.stderr[-3000:]
