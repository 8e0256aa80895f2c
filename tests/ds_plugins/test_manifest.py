"""ds_plugins.manifest in one process: what is written, what is refused on reading, what verification
catches (the 4-rank save/load through a Parm engine is in tests/faults/test_checkpoint_files.py)."""

from __future__ import annotations

import json
import os

import pytest

from ds_plugins import manifest


@pytest.fixture(params=manifest.CHECKSUMS)
def written(request, tmp_path):
    for name, size in (("a.pt", 3 * 2**20 + 5), ("b.pt", 0)):
        (tmp_path / name).write_bytes(os.urandom(size))
    manifest.write(tmp_path, ["a.pt", "b.pt"], rank=1, checksum=request.param)
    return tmp_path, request.param


def test_a_manifest_lists_every_file_with_its_size_and_checksum(written):
    d, checksum = written
    m = json.loads((d / "commweave_manifest_rank1.json").read_text())
    assert m["format"] == 1 and m["checksum"] == checksum and sorted(m["files"]) == ["a.pt", "b.pt"]
    assert m["files"]["a.pt"]["bytes"] == 3 * 2**20 + 5
    entries = manifest.read(d)
    assert manifest.verify(d, entries, sorted(entries)) is None


@pytest.mark.parametrize("damage, text", [
    ("flip one byte", "does not match its"),
    ("64 bytes overwritten", "does not match its"),
    ("truncated", "bytes, the manifest says"),
    ("grown", "bytes, the manifest says"),
    ("removed", "is listed in the manifest but missing"),
])
def test_verification_names_the_damaged_file(written, damage, text):
    d, _ = written
    path = d / "a.pt"
    data = bytearray(path.read_bytes())
    if damage == "flip one byte":
        data[12345] ^= 1
    elif damage == "64 bytes overwritten":
        data[2**20: 2**20 + 64] = b"\x7f" * 64
    elif damage == "truncated":
        data = data[:-1]
    elif damage == "grown":
        data += b"\0"
    if damage == "removed":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    message = manifest.verify(d, manifest.read(d), ["a.pt", "b.pt"])
    assert message is not None and repr(str(path)) in message and text in message, message


@pytest.mark.parametrize("change, text", [
    (lambda m: m.update(format=2), "must be format 1"),
    (lambda m: m.update(checksum="md5"), "must be format 1 with checksums of ('crc32', 'sha256')"),
    (lambda m: m["files"].update({"../outside.pt": {"bytes": 1, "checksum": "0"}}),
     "'../outside.pt': must be"),
    (lambda m: m["files"]["a.pt"].update(bytes="12"), "'a.pt': must be a file name"),
    (lambda m: m.update(files=[]), "must be format 1"),
])
def test_a_malformed_manifest_is_refused(written, change, text):
    d, _ = written
    path = d / "commweave_manifest_rank1.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="checkpoint manifest=") as err:
        manifest.read(d)
    assert text in str(err.value) and str(path) in str(err.value)


def test_two_manifests_that_disagree_on_a_file_are_refused(written):
    d, checksum = written
    manifest.write(d, ["a.pt"], rank=2, checksum=checksum)
    assert manifest.read(d) is not None                      # the same entry twice is fine
    (d / "a.pt").write_bytes(b"other")
    manifest.write(d, ["a.pt"], rank=3, checksum=checksum)
    with pytest.raises(ValueError, match=r"'a\.pt' is listed twice, differently"):
        manifest.read(d)


def test_no_manifest_reads_as_none(tmp_path):
    assert manifest.read(tmp_path) is None


def test_the_setting(monkeypatch):
    monkeypatch.delenv(manifest.SETTING, raising=False)
    assert manifest.setting() == "crc32"
    for value in ("sha256", "off", "crc32"):
        monkeypatch.setenv(manifest.SETTING, value)
        assert manifest.setting() == value
    for value in ("0", "false", "SHA256", ""):
        monkeypatch.setenv(manifest.SETTING, value)
        with pytest.raises(ValueError, match=rf"COMMWEAVE_CHECKPOINT_MANIFEST='{value}': must be one of"):
            manifest.setting()
