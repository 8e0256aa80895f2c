"""Parsing a program's arguments in this process, without running the program.

argparse is patched (:func:`intercepted`) so that a program's parser, once it accepts the arguments,
raises :class:`Parsed` instead of returning, and ``parser.error`` raises :class:`Refused` instead of
exiting (:func:`refusing`); :func:`enter` runs a program's entry until one or the other. Before the
parser sees them, placeholders (tests/doc_commands.py) in an option's value become a valid value of
that option (:func:`fill`: its first choice, else its default, else the placeholder's own text, else
1: the first its type accepts); elsewhere ``...`` and ``<...>`` are dropped and a placeholder word
stays (a positional argument's value).

A span in prose may name a program's options without its required arguments (`deepspeed-atlas
--no_ssh`): :func:`reference` accepts it if every option it names is one of the parser's, every value
it gives is one the option accepts, and a word that is no option's value has a positional argument to
go to.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys

import pytest

from tests import doc_commands as docs

_ORIGINAL = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args")}

class Parsed(BaseException):
    """A program's parser accepted ``args`` (as filled in) into ``namespace``. Both exceptions here are
    BaseExceptions, so that no ``except Exception`` in a program can swallow them and run on."""

    def __init__(self, parser, args, namespace):
        super().__init__(parser.prog)
        self.parser, self.args, self.namespace = parser, args, namespace


class Refused(BaseException):
    """A program (its parser, or a check of its arguments) refused the command."""

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


def reference(parser: argparse.ArgumentParser, args: list[str], positionals: bool = True) -> None:
    """A span's options: each is one of the parser's, each value given is accepted, and (``positionals``)
    a word that is no option's value needs a positional argument to take it (Refused if not)."""
    positional = not positionals or any(not a.option_strings for a in parser._actions)
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
