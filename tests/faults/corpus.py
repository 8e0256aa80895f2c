"""The faults corpus: hostile and extreme inputs kept as tests, each with the outcome it must show, counted
per class (issue 22, item 6).

A case is a test (or one parametrised instance) marked with the outcome it must show and the kind of
input it probes::

    @pytest.mark.fault("refused", kind="dispatch sizes")
    def test_num_experts_2_32(): ...

    pytestmark = pytest.mark.fault("harmless", kind="resume files")   # every test of a module

Outcomes (the good classes):

    refused     a clear error: a ValueError naming the argument, the value and the rule (on every rank,
                before any collective, for a distributed case); :func:`refused` checks it
    harmless    accepted, and the result is the oracle's (exactly, or within a stated rounding); or a
                fault (a dead rank) that becomes an error naming the operation instead of a hang
    refused or harmless
                a property-based test: every example is one or the other

A case that fails is counted in a bad class, from what it raised: :class:`WrongResult` (or any other
AssertionError: accepted and wrong), :class:`Obscure` (refused, but with some other exception or text),
:class:`Crash` (the process died: run such cases through :func:`isolated`), :class:`Hang` (a timeout:
``isolated``'s, or commweave.world's ``WorldTimeout``), :class:`FilesOutside` (:func:`no_files_outside`).
Anything else a failing case raises is counted as obscure. ``cases=N`` in the marker counts a test that
checks N cases in one call (the 4-rank tables of test_bad_input.py).

``python -m pytest -q tests/faults`` prints the table per kind and class at the end (tests/faults/
conftest.py); ``COMMWEAVE_FAULTS_JSON=path`` also writes it as JSON. To add cases: put the tests in
tests/faults/ (a module per surface: test_wallfacer_inputs.py, test_launch_inputs.py, ...), mark each with
its outcome and kind, check refusals with :func:`refused` and results against an oracle (a failed
comparison is a wrong result), and run whatever may crash or hang the process through :func:`isolated`.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("refused", "harmless", "refused or harmless")
BAD = ("wrong result", "obscure error", "crash", "hang", "files outside")


class WrongResult(AssertionError):
    """Accepted, and the result or behaviour differs from the oracle (a bad input accepted silently too)."""


class Obscure(AssertionError):
    """Refused, but not with a clear error naming the argument, the value and the rule."""


class Crash(AssertionError):
    """The process running the case died (a signal, or an exit without a result)."""


class Hang(AssertionError):
    """The case did not finish within its bound."""


class FilesOutside(AssertionError):
    """The case wrote, changed or removed a file outside the directory it was confined to."""


def bad_class(excinfo) -> str:
    """The bad class of a failing case, from the exception it raised (module docstring)."""
    from commweave.world import WorldTimeout

    for kind, name in ((FilesOutside, "files outside"), (Crash, "crash"), (Hang, "hang"),
                       (WorldTimeout, "hang"), (Obscure, "obscure error"), (AssertionError, "wrong result")):
        if excinfo.errisinstance(kind):
            return name
    return "obscure error"


def refused(fn: Callable, *texts: str, error: type[BaseException] = ValueError) -> BaseException:
    """Call ``fn()``; it must raise ``error`` whose message holds every one of ``texts`` (the argument, the
    value, the rule). Returns the exception. Accepting is a :class:`WrongResult`, any other exception or a
    message without the texts :class:`Obscure`."""
    try:
        fn()
    except error as e:
        missing = [t for t in texts if t not in str(e)]
        if missing:
            raise Obscure(f"{type(e).__name__}: {e}\n  (does not say {missing})") from e
        return e
    except Exception as e:
        raise Obscure(f"{type(e).__name__} instead of {error.__name__}: {e}") from e
    raise WrongResult(f"accepted: {fn} should have raised {error.__name__} saying {texts}")


def says(messages, *texts: str) -> str:
    """The one error message every rank raised (``messages``: one per rank, "" where a rank raised none):
    a :class:`WrongResult` if no rank refused, :class:`Obscure` if the ranks differ or the message lacks one
    of ``texts``."""
    seen = set(messages)
    if seen == {""}:
        raise WrongResult("accepted on every rank")
    if len(seen) != 1:
        raise Obscure(f"the ranks raised different errors (or some none): {sorted(seen)}")
    message = seen.pop()
    missing = [t for t in texts if t not in message]
    if missing:
        raise Obscure(f"{message}\n  (does not say {missing})")
    return message


# ---------------------------------------------------------------------------------------------------------
# Cases that may crash or hang the process: run in a spawned child
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What a case did in :func:`isolated`: ``status`` is "returned", "raised", "crashed" or "hung";
    ``type`` and ``message`` the exception's (or the returned value's repr)."""

    status: str
    type: str = ""
    message: str = ""
    bases: tuple[str, ...] = ()   # the names of the exception's classes (a subclass of ValueError is one)

    def check_refused(self, *texts: str, error: str = "ValueError") -> None:
        """Raise the bad class unless the case raised ``error`` with every one of ``texts``."""
        if self.status == "crashed":
            raise Crash(self.message)
        if self.status == "hung":
            raise Hang(self.message)
        if self.status == "returned":
            raise WrongResult(f"accepted, returned {self.message}")
        missing = [t for t in texts if t not in self.message]
        if error not in self.bases or missing:
            raise Obscure(f"{self.type}: {self.message}\n  (wanted {error} saying {missing or texts})")


def _child(module: str, table: str, names: list[str], conn) -> None:
    cases = getattr(importlib.import_module(module), table)
    for name in names:
        conn.send(("start", name))
        try:
            value = cases[name]()
        except BaseException as e:  # the outcome is what is measured: every exception is reported
            bases = tuple(c.__name__ for c in type(e).__mro__)
            conn.send(("done", name, Outcome("raised", type(e).__name__, str(e), bases)))
        else:
            conn.send(("done", name, Outcome("returned", type(value).__name__, repr(value)[:200])))


def isolated(module: str, table: str, names: list[str], timeout: float = 60.0) -> dict[str, Outcome]:
    """Run the cases ``getattr(module, table)[name]()`` in a spawned child, one after another, and return
    each one's :class:`Outcome`. A case that kills the child is "crashed" (the next child goes on with the
    cases after it), one that outlives ``timeout`` seconds is "hung" (its child is killed)."""
    ctx = mp.get_context("spawn")
    out: dict[str, Outcome] = {}
    while len(out) < len(names):
        todo = [n for n in names if n not in out]
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(module, table, todo, child), daemon=True)
        proc.start()
        child.close()
        running, started = None, time.monotonic()
        while len(out) < len(names):
            if not parent.poll(max(0.0, started + timeout - time.monotonic())):
                proc.kill()
                out[running or todo[0]] = Outcome("hung", message=f"no result within {timeout:g} s")
                break
            try:
                message = parent.recv()
            except EOFError:
                proc.join()
                out[running or todo[0]] = Outcome("crashed", message=f"the process died with exit code "
                                                                     f"{proc.exitcode}")
                break
            if message[0] == "start":
                running, started = message[1], time.monotonic()
            else:
                out[message[1]] = message[2]
                running = None
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
        parent.close()
    return out


# ---------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------

def _snapshot(root: Path, allowed: Path) -> dict[str, tuple]:
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == allowed or allowed in here.parents:
            dirnames.clear()
            continue
        for name in dirnames + filenames:
            p = here / name
            if p == allowed:
                continue
            st = p.lstat()
            seen[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns,
                                              p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return seen


@contextlib.contextmanager
def no_files_outside(root, allowed) -> Iterator[None]:
    """Raise :class:`FilesOutside` if anything under ``root`` but outside ``allowed`` was created,
    changed or removed inside the block (contents compared; keep ``root`` small: a tmp_path)."""
    root, allowed = Path(root), Path(allowed)
    before = _snapshot(root, allowed)
    yield
    after = _snapshot(root, allowed)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        raise FilesOutside(f"files outside {allowed} created, changed or removed: {changed}")
