"""The command lines the documentation prints, read as text: README.md and the docstrings of the code.

Where a command is found (a *printed* command, :class:`Printed`):

- README.md: every logical line of an indented (4-space) code block or of a fenced block (```bash,
  ```sh, ```console or no language) whose first word, after any ``NAME=value`` prefixes, is a program
  (:data:`PROGRAMS`, or a ``*.py`` script with arguments after it: a file name alone is a mention); the
  other lines of those blocks are output, JSON or Python; fences of another language are code. Every
  `single-backtick` span outside the fences that starts with a program.
- the docstrings (module, class and function) of benchmarks/, megatron_patches/, launch/, examples/,
  ds_plugins/ and commweave/: every line of an indented block (past the docstring's own margin) whose
  first line starts with a program (the usage lines; a block that starts otherwise is a table or a
  paragraph), and every ``double-backtick`` span that starts with one.

Block lines are whole commands (``whole``); a span may instead refer to a program's options in prose
(`deepspeed-atlas --no_ssh`), which the checks allow for (tests/argv_check.py). ``readme(flags=True)``
gives instead the README's spans in prose that start with an option (`--atlas-sharing temporal`). A
logical line is a physical line less a trailing `` # comment``, joined to the next while it ends in
``\\``.

How a line printed for people becomes the argument vectors a program receives (:func:`argvs`): shell
quoting as ``shlex`` reads it; ``&&``, ``||`` and ``;`` separate commands, each checked on its own. The
usage notation on top of that:

- ``[...]`` is optional: one vector leaves every optional part out, the others put all of them in;
- ``X | Y`` is a choice: inside brackets between the bracket's parts, outside them Y replaces the option
  (with its values) just before the bar; ``a|b|c`` inside one word chooses among values. There is a
  vector for every combination of choices (with the optional parts in);
- a *placeholder* stands for a value the user supplies: ``...``, a ``<...>`` span, or a word without
  lower-case letters that starts with a capital (``FILE``, ``N``, ``A:B=FILE``), optionally with a
  file extension (``P.json``, ``RUN1.json``). A bracket part or choice that begins with a lower-case
  word (``[script arguments]``, ``spec flags``) is prose for arguments not spelled out: a placeholder
  too. The checks (tests/argv_check.py) replace a placeholder in an option's value by a valid value
  of that option; elsewhere ``...`` and ``<...>`` are dropped and a placeholder word stays as it is
  (a positional argument's value: ``TOPOLOGY``). ``<...>`` inside a word (``configs/atlas_<name>.json``)
  is a file-name pattern.
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import re
import shlex
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRAMS = {"python", "python3", "deepspeed", "deepspeed-atlas", "torchrun", "flock", "pip", "pip3", "pytest",
            "git", "bash"}
CODE_PACKAGES = ("benchmarks", "megatron_patches", "launch", "examples", "ds_plugins", "commweave")
SEPARATORS = {"&&", "||", ";"}
ELIDED = "..."
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_:=]*(\.[a-z]+)?")
_ANGLE = re.compile(r"<[^<>`]*>")
_FENCE = re.compile(r"^\s*```\s*(\w*)")
_SHELL_FENCES = {"", "bash", "sh", "console", "shell"}


@dataclass(frozen=True)
class Printed:
    where: str    # "README.md:471"
    text: str     # the logical line: comments dropped, continuations joined
    whole: bool   # a usage line of a block, not a span in prose


def is_placeholder(word: str) -> bool:
    """``...``, ``<...>``, or a word without lower-case letters that starts with a capital (an extension
    such as ``.json`` allowed): what the user fills in."""
    return word == ELIDED or bool(_ANGLE.fullmatch(word)) or bool(_PLACEHOLDER.fullmatch(word))


def starts_with_program(text: str) -> bool:
    words = text.split()
    while words and _ENV.match(words[0]):
        words = words[1:]
    return bool(words) and (words[0] in PROGRAMS or (words[0].endswith(".py") and len(words) > 1))


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, text) of each logical line: a trailing `` # comment`` dropped (a line that is only
    a comment is empty), a trailing backslash joining the next line."""
    out: list[tuple[int, str]] = []
    start, parts = None, []
    for number, line in lines:
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if start is None:
            start = number
        parts.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            out.append((start, " ".join(p for p in parts if p)))
            start, parts = None, []
    if parts:
        out.append((start, " ".join(p for p in parts if p)))
    return out


def _spans(text: str, tick: str) -> list[tuple[int, str]]:
    """(offset, content) of every inline code span delimited by ``tick`` (` or ``)."""
    pattern = re.escape(tick) + r"([^`]+?)" + re.escape(tick)
    if tick == "`":
        pattern = r"(?<!`)`([^`]+)`(?!`)"
    return [(m.start(), m.group(1).strip()) for m in re.finditer(pattern, text)]


def readme(path: pathlib.Path = ROOT / "README.md", flags: bool = False) -> list[Printed]:
    """The commands README.md prints, in order (see the module docstring); ``flags``: instead its spans
    in prose that start with an option (`--atlas-sharing temporal`)."""
    lines = path.read_text().splitlines()
    out: list[Printed] = []
    fence, block, prose = None, [], []

    def flush() -> None:
        for number, text in logical_lines(block):
            if starts_with_program(text):
                out.append(Printed(f"{path.name}:{number}", text, True))
        block.clear()

    for number, line in enumerate(lines, 1):
        opened = _FENCE.match(line)
        if fence is not None:
            if opened and not opened.group(1):
                fence = None
                flush()
            elif fence in _SHELL_FENCES:
                block.append((number, line))
            continue
        if opened:
            flush()
            fence = opened.group(1)
        elif line.startswith("    ") and (block or number == 1 or not lines[number - 2].strip()):
            block.append((number, line))
        else:
            flush()
            prose.append((number, line))
    flush()
    if flags:
        out = []
    keep = (lambda span: span.startswith("--")) if flags else starts_with_program
    for paragraph in _blocks(prose):   # a span may go on over a line break
        out += _prose_commands(path.name, paragraph[0][0], "\n".join(x for _, x in paragraph), "`", keep)
    return sorted(out, key=lambda p: int(p.where.rpartition(":")[2]))


def _prose_commands(name: str, first_line: int, text: str, tick: str,
                    keep=starts_with_program) -> list[Printed]:
    """The spans of ``text`` (its first line is ``first_line`` of file ``name``) that ``keep`` keeps
    (those that start with a program), each on one line."""
    return [Printed(f"{name}:{first_line + text.count(chr(10), 0, offset)}", " ".join(span.split()), False)
            for offset, span in _spans(text, tick) if keep(span)]


def _docstring_commands(rel: str, first_line: int, doc: str) -> list[Printed]:
    lines = doc.splitlines()
    margin = min((len(x) - len(x.lstrip()) for x in lines[1:] if x.strip()), default=0)
    body = [(first_line + i, x if i == 0 else x[margin:]) for i, x in enumerate(lines)]
    out: list[Printed] = []
    for block in _blocks([(n, x) for n, x in body if x.startswith("    ")]):
        commands = logical_lines(block)
        if starts_with_program(commands[0][1]):   # else a table or an indented paragraph
            out += [Printed(f"{rel}:{n}", text, True) for n, text in commands if starts_with_program(text)]
    return out + _prose_commands(rel, first_line, "\n".join(x for _, x in body), "``")


def _blocks(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Runs of consecutive line numbers."""
    out: list[list[tuple[int, str]]] = []
    for number, line in lines:
        if not out or out[-1][-1][0] != number - 1:
            out.append([])
        out[-1].append((number, line))
    return out


def docstrings(root: pathlib.Path = ROOT, packages=CODE_PACKAGES) -> list[Printed]:
    """The commands the docstrings of ``packages`` print (see the module docstring)."""
    out: list[Printed] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                        and node.body and isinstance(node.body[0], ast.Expr) \
                        and isinstance(node.body[0].value, ast.Constant) \
                        and isinstance(node.body[0].value.value, str):
                    out += _docstring_commands(rel, node.body[0].lineno, node.body[0].value.value)
    return out


def _words(text: str) -> list[str]:
    """Shell words; a ``<...>`` span becomes one word ``<...>`` (its text may hold quotes and spaces),
    inside a word as well."""
    return shlex.split(_ANGLE.sub(lambda m: "<" + re.sub(r"\W", "_", m.group(0)[1:-1]) + ">", text))


def _choices(items: list) -> list[list]:
    """Split at '|' words."""
    out: list[list] = [[]]
    for x in items:
        if x == "|":
            out.append([])
        else:
            out[-1].append(x)
    return out


def _prose(items: list) -> list:
    """A part that starts with a lower-case word is prose for arguments not spelled out."""
    return [ELIDED] if items and isinstance(items[0], str) and items[0][:1].islower() else items


def _grouped(words: list[str]) -> list:
    """The words, each ``[...]`` part made one item: the list of its choices (lists of words)."""
    out: list = []
    i = 0
    while i < len(words):
        if not words[i].startswith("["):
            out.append(words[i])
            i += 1
            continue
        j = next(k for k in range(i, len(words)) if words[k].endswith("]"))
        inner = words[i:j + 1]
        inner[0] = inner[0][1:]
        inner[-1] = inner[-1][:-1]
        out.append(_choices([w for w in inner if w]))
        i = j + 1
    return out


def _values(word: str) -> list[str]:
    """``a|b|c`` inside one word: its values; any other word: itself."""
    return word.split("|") if "|" in word.strip("|") else [word]


def _expand(words: list[str]) -> list[list[str]]:
    """Every vector of one simple command's notation (the module docstring): each top-level choice;
    within it the optional parts all out, then all in with each combination of their choices; then
    each combination of the values chosen inside words."""
    top = _choices(_grouped(words))
    first = top[0]
    start = max((i for i, x in enumerate(first) if isinstance(x, str) and x.startswith("-")), default=0)
    out: list[list[str]] = []
    for items in [first] + [first[:start] + _prose(alt) for alt in top[1:]]:
        groups = [x for x in items if isinstance(x, list)]
        picks = ([None] if groups else []) + list(itertools.product(*groups))
        for pick in picks:
            chosen = iter(pick or ())
            flat = [w for x in items if pick is not None or isinstance(x, str)
                    for w in (_prose(next(chosen)) if isinstance(x, list) else [x])]
            out += [list(v) for v in itertools.product(*map(_values, flat))]
    return out


def argvs(text: str) -> list[list[str]]:
    """The argument vectors a printed line stands for: every simple command of it (split at ``&&``,
    ``||``, ``;``) in every variant of its notation (the module docstring), duplicates dropped."""
    simple: list[list[str]] = [[]]
    for w in _words(text):
        if w in SEPARATORS:
            simple.append([])
        else:
            simple[-1].append(w)
    out: list[list[str]] = []
    for words in filter(None, simple):
        out += [v for v in _expand(words) if v not in out]
    return out


def strip_prefixes(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The ``NAME=value`` assignments in front of a command, and the command without them and without
    ``flock [options] LOCKFILE`` (which runs the rest under a lock)."""
    env: dict[str, str] = {}
    while argv and _ENV.match(argv[0]):
        name, _, value = argv[0].partition("=")
        env[name], argv = value, argv[1:]
    if argv[:1] == ["flock"]:
        rest = argv[1:]
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        inner, argv = strip_prefixes(rest[1:])
        env |= inner
    return env, argv
