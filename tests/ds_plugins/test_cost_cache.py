"""The ``cost_cache`` setting and file (ds_plugins.cost_cache, issue 23 item 2): refused at parse time
with the key, the value and the rule; a file that cannot be read or holds bad costs ignored with one
warning, the same on every rank, even when it is bad on one rank only; writes atomic, never over a file
that is not a cost cache, a failure a warning.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_plugins import ParmConfig, ParmMoE, cost_cache, selector
from tests.ds_plugins.deepspeed_oracle import mlp, use_layout

KEY = "world4-mp2-esp2-ep2-gloo"
GOOD = [0.001, 1e-9] * 10 + [0.5]


def _file(path, entries=None, **top) -> str:
    data = {"format": cost_cache.FORMAT, "version": cost_cache.VERSION, "entries": entries or {}} | top
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("make, rule", [
    (lambda d: d, "it is a directory"),
    (lambda d: d / "missing" / "costs.json", "is not an existing directory"),
    (lambda d: _link(d), "it is a symlink"),
])
def test_bad_paths_are_refused_when_parsed(tmp_path, make, rule):
    path = str(make(tmp_path))
    with pytest.raises(ValueError, match="parm cost_cache=") as e:
        ParmConfig(cost_cache=path)
    assert path in str(e.value) and rule in str(e.value)


def _link(d):
    (d / "target.json").write_text("{}")
    os.symlink(d / "target.json", d / "link.json")
    return d / "link.json"


def test_a_directory_this_process_cannot_write_is_refused(tmp_path):
    """As another user (root may write anywhere): fork, drop to nobody, parse, in a directory nobody may
    enter but not write (under /tmp itself: pytest's own directories are closed to other users)."""
    tmp_path = tempfile.mkdtemp(dir="/tmp")
    os.chmod(tmp_path, 0o755)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            ParmConfig(cost_cache=os.path.join(tmp_path, "costs.json"))
            message = "accepted"
        except ValueError as e:
            message = str(e)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    os.waitpid(pid, 0)
    os.rmdir(tmp_path)
    assert message.startswith(f"parm cost_cache='{tmp_path}/costs.json'") and "not writable" in message


BAD_FILES = {
    "garbage": ("not json {", "not valid JSON"),
    "a list": ("[1, 2]", "the top level must be a JSON object"),
    "another JSON file": ('{"train_micro_batch_size_per_gpu": 8}', "must be a cost cache written by Parm"),
    "NaN": (None, "NaN is not JSON"),
    "duplicate key": (None, "duplicate"),
    "short entry": ({KEY: GOOD[:-2]}, f"entry '{KEY}' must be a list of 21 finite numbers"),
    "negative": ({KEY: [-1.0, *GOOD[1:]]}, "finite numbers >= 0"),
    "overlap above 1": ({KEY: [*GOOD[:-1], 2.0]}, "overlap in [0, 1]"),
    "strings": ({KEY: ["1"] * 21}, "finite numbers >= 0"),
    "booleans": ({KEY: [True] * 21}, "finite numbers >= 0"),
}


def _bad_text(case: str) -> str:
    content, _ = BAD_FILES[case]
    if case == "NaN":
        return json.dumps({"format": cost_cache.FORMAT, "version": 1, "entries": {KEY: [float("nan")] * 21}})
    if case == "duplicate key":
        return f'{{"format": "{cost_cache.FORMAT}", "version": 1, "entries": {{}}, "entries": {{}}}}'
    if isinstance(content, dict):
        return json.dumps({"format": cost_cache.FORMAT, "version": cost_cache.VERSION, "entries": content})
    return content


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_read_as_a_problem_naming_the_setting(tmp_path, case):
    path = tmp_path / "costs.json"
    path.write_text(_bad_text(case))
    entry, problem = cost_cache.read(str(path), KEY)
    assert entry is None and problem.startswith("parm cost_cache=") and BAD_FILES[case][1] in problem


def test_good_missing_and_other_layout_entries(tmp_path):
    path = _file(tmp_path / "costs.json", {KEY: GOOD})
    assert cost_cache.read(path, KEY) == (GOOD, None)
    assert cost_cache.read(path, "world4-mp4-esp4-ep1-gloo") == (None, None)     # another layout: refit
    assert cost_cache.read(str(tmp_path / "new.json"), KEY) == (None, None)
    assert cost_cache.read(None, KEY) == (None, None)


def test_writes_keep_other_entries_and_never_replace_a_foreign_file(tmp_path):
    path = _file(tmp_path / "costs.json", {"other": GOOD})
    assert cost_cache.write(path, KEY, GOOD)
    assert json.loads(Path(path).read_text())["entries"] == {"other": GOOD, KEY: GOOD}
    assert [p.name for p in tmp_path.iterdir()] == ["costs.json"]          # no temporary file left
    config = tmp_path / "ds_config.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 8}')
    with pytest.warns(RuntimeWarning, match="not saved .*must be a cost cache written by Parm"):
        assert not cost_cache.write(str(config), KEY, GOOD)
    assert config.read_text() == '{"train_micro_batch_size_per_gpu": 8}'
    gone = tmp_path / "gone"
    gone.mkdir()
    target = str(gone / "costs.json")
    cost_cache.check(target)
    gone.rmdir()                                                           # after the check: write fails
    with pytest.warns(RuntimeWarning, match="not saved"):
        assert not cost_cache.write(target, KEY, GOOD)


def _fit_with(files: dict[int, str | None], tmp: str) -> dict:
    """Rank r runs in its own directory holding ``files[r]`` as ``costs.json`` (a node-local file: the same
    setting, another content), then fits through a ParmMoE set-up; returns its warnings and costs."""
    cwd = os.getcwd()
    os.chdir(os.path.join(tmp, f"rank{dist.get_rank()}"))
    try:
        return _fit()
    finally:
        os.chdir(cwd)


def _fit() -> dict:
    use_layout(2, 2)
    selector._fitted.clear()
    selector._decisions.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = ParmMoE(8, mlp(8, 16), num_experts=4, ep_size=2, k=2, min_capacity=0,
                        enable_expert_tensor_parallelism=True, cost_cache="costs.json")
        layer.set_deepspeed_parallelism()
    fitted = selector._to_tensor(selector.fitted_costs(layer.parm_groups)).tolist()
    return {"warnings": [str(w.message) for w in caught if "cost_cache" in str(w.message)], "fitted": fitted,
            "file": open("costs.json").read() if os.path.exists("costs.json") else None}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", ["garbage on rank 2", "entry on ranks 0, 1 only", "good everywhere"])
def test_the_read_is_agreed_before_use(world, tmp_path, case):
    good = json.dumps({"format": cost_cache.FORMAT, "version": 1, "entries": {KEY: GOOD}})
    contents = {"garbage on rank 2": {0: good, 1: good, 2: "not json {", 3: good},
                "entry on ranks 0, 1 only": {0: good, 1: good},
                "good everywhere": dict.fromkeys(range(4), good)}[case]
    for r in range(4):
        (tmp_path / f"rank{r}").mkdir()
        if r in contents:
            (tmp_path / f"rank{r}" / "costs.json").write_text(contents[r])
    res = world.run(_fit_with, contents, str(tmp_path))
    for r in res:
        assert r["fitted"] == res[0]["fitted"]
    if case == "good everywhere":
        assert all(not r["warnings"] for r in res), res[0]["warnings"]
        assert res[0]["fitted"] == pytest.approx(GOOD, rel=1e-12)          # used, not measured
        return
    # the same single warning on every rank, then every rank measured (not the file's costs)
    assert all(r["warnings"] == res[0]["warnings"] and len(r["warnings"]) == 1 for r in res), \
        [r["warnings"] for r in res]
    assert res[0]["fitted"] != pytest.approx(GOOD, rel=1e-3)
    message = res[0]["warnings"][0]
    if case == "garbage on rank 2":
        assert message.startswith("parm: rank 2: parm cost_cache='costs.json'")
        assert "not valid JSON" in message
        assert res[2]["file"] == "not json {"                               # a foreign file is left alone
    else:
        assert "must agree on entry" in message
    assert json.loads(res[0]["file"])["entries"][KEY] == pytest.approx(res[0]["fitted"])   # rank 0 wrote


def _set_up_in(tmp: str) -> str:
    cwd = os.getcwd()
    os.chdir(os.path.join(tmp, f"rank{dist.get_rank()}"))
    try:
        use_layout(2, 2)
        layer = ParmMoE(8, mlp(8, 16), num_experts=4, ep_size=2, k=2, min_capacity=0,
                        enable_expert_tensor_parallelism=True, cost_cache="sub/costs.json")
        layer.set_deepspeed_parallelism()
        return "set up"
    except ValueError as e:
        return str(e)
    finally:
        os.chdir(cwd)


@pytest.mark.world_size(4)
def test_a_directory_missing_on_one_rank_is_one_error_on_every_rank(world, tmp_path):
    for r in range(4):
        (tmp_path / f"rank{r}" / ("sub" if r != 3 else "elsewhere")).mkdir(parents=True)
    res = world.run(_set_up_in, str(tmp_path))
    assert len(set(res)) == 1, res
    assert res[0].startswith("rank 3: ParmMoE: parm cost_cache='sub/costs.json'") and \
        "'sub' is not an existing directory" in res[0]
