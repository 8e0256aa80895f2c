"""Every command README.md and the docstrings print still parses, in the program that would receive it.

A renamed or removed flag leaves the README lying; nothing else would notice. The commands are read by
tests/doc_commands.py and each of their argument vectors is checked by tests/programs.py, in this
process and without running anything. The other tests here show that the same machinery refuses what
is wrong (a bad flag, value, path, marker or variable, a failed range check) and that the reading finds
every ``python -m`` of the README.
"""

from __future__ import annotations

import argparse
import re

import pytest

from tests import doc_commands as docs
from tests.argv_check import Refused, fill, reference
from tests.programs import check, megatron_parser, parsers, programs


def _printed() -> dict[tuple[str, bool], list[str]]:
    """Each distinct printed command (text, usage line or span) with the places that print it."""
    out: dict[tuple[str, bool], list[str]] = {}
    for p in docs.readme() + docs.docstrings():
        out.setdefault((p.text, p.whole), []).append(p.where)
    return out


PRINTED = _printed()
# runpy enters modules the checks imported before (each program's own parser, in this process)
pytestmark = pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")


def _params():
    for (text, whole), where in PRINTED.items():
        yield pytest.param(text, whole, id=where[0])


@pytest.mark.parametrize("text,whole", list(_params()))
def test_printed_command_parses(text, whole):
    failures = []
    for argv in docs.argvs(text):
        try:
            check(argv, whole)
        except Refused as e:
            failures.append(f"{' '.join(argv)}\n    {e}")
    assert not failures, f"printed at {', '.join(PRINTED[text, whole])}:\n" + "\n".join(failures)


def test_every_python_m_of_the_readme_is_checked():
    """The README's ``python -m`` of this repository's modules, counted in its text outside Python and
    JSON fences, all belong to printed commands."""
    text, fence = [], None
    for line in (docs.ROOT / "README.md").read_text().splitlines():
        opened = re.match(r"\s*```(\w*)", line)
        if opened:
            fence = None if fence is not None else opened.group(1)
        elif fence in (None, "bash"):
            text.append(line)
    mention = r"python3?\s+-m\s+(?:benchmarks|megatron_patches|launch|examples)\b"
    printed = [p for p in docs.readme() if re.search(mention, p.text)]
    assert len(re.findall(mention, "\n".join(text))) == sum(len(re.findall(mention, p.text)) for p in printed)
    assert len(PRINTED) > 100, "the reading found almost nothing"


# options of other programs that the README names in prose, not checkable here: Megatron-LM's (no
# checkout here; WallFacer's own are add_wallfacer_args'), pip's and Slurm srun's
EXTERNAL_FLAGS = {
    "--transformer-impl", "--qk-layernorm", "--num-experts", "--no-create-attention-mask-in-dataloader",
    "--reset-attention-mask", "--reset-position-ids", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--no-build-isolation", "--cpu-bind",
}


def _known_parsers() -> list[argparse.ArgumentParser]:
    """The parsers of every program the printed commands run (entered with no arguments), and WallFacer's
    Megatron-LM arguments."""
    ran = sorted({pt for text, _ in PRINTED for argv in docs.argvs(text) for pt in programs(argv)})
    return [megatron_parser(), *(parser for kind, target in ran for parser in parsers(kind, target))]


def _unknown(argv: list[str], known: list[argparse.ArgumentParser]) -> bool:
    """No parser of ``known`` has every option ``argv`` names and accepts its values (``--name-*``: some
    option starts with ``--name-``); the options of :data:`EXTERNAL_FLAGS` alone are not checked."""
    names = [w.split("=")[0] for w in argv if w.startswith("--")]
    if all(n in EXTERNAL_FLAGS for n in names):
        return False
    options = {o for parser in known for o in parser._option_string_actions}
    family = [n for n in names if n.endswith("*")]
    if family:
        return not all(any(o.startswith(n[:-1]) for o in options) for n in family)
    for parser in known:
        try:
            reference(parser, argv, positionals=False)
            return False
        except Refused:
            continue
    return True


def test_every_option_the_readme_names_is_one_of_its_programs():
    """A span in prose that starts with an option (`--atlas-sharing temporal`, `--wallfacer-*`) names
    options some program of the printed commands has, with values it accepts. Which program is the
    prose's to say; this catches an option renamed or removed everywhere."""
    known = _known_parsers()
    failures = [f"{span.where}: {' '.join(argv)}" for span in docs.readme(flags=True)
                for argv in docs.argvs(span.text) if _unknown(argv, known)]
    assert not failures, "options no program here has (or values it refuses):\n" + "\n".join(failures)
    probes = [["--no-such-option"], ["--hf-tiny", "falcon"], ["--wallfacer-nope-*"], ["--hf-tiny", "llama"]]
    assert [_unknown(argv, known) for argv in probes] == [True, True, True, False]


BAD = [
    ("python -m benchmarks.dispatch --no-such-flag", True, "unrecognized arguments"),
    ("python -m benchmarks.dispatch --device tpu", True, "invalid choice"),
    ("python -m benchmarks.no_such_module", True, "no such module"),
    ("python -m launch.net.wanemu forward --in-fd 3 --out-fd 4 --delay-ms 20 --queue-bytes many --stats F",
     True, "invalid int value"),
    # the checks after parse_args: examples/train_gpt.py's parse, calibrate.config, runner._check_arguments
    ("DS_ACCELERATOR=cpu deepspeed --num_gpus 4 examples/train_gpt.py --steps 0", True, "--steps 0 must be"),
    ("python -m megatron_patches.estimate --calibrate --ranks 0 --out p.json", True, "--ranks 0 must be"),
    ("deepspeed-atlas --atlas-topology configs/atlas_two_dc.json --master_port 0 train.py", True, "port"),
    ("deepspeed --num_gpus 4 examples/no_such_script.py", True, "no such file"),
    ("deepspeed-atlas --atlas-topology configs/atlas_two_dc.json examples/atlas_pipeline.py --stepz 3", True,
     "unrecognized arguments: --stepz"),
    ("torchrun --nproc-per-node 4 -m megatron_patches.megatron_lm --wallfacer-team-sise 2", True,
     "no option ['--wallfacer-team-sise']"),
    ("pretrain_gpt.py --context-parallel-size 8 --wallfacer-team-size 3", True, "C² must divide"),
    ("pretrain_gpt.py --num-attention-heads 4 --seq-length 64 --context-parallel-size 4 "
     "--attention-dropout 0.1", True, "--attention-dropout 0.1"),
    ("pretrain_gpt.py --spec megatron_patches.attention no_such_spec", True, "no such attribute"),
    ("deepspeed-atlas --no-ssh", False, "no option --no-ssh"),
    ("deepspeed-atlas --no_ssh", True, "required"),
    ("python -m benchmarks.wan --json FILE --connections", False, None),
    ("python -m megatron_patches.estimate --calibrate PROFILE.json", False, "takes no positional argument"),
    ("pip install -e '.[no_such_extra]'", True, "no extra"),
    ("python -m pytest -q -m no_such_marker tests", True, "not registered"),
    ("python -m pytest -q tests/no_such_test.py", True, "no such file"),
    ("bash benchmarks/gpu_check.sh --no-such-step", True, "does not know --no-such-step"),
    ("COMMWEAVE_NO_SUCH_VARIABLE=1 python -m pytest -q", True, "no code reads"),
]


@pytest.mark.parametrize("text,whole,message", BAD, ids=[b[0][:60] for b in BAD])
def test_a_wrong_command_is_refused(text, whole, message):
    """The same machinery refuses a wrong command, with the reason (None: a span's option without its
    value, which a span may leave out, is accepted)."""
    (argv,) = docs.argvs(text)
    if message is None:
        check(argv, whole)
        return
    with pytest.raises(Refused, match=re.escape(message)):
        check(argv, whole)


def test_placeholders_become_valid_values():
    """An option's placeholder takes its first choice, else its default, else its own text, else 1 (the
    first its type accepts); ``...`` and ``<...>`` outside values go; a positional placeholder stays."""
    p = argparse.ArgumentParser()
    p.add_argument("topology")
    p.add_argument("--mode", choices=("spatial", "temporal"))
    p.add_argument("--rounds", type=int, default=18)
    p.add_argument("--queue", type=int)
    p.add_argument("--out")
    p.add_argument("--pair", type=int, nargs=2)
    p.add_argument("--quick", action="store_true")
    argv = ["TOPOLOGY", "--mode", "MODE", "--rounds", "N", "--queue", "N", "--out", "DIR", "--pair", "S", "H",
            "--quick", "...", "<more>"]
    assert fill(p, argv) == ["TOPOLOGY", "--mode", "spatial", "--rounds", "18", "--queue", "1",
                             "--out", "DIR", "--pair", "1", "1", "--quick"]


def test_reading_the_notation():
    assert docs.argvs("X=1 flock /tmp/l python -m m [--a 1 | --b] --c x|y && pip install .  ") == [
        ["X=1", "flock", "/tmp/l", "python", "-m", "m", "--c", "x"],
        ["X=1", "flock", "/tmp/l", "python", "-m", "m", "--c", "y"],
        ["X=1", "flock", "/tmp/l", "python", "-m", "m", "--a", "1", "--c", "x"],
        ["X=1", "flock", "/tmp/l", "python", "-m", "m", "--a", "1", "--c", "y"],
        ["X=1", "flock", "/tmp/l", "python", "-m", "m", "--b", "--c", "x"],
        ["X=1", "flock", "/tmp/l", "python", "-m", "m", "--b", "--c", "y"],
        ["pip", "install", "."]]
    assert docs.argvs("prog --hf DIR | --hf-tiny llama|gpt2 ...") == [
        ["prog", "--hf", "DIR"], ["prog", "--hf-tiny", "llama", "..."], ["prog", "--hf-tiny", "gpt2", "..."]]
    assert docs.argvs("prog --x [--profile P | spec flags] [--quick] -- <the job's own arguments>") == [
        ["prog", "--x", "--", "<the_job_s_own_arguments>"],
        ["prog", "--x", "--profile", "P", "--quick", "--", "<the_job_s_own_arguments>"],
        ["prog", "--x", "...", "--quick", "--", "<the_job_s_own_arguments>"]]
    assert docs.strip_prefixes(["A=1", "flock", "-n", "/tmp/l", "B=2", "python", "-m", "m"]) == (
        {"A": "1", "B": "2"}, ["python", "-m", "m"])
    assert docs.logical_lines([(1, "a --b \\"), (2, "    --c 2   # a comment"), (3, "# only a comment")]) == [
        (1, "a --b --c 2"), (3, "")]
    words = ("FILE", "P.json", "A:B=FILE", "...", "<x>", "P", "x", "Fx", "20", "/path/to/X")
    assert [docs.is_placeholder(w) for w in words] == [True] * 6 + [False] * 4


def test_reading_a_readme(tmp_path):
    """Which lines of a README are commands: shell fences and indented blocks (not their output lines,
    not Python fences, not a lone file name), and spans in prose."""
    readme = tmp_path / "README.md"
    readme.write_text("Run `python -m launch.plan\n--link` or `examples/x.py`:\n\n"
                      "    python -m benchmarks.wan \\\n        --json FILE   # measure\n"
                      "      output line\n\n```python\npython -m not.this\n```\n\n"
                      "```bash\ndeepspeed-atlas --dry-run x.py\n# comment\n```\n")
    assert docs.readme(readme) == [
        docs.Printed("README.md:1", "python -m launch.plan --link", False),
        docs.Printed("README.md:4", "python -m benchmarks.wan --json FILE", True),
        docs.Printed("README.md:13", "deepspeed-atlas --dry-run x.py", True)]
