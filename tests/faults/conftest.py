"""Counts the faults corpus per kind and class (tests/faults/corpus.py) and prints the table at the end of
the run; ``COMMWEAVE_FAULTS_JSON=path`` writes it as JSON too."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.faults import corpus

_counts: Counter = Counter()       # (kind, class) -> cases
_LABELS = {"refused or harmless": "either", "wrong result": "wrong", "obscure error": "obscure",
           "files outside": "outside"}
_failed: list[tuple[str, str]] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    marker = item.get_closest_marker("fault")
    if marker is None or report.when not in ("setup", "call") or report.skipped:
        return report
    if report.when == "setup" and report.passed:
        return report
    outcome = marker.args[0] if marker.args else marker.kwargs.get("outcome")
    if outcome not in corpus.OUTCOMES:
        raise pytest.UsageError(f"{item.nodeid}: fault outcome {outcome!r} is not one of {corpus.OUTCOMES}")
    kind = marker.kwargs.get("kind", item.module.__name__)
    cases = int(marker.kwargs.get("cases", 1))
    cls = outcome if report.passed else corpus.bad_class(call.excinfo)
    _counts[(kind, cls)] += cases
    if not report.passed:
        _failed.append((item.nodeid, cls))
    return report


def pytest_terminal_summary(terminalreporter):
    if not _counts:
        return
    classes = [*corpus.OUTCOMES, *corpus.BAD]
    kinds = sorted({k for k, _ in _counts})
    width = max(len(k) for k in kinds) + 2
    lines = ["faults corpus (tests/faults/corpus.py): cases per kind and class",
             "kind".ljust(width) + " ".join(f"{_LABELS.get(c, c):>8}" for c in classes)]
    for kind in kinds:
        lines.append(kind.ljust(width) + " ".join(f"{_counts[(kind, c)]:>8}" for c in classes))
    totals = {c: sum(n for (_, cls), n in _counts.items() if cls == c) for c in classes}
    lines.append("total".ljust(width) + " ".join(f"{totals[c]:>8}" for c in classes))
    lines.append("(either: a property test, every example refused clearly or exact; wrong: accepted with a "
                 "wrong result; obscure: refused with another error or text; outside: files changed outside)")
    lines += [f"  {cls}: {nodeid}" for nodeid, cls in _failed]
    terminalreporter.write_line("")
    for line in lines:
        terminalreporter.write_line(line)
    path = os.environ.get("COMMWEAVE_FAULTS_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"classes": classes, "totals": totals,
                       "kinds": {k: {c: _counts[(k, c)] for c in classes} for k in kinds}}, f, indent=1)
