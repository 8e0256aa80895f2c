"""Checkpoint files: written where they should be, verified when read (issue 22, item 5), on 4 ranks.

examples/resume.py, with a stand-in engine (the paths are resume's, the files DeepSpeed's are not needed):
a ``committed`` marker naming ``../outside_ckpt``, an absolute path, a symlink out, a missing checkpoint or
garbage is refused on every rank before anything is loaded, and nothing outside the checkpoint directory
changes; a stray ``step_backup`` directory, or symlinks planted at the marker's old temporary name, do not
disturb ``save``.

ds_plugins.manifest, with a real Parm engine (tp 2 x ep 2, ZeRO 1): an expert shard with 64 bytes
overwritten (size unchanged), a truncated file, a missing file and a manifest with a duplicated key are
each refused on every rank with the same error naming the file; the intact checkpoint loads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.faults import corpus

WORLD = 4


class _Engine:
    """save_checkpoint / load_checkpoint as resume.py uses them: each rank writes one file into the tag."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def save_checkpoint(self, root, tag, client_state, save_latest):
        d = Path(root) / tag
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        (d / f"model_rank{dist.get_rank()}.pt").write_bytes(b"weights")

    def load_checkpoint(self, root, tag):
        self.loaded.append(tag)
        return str(Path(root) / tag), {"step": int(tag[4:])}


def _plant(root: Path, case: str) -> None:
    """The checkpoint directory root/ckpt set up for ``case``, and root/outside_ckpt beside it."""
    ckpt, outside = root / "ckpt", root / "outside_ckpt"
    (ckpt / "step2").mkdir(parents=True)
    outside.mkdir()
    (outside / "model.pt").write_bytes(b"not ours")
    (outside / "victim").write_text("keep")
    marker = ckpt / "committed"
    if case == "../outside_ckpt":
        marker.write_text("../outside_ckpt")
    elif case == "absolute path":
        marker.write_text(str(outside))
    elif case == "step2 a symlink out":
        (ckpt / "step2").rmdir()
        os.symlink(outside, ckpt / "step2")
        marker.write_text("step2")
    elif case == "marker a symlink out":
        (outside / "marker").write_text("step2")
        os.symlink(outside / "marker", marker)
    elif case == "missing checkpoint":
        marker.write_text("step9")
    elif case == "garbage":
        marker.write_bytes(os.urandom(4096))
    elif case == "a directory":
        marker.mkdir()


RESUME = {  # case -> text every rank's error must hold
    "../outside_ckpt": "must name a checkpoint of this directory, step<N>",
    "absolute path": "must name a checkpoint of this directory, step<N>",
    "step2 a symlink out": "must be a relative path inside",
    "marker a symlink out": "must be a regular file of the checkpoint directory, not a symlink",
    "missing checkpoint": "must be an existing directory (no such file)",
    "garbage": "must name a checkpoint of this directory, step<N>",
    "a directory": "must be a regular file of the checkpoint directory, not a symlink",
}


def _resume_refuses(ckpt: str) -> tuple[str, list[str]]:
    from examples.resume import resume

    engine = _Engine()
    try:
        resume(engine, ckpt)
    except ValueError as e:
        return str(e), engine.loaded
    return "", engine.loaded


@pytest.mark.fault("refused", kind="resume: commit marker")
@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("case", list(RESUME))
def test_a_marker_that_leads_out_is_refused_on_every_rank(world, tmp_path, case):
    _plant(tmp_path, case)
    with corpus.no_files_outside(tmp_path, tmp_path / "ckpt"):
        results = world.run(_resume_refuses, str(tmp_path / "ckpt"))
    assert all(loaded == [] for _, loaded in results)        # nothing loaded before the error
    corpus.says([m for m, _ in results], RESUME[case], "committed")


def _save_three(ckpt: str) -> tuple[list[str], int]:
    from examples.resume import resume, save

    engine = _Engine()
    for step in (1, 2, 3):
        save(engine, ckpt, step, keep=2)
    return sorted(p.name for p in Path(ckpt).iterdir() if not p.name.startswith(".")), resume(engine, ckpt)


@pytest.mark.fault("harmless", kind="resume: save among strays")
@pytest.mark.world_size(WORLD)
def test_save_ignores_unrelated_entries_and_never_writes_through_symlinks(world, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_backup").mkdir(parents=True)               # a person's copy: not a checkpoint of ours
    (ckpt / "step_backup" / "keep.pt").write_text("keep")
    (tmp_path / "victim").write_text("keep")
    os.symlink(tmp_path / "victim", ckpt / "committed.tmp")  # the marker's old temporary name
    with corpus.no_files_outside(tmp_path, ckpt):
        results = world.run(_save_three, str(ckpt))
    for names, step in results:
        if names != ["committed", "committed.tmp", "step2", "step3", "step_backup"] or step != 3:
            raise corpus.WrongResult(f"entries {names}, resumed at step {step}")
    assert (ckpt / "committed").read_text() == "step3" and not (ckpt / "committed").is_symlink()
    assert (ckpt / "step_backup" / "keep.pt").read_text() == "keep"


def _save_once(ckpt: str) -> tuple[str, list[str]]:
    from examples.resume import save

    try:
        save(_Engine(), ckpt, 1)
    except ValueError as e:
        return str(e), sorted(p.name for p in Path(ckpt).iterdir())
    return "", sorted(p.name for p in Path(ckpt).iterdir())


@pytest.mark.fault("refused", kind="resume: save among strays")
@pytest.mark.world_size(WORLD)
def test_a_symlink_planted_at_the_marker_is_refused_before_anything_is_saved(world, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "victim").write_text("keep")
    os.symlink(tmp_path / "victim", ckpt / "committed")
    with corpus.no_files_outside(tmp_path, ckpt):
        results = world.run(_save_once, str(ckpt))
    assert all(names == ["committed"] for _, names in results), results   # nothing saved
    corpus.says([m for m, _ in results], "the commit marker=", "not a symlink; it is a symlink")


# ---------------------------------------------------------------------------------------------------------
# Checkpoints of a Parm engine carry a manifest of checksums
# ---------------------------------------------------------------------------------------------------------

PARM = {"enabled": True, "schedule": "s2", "overlap_chunks": 2}


def _expert_file(d: Path) -> Path:
    return sorted(d.glob("layer_0_expert_*_model_states.pt"))[-1]


def _overwrite_64_bytes(d: Path) -> str:
    path = _expert_file(d)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\x7f" * 64)                                 # 64 bytes of 3.4e38, the size unchanged
    return path.name


def _truncate(d: Path) -> str:
    path = _expert_file(d)
    os.truncate(path, path.stat().st_size - 1)
    return path.name


def _remove(d: Path) -> str:
    path = _expert_file(d)
    path.unlink()
    return path.name


def _duplicate_key(d: Path) -> str:
    path = d / "commweave_manifest_rank0.json"
    text = path.read_text()
    path.write_text(text.replace('{\n "format": 1,', '{\n "format": 1,\n "format": 1,', 1))
    return path.name


DAMAGE = {  # case -> (change, text every rank's error must hold besides the file's name)
    "expert shard, 64 bytes overwritten": (_overwrite_64_bytes, "does not match its crc32 in the manifest"),
    "expert shard truncated": (_truncate, "bytes, the manifest says"),
    "expert shard missing": (_remove, "is listed in the manifest but missing"),
    "manifest with a duplicated key": (_duplicate_key, "duplicate key 'format'"),
}


def _manifest_cases(root: str) -> dict[str, tuple[str, str]]:
    import shutil

    from tests.ds_plugins import training
    from tests.ds_plugins.training import LayerSpec

    layers = (LayerSpec(ep=2),)
    engine, mpu = training.build(layers, PARM, 1)
    training.train(engine, mpu, 0, 2)
    engine.save_checkpoint(root, tag="t")
    fresh, _ = training.build(layers, PARM, 1, seed=1)
    d, pristine = Path(root) / "t", Path(root) / "pristine"
    out = {}
    for case, (damage, _) in DAMAGE.items():
        name = ""
        if dist.get_rank() == 0:
            shutil.copytree(d, pristine)
            name = damage(d)
        dist.barrier()
        try:
            fresh.load_checkpoint(root, tag="t")
            out[case] = ("", "")
        except ValueError as e:
            out[case] = (str(e), name)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(d)
            pristine.rename(d)
        dist.barrier()
    path, _ = fresh.load_checkpoint(root, tag="t")
    out["intact"] = (str(path), sorted(p.name for p in d.glob("commweave_manifest_rank*.json")))
    return out


@pytest.fixture(scope="module")
def manifest_results(world_pool, tmp_path_factory):
    world = world_pool.get(WORLD)
    return world.run(_manifest_cases, str(tmp_path_factory.mktemp("manifest")))


@pytest.mark.fault("refused", kind="checkpoint files changed after saving")
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_changed_checkpoint_file_is_refused_on_every_rank(manifest_results, case):
    name = manifest_results[0][case][1]
    corpus.says([r[case][0] for r in manifest_results], name, DAMAGE[case][1])


@pytest.mark.fault("harmless", kind="checkpoint files changed after saving")
def test_the_intact_checkpoint_loads_with_one_manifest_per_rank(manifest_results):
    path, manifests = manifest_results[0]["intact"]
    assert path != "None"
    assert manifests == [f"commweave_manifest_rank{r}.json" for r in range(WORLD)]
