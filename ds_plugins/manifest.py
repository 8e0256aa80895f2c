"""A manifest of checksums for every checkpoint file, written after the files and verified before DeepSpeed
loads any of them (issue 22: an expert shard with 64 bytes overwritten, its size unchanged, loaded without a
word and trained on weights of 3.4e38 until the loss was NaN).

Saving. ``engine.save_checkpoint`` writes each rank's files through its checkpoint engine's ``save`` (one
``torch.save`` per file) and then calls the engine's ``commit`` on every rank, before its final barrier.
:func:`install` wraps both methods of that engine instance: ``save`` remembers the files this rank wrote,
``commit`` hashes them and writes ``commweave_manifest_rank{r}.json`` into the tag's directory, atomically
(commweave.files.write_atomic), with the checksum :data:`SETTING` picks::

    {"format": 1, "checksum": "crc32", "files": {"layer_0_expert_3_mp_rank_00_model_states.pt":
                                                    {"bytes": 1049271, "checksum": "9f2c01d4"}, ...}}

so every file is listed by the rank that wrote it, after it was written, and each rank's manifest is on
disk before ``save_checkpoint`` returns anywhere (examples/resume.py commits after that).

Loading. ``engine.load_checkpoint`` is wrapped: it finds the tag as DeepSpeed does (``tag``, else the
``latest`` file), reads every manifest of that directory (commweave.values.load_json), and each rank
verifies its share of the listed files (file i of the sorted list on rank i mod world; with node-local
storage every rank verifies the files its node holds): the size, then the checksum. The verdicts are agreed
over the world (``comm.agree``), so a corrupt, truncated or missing file is one ValueError naming it on
every rank, before any of DeepSpeed's reads and collectives. A directory without a manifest (written by
DeepSpeed alone, or before manifests) loads as before, with one warning.

Cost: the checksum reads each file once more, right after it was written (from the page cache). On a
save of the main job's model (36.7 MiB over 4 CPU ranks) CRC-32 added 9-14% to ``save_checkpoint`` and
SHA-256 30-32% (README, ``python -m benchmarks.checkpoint_manifest``): more than a few percent, so
:data:`SETTING` can switch it off; it stays on by default, CRC-32 (it finds any burst of up to 32 bits and
all but 2**-32 of other corruptions; SHA-256 when a file must not be forged either).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
import zlib
from pathlib import Path

import torch.distributed as dist

from commweave import comm, files, values

FORMAT = 1
_PREFIX = "commweave_manifest_rank"
_CHUNK = 2**20
CHECKSUMS = ("crc32", "sha256")
SETTING = "COMMWEAVE_CHECKPOINT_MANIFEST"
"""The environment variable that picks the checksum, or switches the manifest off: one of
:data:`CHECKSUMS` or "off"; crc32 by default (module docstring)."""


def manifest_name(rank: int, part: str = "") -> str:
    """``part`` names a second manifest of one rank (examples/resume.py lists its RNG files in its own)."""
    return f"{_PREFIX}{rank}{part}.json"


def digest(path: Path, checksum: str) -> str:
    """The file's checksum in hex: CRC-32 (zlib) or SHA-256 (hashlib)."""
    with open(path, "rb") as f:
        if checksum == "sha256":
            return hashlib.file_digest(f, "sha256").hexdigest()
        crc = 0
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
        return f"{crc:08x}"


def write(directory: Path, names: list[str], rank: int, part: str = "", checksum: str = "crc32") -> Path:
    """The manifest of ``names`` (files in ``directory``, just written by this rank)."""
    entries = {}
    for name in sorted(set(names)):
        path = directory / name
        entries[name] = {"bytes": path.stat().st_size, "checksum": digest(path, checksum)}
    text = json.dumps({"format": FORMAT, "checksum": checksum, "files": entries}, indent=1)
    return files.write_atomic(directory / manifest_name(rank, part), text, "checkpoint manifest")


def read(directory: Path) -> dict[str, dict] | None:
    """Every manifest of ``directory`` merged, {file name: {bytes, checksum, kind}}; None when there is
    none."""
    found = sorted(directory.glob(f"{_PREFIX}*.json"))
    if not found:
        return None
    merged: dict[str, dict] = {}
    for path in found:
        m = values.load_json(path, "checkpoint manifest", top=dict)
        well_formed = m.get("format") == FORMAT and m.get("checksum") in CHECKSUMS
        if not well_formed or not isinstance(m.get("files"), dict):
            values.refuse("checkpoint manifest", str(path), f"must be format {FORMAT} with checksums of "
                                                            f"{CHECKSUMS}")
        for name, entry in m["files"].items():
            ok = (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                  and isinstance(entry.get("checksum"), str))
            if not ok or Path(name).name != name:
                values.refuse("checkpoint manifest", str(path), f"entry {name!r}: must be a file name of "
                                                                "this directory with its bytes and checksum")
            entry = {**entry, "kind": m["checksum"]}
            if name in merged and merged[name] != entry:
                values.refuse("checkpoint manifest", str(path), f"{name!r} is listed twice, differently")
            merged[name] = entry
    return merged


def verify(directory: Path, entries: dict[str, dict], names: list[str]) -> str | None:
    """The first of ``names`` whose file does not match its entry, as an error message; None if all do."""
    for name in names:
        path, entry = directory / name, entries[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"checkpoint file {str(path)!r} is listed in the manifest but missing"
        if size != entry["bytes"]:
            return (f"checkpoint file {str(path)!r} has {size} bytes, the manifest says {entry['bytes']}: "
                    "it was truncated or changed after it was written")
        got = digest(path, entry["kind"])
        if got != entry["checksum"]:
            return (f"checkpoint file {str(path)!r} does not match its {entry['kind']} in the manifest (got "
                    f"{got[:16]}, written {entry['checksum'][:16]}): it was changed or corrupted after it "
                    "was written")
    return None


def _save(engine_save, written: list, state_dict, path):
    engine_save(state_dict, path)
    written.append(Path(path))


def _commit(engine_commit, written: list, checksum: str, info):
    """Write this rank's manifest of the files it saved under the committed tag, then commit."""
    directory = Path(info.save_dir) / str(info.tag)
    mine = [p.name for p in written if p.parent == directory]
    written.clear()
    if mine:
        write(directory, mine, dist.get_rank(), checksum=checksum)
    return engine_commit(info)


def _load(engine, original, load_dir, tag=None, *args, **kwargs):
    if tag is None:
        latest = Path(load_dir) / ("latest_universal" if engine.load_universal_checkpoint() else "latest")
        tag = latest.read_text().strip() if latest.is_file() else None
    if tag is not None:
        check(Path(load_dir) / str(tag), local=engine.use_node_local_storage())
    return original(load_dir, tag, *args, **kwargs)


def check(directory: Path, local: bool = False) -> None:
    """Verify ``directory``'s files against its manifests, a share per rank, agreed over the world
    (collective: every rank calls it). ``local``: every rank checks all the files it can see."""
    error = None
    try:
        entries = read(directory) if directory.is_dir() else None
        if entries is None:
            if directory.is_dir():
                warnings.warn(f"checkpoint {str(directory)!r} has no commweave manifest: its files are "
                              "loaded unverified", RuntimeWarning, stacklevel=3)
        else:
            names = sorted(entries)
            if local:
                names = [n for n in names if (directory / n).exists()]
            else:
                names = names[dist.get_rank()::dist.get_world_size()]
            error = verify(directory, entries, names)
    except (ValueError, OSError) as e:
        error = str(e)
    comm.agree(dist.group.WORLD, "checkpoint manifest", error)


def setting() -> str:
    """This process's :data:`SETTING`: "crc32" (the default), "sha256" or "off"."""
    return values.choice(os.environ.get(SETTING, "crc32"), SETTING, (*CHECKSUMS, "off"))


def install(engine, checksum: str | None = None) -> None:
    """Write a manifest with every checkpoint of ``engine`` and verify it on load (module docstring).
    ``checksum``: one of :data:`CHECKSUMS` or "off"; None: :func:`setting`, agreed over the world
    (collective: every rank calls it, as ``ds_plugins.initialize`` does)."""
    if checksum is None:
        error = None
        try:
            checksum = setting()
        except ValueError as e:
            error, checksum = str(e), "off"
        comm.agree(dist.group.WORLD, SETTING, error, checksum=(*CHECKSUMS, "off").index(checksum))
    if checksum == "off" or hasattr(engine, "_commweave_manifest"):
        return
    ce = engine.checkpoint_engine
    written: list[Path] = []
    engine._commweave_manifest = (ce.save, ce.commit, engine.load_checkpoint)
    ce.save = functools.partial(_save, ce.save, written)
    ce.commit = functools.partial(_commit, ce.commit, written, checksum)
    engine.load_checkpoint = functools.partial(_load, engine, engine.load_checkpoint)


def uninstall(engine) -> None:
    """Back to DeepSpeed's own saving and loading (benchmarks.checkpoint_manifest times both)."""
    originals = engine.__dict__.pop("_commweave_manifest", None)
    if originals is not None:
        ce = engine.checkpoint_engine
        ce.save, ce.commit, engine.load_checkpoint = originals
