"""The README's main job, reduced (``--quick``), under the deepspeed launcher on 4 CPU ranks: both runs
train, their losses agree within the stated tolerance, the held-out loss falls, and the table, the PNG
chart, the results and the config are written to runs/<timestamp>/. Plus the job's input checks."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from examples.gpt import data
from examples.gpt.agreement import Tolerance
from examples.gpt.train import Result

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _readme_job_command() -> list[str]:
    """The launcher part of the README's first command (after the install)."""
    head = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    (line,) = [c.strip() for c in head.splitlines() if c.startswith("    ") and "train_gpt.py" in c]
    job = line.split("&&")[-1].split()
    assert job[:2] == ["DS_ACCELERATOR=cpu", "deepspeed"], line
    return job[1:]


@pytest.mark.slow
def test_main_job_quick(tmp_path):
    launcher = Path(sys.executable).parent / "deepspeed"
    if not launcher.exists():
        pytest.skip(f"the deepspeed launcher is not installed next to {sys.executable}")
    cmd = [str(launcher), "--master_port", str(_free_port()), *_readme_job_command()[1:], "--quick",
           "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert re.search(r"\| DeepSpeed: .*\|\n\| commweave: .*\|", out.stdout), out.stdout[-3000:]
    assert ": agree (fp32" in out.stdout, out.stdout[-3000:]

    (run_dir,) = tmp_path.iterdir()
    files = {p.name for p in run_dir.iterdir()}
    assert {"table.md", "chart.png", "config.json", "results.json", "sample.txt"} <= files, files
    assert (run_dir / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "table.md").read_text().strip() in out.stdout
    config = json.loads((run_dir / "config.json").read_text())
    assert config["deepspeed_config"]["parm"]["enabled"] is True
    off_changes = config["features_off"]
    assert off_changes["parm"]["enabled"] is False and off_changes["wallfacer_team_size"] == 1

    runs = json.loads((run_dir / "results.json").read_text())
    off, on = (Result(**{k: v for k, v in runs[name].items() if k in Result.__dataclass_fields__})
               for name in ("DeepSpeed", "commweave"))
    assert len(off.losses) == len(on.losses) == 30
    tolerance = Tolerance.for_config(config["deepspeed_config"])
    assert tolerance.agree(off, on)
    lagging = Result("lag", losses=[off.losses[0], *off.losses[:-1]], evals=off.evals)
    assert not tolerance.agree(off, lagging)          # one step behind is far outside the tolerance
    for res in (off, on):
        assert res.evals[-1][1] < res.evals[0][1] - 1.0, res.evals    # held-out loss falls (from ln 256)
        assert res.sent["all_to_all"] > 0 and res.sent["all_reduce"] > 0
    # what each run ran: DeepSpeed's MoE and ring attention; one of Parm's schedules (auto picks among the
    # deepspeed order, S1 and S2) and WallFacer's teams of 2
    assert off.schedules == ["deepspeed-moe"]
    assert set(on.schedules) <= {"parm:deepspeed", "parm:s1", "parm:s2"}
    assert any(k.startswith("send@wallfacer.ring") for k in off.sent_by_group)
    assert any(k.endswith("@wallfacer.team") for k in on.sent_by_group)
    assert not any(k.endswith("@wallfacer.team") for k in off.sent_by_group)


def _result(losses, held_out):
    return Result("r", losses=list(losses), evals=[(0, 6.0), (len(losses), held_out)])


def test_tolerance_rules():
    fp32 = Tolerance.for_config({"parm": {}})
    assert (fp32.dtype, fp32.per_step, fp32.final) == ("fp32", 1e-5, 1e-2)
    assert Tolerance.for_config({"bf16": {"enabled": True}}).dtype == "bf16"
    losses = [6.0 - 0.01 * i for i in range(100)]
    base = _result(losses, 2.5)
    assert fp32.agree(base, _result([x * (1 + 5e-6) for x in losses], 2.5))
    assert not fp32.agree(base, _result([x * (1 + 5e-5) for x in losses], 2.5))        # early steps differ
    late = [x * (1 + (5e-3 if i >= 30 else 0)) for i, x in enumerate(losses)]
    assert fp32.agree(base, _result(late, 2.5 * 1.005))                               # trajectories separated
    assert not fp32.agree(base, _result(late, 2.5 * 1.02))                             # a worse result
    assert not fp32.agree(base, _result(losses[:-1], 2.5))                             # not the same run
    assert "agree (fp32" in fp32.describe(base, base) and "DISAGREE" in fp32.describe(base, _result(late, 3))


def test_split_is_by_path_and_stable(tmp_path):
    for i in range(40):
        sub = tmp_path / ("test" if i % 3 else "pkg")
        sub.mkdir(exist_ok=True)
        (sub / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "foreign.py").write_text("y = 1\n")
    corpus = data.Corpus.load(tmp_path)
    assert corpus.train_files + corpus.held_out_files == 40      # site-packages left out
    held = [rel for rel, _ in data.stdlib_files(tmp_path) if data.held_out(rel)]
    assert 0 < len(held) < 40 and corpus.held_out_files == len(held)
    assert data.held_out("json/decoder.py") == data.held_out("json/decoder.py")
    a, b = (data.train_batch(corpus, 3, 2, 4, seed=7) for _ in range(2))
    assert a.equal(b) and not a.equal(data.train_batch(corpus, 4, 2, 4, seed=7))


def test_zigzag_shards_cover_the_sequence_once():
    seq, world = 32, 4
    positions = [data.zigzag_index(seq, world, r) for r in range(world)]
    assert sorted(int(p) for ps in positions for p in ps) == list(range(seq))
    assert positions[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]         # chunks 0 and 2P-1
    window = data.torch.arange(2 * (seq + 1)).view(2, seq + 1)
    tokens, targets, pos = data.shard(window, world, 1)
    assert tokens.shape == (seq // world, 2) and (targets - tokens == 1).all() and pos.equal(positions[1])
    with pytest.raises(ValueError, match="seq=30 must be divisible by 2 x context-parallel size = 8"):
        data.zigzag_index(30, world, 0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--steps", "3", "--warmup-steps", "3"], r"--warmup-steps 3 must be in \[0, --steps 3\)"),
])
def test_bad_arguments_name_the_argument(argv, message):
    from examples.train_gpt import parse

    with pytest.raises(ValueError, match=message):
        parse(argv)


@pytest.mark.parametrize(("edit", "message"), [
    ({"parm": {"enabled": False}}, 'the "parm" section must be enabled'),
    ({"parm": {"enabled": True, "schedule": "s3"}}, "parm schedule='s3' is not one of"),
    ({"gradient_clipping": 1.0}, '"gradient_clipping": 1.0 must be 0'),
    ({"gradient_clipping": None}, '"gradient_clipping": 1.0 must be 0'),
])
def test_bad_configs_name_the_key(tmp_path, edit, message):
    from examples.train_gpt import load_config

    config = json.loads((ROOT / "configs" / "gpt_cpu.json").read_text())
    for key, value in edit.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_config(str(path), 8)


def test_layout_errors_name_the_argument():
    from examples.gpt.layout import check_layout

    ok = {"world": 4, "tp": 2, "ep": 2, "experts": 4, "heads": 4, "seq": 64, "team_size": 2}
    for change, message in [({"tp": 3}, "--tp 3 must divide the world size 4"),
                            ({"ep": 4}, "--tp 2 x --ep 4 = 8 must divide the world size 4"),
                            ({"experts": 3, "ep": 2}, "--experts 3 must be divisible by --ep 2"),
                            ({"seq": 60}, "--seq 60 must be divisible by 2 x world size = 8"),
                            ({"team_size": 3}, "--wallfacer-team-size 3: C² must divide")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_layout(**{**ok, **change})
    check_layout(**ok)
