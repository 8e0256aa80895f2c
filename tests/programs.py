"""Which program a command runs, and what is checked there (tests/test_readme_commands.py).

Each argument vector of a printed command (tests/doc_commands.py) goes to the program that would
receive it, entered as the command enters it (``runpy`` for ``python -m MOD`` and for scripts, setup.py's
``console_scripts`` entry for ``deepspeed-atlas``), its arguments parsed by tests/argv_check.py:

- ``python -m MOD``, MOD of this repository: the module exists and its own parser accepts the
  arguments; where the argument checks that follow parsing are a function of their own
  (:data:`VALIDATORS`, by the parser's ``prog``), that runs too;
- ``deepspeed [its options] SCRIPT args``: DeepSpeed's runner parser splits the line; a script of the
  repository gets ``--local_rank=0`` then its arguments, as DeepSpeed's launcher passes them;
- ``deepspeed-atlas``: setup.py's entry point, then the script as above; ``torchrun``: torch's own
  parser, then the module or script;
- Megatron-LM (``pretrain_gpt.py``, ``-m megatron_patches.megatron_lm``): the ``--wallfacer-*`` and
  ``--commweave-*`` flags against ``megatron_patches.add_wallfacer_args`` on a stand-in of Megatron's
  parser (only the arguments WallFacer reads), then ``WallFacerConfig.from_args`` where the command
  states the model (``--num-attention-heads``), else the config built from the flags; ``--spec MOD
  NAME`` names what MOD defines;
- other tools only for their part in this repository: pip's extras are setup.py's, pytest's paths
  exist and its ``-m`` markers are registered, a ``bash`` script exists and knows each ``--flag``;
- every word that is a path into the repository (``configs/...``, ``examples/...``) exists, and every
  ``COMMWEAVE_*`` variable set in front of a command is read somewhere in the code.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib
import importlib.util
import pathlib
import re
import runpy
import tomllib

from tests import doc_commands as docs
from tests.argv_check import Parsed, Refused, enter, fill, reference, refusing

ROOT = docs.ROOT
OURS = ("benchmarks", "megatron_patches", "launch", "examples", "commweave", "ds_plugins", "tests")
# the values WallFacerConfig.from_args reads from Megatron-LM's parser, with Megatron-LM's defaults
MEGATRON_STANDIN = {
    "--context-parallel-size": {"type": int, "default": 1}, "--seq-length": {"type": int},
    "--num-attention-heads": {"type": int}, "--num-query-groups": {"type": int},
    "--tensor-model-parallel-size": {"type": int, "default": 1},
    "--attention-dropout": {"type": float, "default": 0.1}, "--cp-comm-type": {"nargs": "+"},
    "--recompute-granularity": {}, "--recompute-modules": {"nargs": "*"}, "--spec": {"nargs": "*"},
}


def _validate_calibrate(parsed: Parsed) -> None:
    from megatron_patches.calibrate import config

    config(parsed.args)


def _validate_train_gpt(parsed: Parsed) -> None:
    from examples.train_gpt import parse

    parse(parsed.args)


def _validate_atlas(parsed: Parsed) -> None:
    from launch.run.runner import _check_arguments

    _check_arguments(parsed.namespace)


# the checks that follow a program's parse_args and are a function of their own, by the parser's prog
VALIDATORS = {"python -m megatron_patches.estimate --calibrate": _validate_calibrate,
              "train_gpt.py": _validate_train_gpt, "deepspeed-atlas": _validate_atlas}


def program(run, argv0: str, args: list[str], whole: bool) -> Parsed | None:
    """Parse (then validate) one program's arguments; a span falls back to :func:`reference`."""
    parsed, refused, seen = enter(run, argv0, args)
    if refused is not None:
        if whole or not seen:
            raise refused
        reference(*seen[-1])
        return None
    with refusing():
        check = VALIDATORS.get(parsed.parser.prog)
        try:
            if check:
                check(parsed)
        except (ValueError, SystemExit) as e:
            raise Refused(f"{parsed.parser.prog}: {e}") from None
    ns = parsed.namespace
    if hasattr(ns, "user_script"):   # a launcher (DeepSpeed's runner, deepspeed-atlas): on to the script
        script(ns.user_script, ["--local_rank=0", *ns.user_args], whole)
    return parsed


def repo_path(word: str) -> str:
    """A word that is a path into the repository, made concrete (a ``<...>`` part: the first file that
    matches); Refused if nothing is there."""
    found = sorted(glob.glob(str(ROOT / re.sub(r"<[^<>]*>", "*", word))))
    if not found:
        raise Refused(f"{word}: no such file in the repository")
    return str(found[0])


def _ours(word: str) -> bool:
    return word.split("/", 1)[0] in {*OURS, "configs", "csrc"} and "/" in word


def _module_run(name: str):
    return lambda: runpy.run_module(name, run_name="__main__", alter_sys=True)


def _script_run(path: str):
    return lambda: runpy.run_path(repo_path(path), run_name="__main__")


def _deepspeed_run():
    from deepspeed.launcher import runner

    return lambda: runner.parse_args()


def _atlas_run():
    mod, _, func = console_script("deepspeed-atlas").partition(":")
    return lambda: getattr(importlib.import_module(mod), func)()


def _torchrun_run():
    from torch.distributed.run import get_args_parser

    return lambda: get_args_parser().parse_args()


LAUNCHERS = {"deepspeed": _deepspeed_run, "deepspeed-atlas": _atlas_run, "torchrun": _torchrun_run}
MEGATRON_LM = "megatron_patches.megatron_lm"   # its arguments are Megatron-LM's


def module(name: str, args: list[str], whole: bool) -> None:
    """``python -m name args``."""
    if importlib.util.find_spec(name) is None:
        raise Refused(f"python -m {name}: no such module")
    if name == MEGATRON_LM:
        return megatron(args)
    program(_module_run(name), name, args, whole)


def script(path: str, args: list[str], whole: bool) -> None:
    """A script run with ``args``: one of the repository's, Megatron-LM's pretrain_gpt.py, or the user's
    own (nothing to check)."""
    if path.endswith("pretrain_gpt.py") and not _ours(path):
        return megatron(args)
    if not _ours(path):
        return      # the user's own script
    program(_script_run(path), path, args, whole)


def megatron_parser() -> argparse.ArgumentParser:
    """A stand-in of Megatron-LM's parser: :data:`MEGATRON_STANDIN` and ``add_wallfacer_args``."""
    from megatron_patches import add_wallfacer_args

    parser = argparse.ArgumentParser(prog="megatron", allow_abbrev=False)
    for flag, kwargs in MEGATRON_STANDIN.items():
        parser.add_argument(flag, **kwargs)
    return add_wallfacer_args(parser)


def megatron(args: list[str]) -> None:
    """Megatron-LM's arguments, as far as WallFacer's part of them goes (the module docstring)."""
    from megatron_patches.args import WallFacerConfig

    parser = megatron_parser()
    with refusing():
        ns, rest = parser.parse_known_args(fill(parser, args))
        ours = [w for w in rest if w.startswith(("--wallfacer", "--commweave"))]
        if ours:
            raise Refused(f"megatron_patches.add_wallfacer_args: no option {ours}")
        if ns.spec:
            _spec(*ns.spec)
        try:
            if ns.num_attention_heads is not None:
                WallFacerConfig.from_args(ns)
            else:
                WallFacerConfig(team_size=ns.wallfacer_team_size, ulysses_size=ns.wallfacer_ulysses_size,
                                context_parallel_size=ns.context_parallel_size)
        except ValueError as e:
            raise Refused(f"WallFacer: {e}") from None


def _spec(name: str, attr: str) -> None:
    """``--spec MOD NAME``: MOD is a module here that defines NAME at its top level (read, not imported:
    Megatron-LM imports it)."""
    found = importlib.util.find_spec(name)
    if found is None or not found.origin:
        raise Refused(f"--spec {name} {attr}: no such module")
    names = set()
    for node in ast.parse(pathlib.Path(found.origin).read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if attr not in names:
        raise Refused(f"--spec {name} {attr}: no such attribute")


def deepspeed(args: list[str], whole: bool) -> None:
    program(_deepspeed_run(), "deepspeed", args, whole)


def console_script(name: str) -> str:
    """setup.py's ``console_scripts`` entry for ``name``: ``module:function``."""
    for entry in re.findall(r"['\"]([\w-]+\s*=\s*[\w.]+:\w+)['\"]", (ROOT / "setup.py").read_text()):
        key, _, target = entry.partition("=")
        if key.strip() == name:
            return target.strip()
    raise Refused(f"{name}: not a console script of setup.py")


def atlas(args: list[str], whole: bool) -> None:
    program(_atlas_run(), "deepspeed-atlas", args, whole)


def torchrun(args: list[str], whole: bool) -> None:
    parsed = program(_torchrun_run(), "torchrun", args, whole)
    if parsed is not None:
        ns = parsed.namespace
        (module if ns.module else script)(ns.training_script, ns.training_script_args, whole)


def pip(args: list[str]) -> None:
    """``pip install``: the extras asked of this project are setup.py's."""
    extras = {key.value for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
              if isinstance(node, ast.keyword) and node.arg == "extras_require" for key in node.value.keys}
    for word in args[1:]:
        target, _, wanted = word.partition("[")
        if target in (".", "commweave") and wanted:
            missing = set(wanted.rstrip("]").split(",")) - set(extras)
            if missing:
                raise Refused(f"pip install {word}: setup.py has no extra {sorted(missing)}")


def pytest_command(args: list[str]) -> None:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = {m.split("(")[0].split(":")[0] for m in ini["markers"]}
    words = iter(args)
    for word in words:
        if word in ("-m", "-k"):   # a marker or keyword expression
            value = next(words, "")
            unknown = set(re.findall(r"\w+", value)) - markers - {"and", "or", "not"}
            if word == "-m" and unknown:
                raise Refused(f"pytest -m {value}: markers {sorted(unknown)} are not registered")
        elif not word.startswith("-"):   # a test path
            repo_path(word)


def bash(args: list[str]) -> None:
    """A shell script of the repository: it exists, and each ``--flag`` given occurs in its text."""
    text = pathlib.Path(repo_path(args[0])).read_text()
    for flag in (w for w in args[1:] if w.startswith("--")):
        if flag not in text:
            raise Refused(f"bash {args[0]}: the script does not know {flag}")


_SOURCE: list[str] = []


def _environment(env: dict[str, str]) -> None:
    """Each ``COMMWEAVE_*`` variable set in front of a command is named (quoted) in the code."""
    if not _SOURCE:
        _SOURCE.append("\n".join(p.read_text() for pkg in OURS for p in (ROOT / pkg).rglob("*.py")))
    for name in env:
        if name.startswith("COMMWEAVE_") and f'"{name}"' not in _SOURCE[0]:
            raise Refused(f"{name}: no code reads this variable")


def check(argv: list[str], whole: bool = True) -> None:
    """One argument vector, from its first word (see the module docstring); Refused if it fails."""
    env, argv = docs.strip_prefixes(argv)
    _environment(env)
    for word in argv[1:]:
        if _ours(word.partition("=")[2] or word):
            repo_path(word.partition("=")[2] or word)
    first, rest = argv[0], argv[1:]
    if first in ("python", "python3") and rest[:1] == ["-m"]:
        name, rest = rest[1], rest[2:]
        if name.split(".")[0] in OURS:
            module(name, rest, whole)
        elif name == "pytest":
            pytest_command(rest)
        elif name == "pip":
            pip(rest)
    elif first in ("python", "python3"):
        script(rest[0], rest[1:], whole)
    elif first == "deepspeed":
        deepspeed(rest, whole)
    elif first == "deepspeed-atlas":
        atlas(rest, whole)
    elif first == "torchrun":
        torchrun(rest, whole)
    elif first in ("pip", "pip3"):
        pip(rest)
    elif first == "pytest":
        pytest_command(rest)
    elif first == "bash":
        bash(rest)
    elif first.endswith(".py"):
        script(first, rest, whole)


def programs(argv: list[str]) -> list[tuple[str, str]]:
    """The programs of this repository (and the launchers) a vector runs: ("module", MOD), ("script",
    PATH), ("launcher", NAME)."""
    _, argv = docs.strip_prefixes(argv)
    out = []
    if argv[0] in ("python", "python3") and argv[1:2] == ["-m"] and argv[2].split(".")[0] in OURS \
            and argv[2] != MEGATRON_LM and importlib.util.find_spec(argv[2]) is not None:
        out.append(("module", argv[2]))
    if argv[0] in LAUNCHERS:
        out.append(("launcher", argv[0]))
    run = None   # the script: the first word, or the first .py word after python or a launcher
    if argv[0].endswith(".py"):
        run = argv[0]
    elif argv[0] in ("python", "python3", *LAUNCHERS) and argv[1:2] != ["-m"]:
        run = next((w for w in argv[1:] if w.endswith(".py")), None)
    return out + [("script", run)] * bool(run and _ours(run))


def parsers(kind: str, target: str) -> list[argparse.ArgumentParser]:
    """The parsers a program of :func:`programs` reaches when entered with no arguments."""
    run = {"module": _module_run, "script": _script_run, "launcher": lambda name: LAUNCHERS[name]()}
    return [parser for parser, _ in enter(run[kind](target), target, [])[2]]
