"""One argument vector of a printed command, checked in the program that would receive it.

The vectors come from tests/doc_commands.py (which reads the notation: placeholders, ``[...]``, ``|``).
Each is checked in this process, without running anything: argparse is patched so that a
program's parser, once it accepts the arguments, raises :class:`Parsed` instead of returning, and
``parser.error`` raises :class:`Refused` instead of exiting; the program is then entered exactly as the
command enters it (``runpy`` for ``python -m MOD`` and for scripts, the ``console_scripts`` entry of
setup.py for ``deepspeed-atlas``). Before the parser sees them, placeholders in an option's value become
a valid value of that option (its first choice, else its default, else the placeholder's own text,
else 1: the first its type accepts); elsewhere ``...`` and ``<...>`` are dropped and a placeholder
word stays (a positional argument's value).

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

A span in prose (not a usage line) may name a program's options without its required arguments
(`deepspeed-atlas --no_ssh`): where the full parse refuses it, it passes if every option it names is
one of the program's, every value it gives is one the option accepts, and a word that is no option's
value has a positional argument to go to.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import importlib
import importlib.util
import pathlib
import re
import runpy
import sys
import tomllib

import pytest

from tests import doc_commands as docs

ROOT = docs.ROOT
OURS = ("benchmarks", "megatron_patches", "launch", "examples", "commweave", "ds_plugins", "tests")
_ORIGINAL = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args")}
# the values WallFacerConfig.from_args reads from Megatron-LM's parser, with Megatron-LM's defaults
MEGATRON_STANDIN = {
    "--context-parallel-size": {"type": int, "default": 1}, "--seq-length": {"type": int},
    "--num-attention-heads": {"type": int}, "--num-query-groups": {"type": int},
    "--tensor-model-parallel-size": {"type": int, "default": 1},
    "--attention-dropout": {"type": float, "default": 0.1}, "--cp-comm-type": {"nargs": "+"},
    "--recompute-granularity": {}, "--recompute-modules": {"nargs": "*"}, "--spec": {"nargs": "*"},
}


class Parsed(Exception):
    """A program's parser accepted ``args`` (as filled in) into ``namespace``."""

    def __init__(self, parser, args, namespace):
        super().__init__(parser.prog)
        self.parser, self.args, self.namespace = parser, args, namespace


class Refused(Exception):
    """A program (its parser, or a check of its arguments) refused the command."""


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


def _arity(action: argparse.Action) -> int:
    """How many placeholders after this option are its values: fixed counts only (a variable count
    hands its words on to another program, untouched)."""
    if action.nargs is None or action.nargs == "?":
        return 1
    return action.nargs if isinstance(action.nargs, int) else 0


def _value(parser, action, word: str) -> str:
    scalar = action.default if isinstance(action.default, str | int | float) and \
        not isinstance(action.default, bool) and action.default != argparse.SUPPRESS else None
    for candidate in [*(action.choices or [])[:1], scalar, word, "1"]:
        if candidate is None:
            continue
        with contextlib.suppress(argparse.ArgumentError, TypeError, ValueError):
            parser._check_value(action, parser._get_value(action, str(candidate)))
            return str(candidate)
    return word


def fill(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with every placeholder in an option's value replaced by a valid value of that option,
    and the other ``...`` / ``<...>`` words dropped; a word naming a subcommand switches to its parser."""
    out, action, need = [], None, 0
    for word in args:
        known = parser._option_string_actions.get(word.split("=", 1)[0]) if word.startswith("-") else None
        if known is not None:
            action, need = known, 0 if "=" in word else _arity(known)
            out.append(word)
        elif need and docs.is_placeholder(word):
            out.append(_value(parser, action, word))
            need -= 1
        elif word == docs.ELIDED or re.fullmatch(r"<[^<>]*>", word):
            continue
        else:
            need = max(0, need - 1)
            for sub in parser._actions:
                if isinstance(sub, argparse._SubParsersAction) and word in sub.choices:
                    parser = sub.choices[word]
            out.append(word)
    return out


@contextlib.contextmanager
def refusing():
    """``parser.error`` raises :class:`Refused` (with the message) instead of exiting."""
    def error(self, message):
        raise Refused(f"{self.prog}: {message}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "error", error)
        mp.setattr(sys, "path", list(sys.path))
        mp.setattr(sys, "argv", list(sys.argv))
        yield mp


@contextlib.contextmanager
def intercepted():
    """Inside: the outermost parse of a program fills its placeholders, parses, and raises Parsed; each
    parser it reached, with the arguments it was given, is appended to the yielded list."""
    seen: list[tuple[argparse.ArgumentParser, list[str]]] = []
    inside = [False]

    def wrap(name):
        def parse(self, args=None, namespace=None):
            if inside[0]:
                return _ORIGINAL[name](self, args, namespace)
            args = list(sys.argv[1:] if args is None else args)
            seen.append((self, args))
            args = fill(self, args)
            inside[0] = True
            try:
                result = _ORIGINAL[name](self, args, namespace)
            finally:
                inside[0] = False
            raise Parsed(self, args, result[0] if name == "parse_known_args" else result)
        return parse

    with refusing() as mp:
        for name in _ORIGINAL:
            mp.setattr(argparse.ArgumentParser, name, wrap(name))
        yield seen


def enter(run, argv0: str, args: list[str]):
    """Run ``run()`` with ``sys.argv = [argv0, *args]`` until a parser accepts or refuses: (Parsed or
    None, Refused or None, the parsers reached with the arguments each was given)."""
    with intercepted() as seen:
        sys.argv = [argv0, *args]
        try:
            run()
        except Parsed as p:
            return p, None, seen
        except Refused as r:
            return None, r, seen
    raise AssertionError(f"{argv0} {' '.join(args)}: finished without parsing its arguments")


def reference(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """A span's options: each is one of the parser's, each value given is accepted, and a word that is
    no option's value needs a positional argument to take it (Refused if not)."""
    positional = any(not a.option_strings for a in parser._actions)
    action, need = None, 0
    for word in args:
        if word.startswith("-") and word != "--" and not re.fullmatch(r"-[\d.]+", word):
            flag, _, value = word.partition("=")
            action = parser._option_string_actions.get(flag)
            if action is None:
                raise Refused(f"{parser.prog}: no option {flag}")
            need = _arity(action)
            words = [value] if value else []
        elif need:
            words, need = [word], need - 1
        elif positional or word in ("--", docs.ELIDED) or re.fullmatch(r"<[^<>]*>", word):
            continue
        else:
            raise Refused(f"{parser.prog}: takes no positional argument ({word})")
        for w in words:
            if not docs.is_placeholder(w):
                try:
                    parser._check_value(action, parser._get_value(action, w))
                except argparse.ArgumentError as e:
                    raise Refused(f"{parser.prog}: {e}") from None


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


def module(name: str, args: list[str], whole: bool) -> None:
    if importlib.util.find_spec(name) is None:
        raise Refused(f"python -m {name}: no such module")
    if name == "megatron_patches.megatron_lm":
        return megatron(args)
    program(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True), name, args, whole)


def script(path: str, args: list[str], whole: bool) -> None:
    if path.endswith("pretrain_gpt.py") and not _ours(path):
        return megatron(args)
    if not _ours(path):
        return      # the user's own script
    program(lambda: runpy.run_path(repo_path(path), run_name="__main__"), path, args, whole)


def megatron(args: list[str]) -> None:
    from megatron_patches import add_wallfacer_args
    from megatron_patches.args import WallFacerConfig

    parser = argparse.ArgumentParser(prog="megatron", allow_abbrev=False)
    for flag, kwargs in MEGATRON_STANDIN.items():
        parser.add_argument(flag, **kwargs)
    add_wallfacer_args(parser)
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
    from deepspeed.launcher import runner

    program(lambda: runner.parse_args(), "deepspeed", args, whole)


def console_script(name: str) -> str:
    """setup.py's ``console_scripts`` entry for ``name``: ``module:function``."""
    for entry in re.findall(r"['\"]([\w-]+\s*=\s*[\w.]+:\w+)['\"]", (ROOT / "setup.py").read_text()):
        key, _, target = entry.partition("=")
        if key.strip() == name:
            return target.strip()
    raise Refused(f"{name}: not a console script of setup.py")


def atlas(args: list[str], whole: bool) -> None:
    mod, _, func = console_script("deepspeed-atlas").partition(":")
    program(lambda: getattr(importlib.import_module(mod), func)(), "deepspeed-atlas", args, whole)


def torchrun(args: list[str], whole: bool) -> None:
    from torch.distributed.run import get_args_parser

    parsed = program(lambda: get_args_parser().parse_args(), "torchrun", args, whole)
    if parsed is not None:
        ns = parsed.namespace
        (module if ns.module else script)(ns.training_script, ns.training_script_args, whole)


def pip(args: list[str]) -> None:
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
        if word in ("-m", "-k"):
            value = next(words, "")
            unknown = set(re.findall(r"\w+", value)) - markers - {"and", "or", "not"}
            if word == "-m" and unknown:
                raise Refused(f"pytest -m {value}: markers {sorted(unknown)} are not registered")
        elif not word.startswith("-"):
            repo_path(word)


def bash(args: list[str]) -> None:
    text = pathlib.Path(repo_path(args[0])).read_text()
    for flag in (w for w in args[1:] if w.startswith("--")):
        if flag not in text:
            raise Refused(f"bash {args[0]}: the script does not know {flag}")


_SOURCE: list[str] = []


def _environment(env: dict[str, str]) -> None:
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
