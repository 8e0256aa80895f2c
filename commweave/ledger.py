"""The communication ledger: bytes each rank puts on the wire, per collective kind and process group.

Every collective in commweave goes through :mod:`commweave.comm`, which reports to the ledgers that
are open in this process. Tests assert these counts against the volume formulas of the design notes
(parm.md §2, wallfacer.md §5); benchmarks print them next to the timings.

Wire-byte conventions (bytes *sent by this rank*, ring/pairwise algorithms, g = group size,
n = the tensor's bytes as named):

=================  =========================================  ==================================
kind               sent by this rank                          received by this rank
=================  =========================================  ==================================
all_to_all         input bytes not addressed to itself        output bytes not from itself
                   (equal splits: n_in·(g−1)/g)               (equal splits: n_out·(g−1)/g)
all_gather         n_in·(g−1)                                 n_in·(g−1)
reduce_scatter     n_out·(g−1)  (= n_in·(g−1)/g)              n_out·(g−1)
all_reduce         2·n·(g−1)/g                                2·n·(g−1)/g
broadcast          n·(g−1) on the source, 0 elsewhere         n on the others, 0 on the source
send / recv        n on the sender                            n on the receiver
=================  =========================================  ==================================

These are the bandwidth terms of the alpha-beta model, the quantities the papers' formulas count;
they are not what a particular backend's algorithm happens to move.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv")


@dataclass(slots=True)
class Entry:
    """Totals for one (kind, group) pair."""

    calls: int = 0
    sent: int = 0
    received: int = 0


@dataclass(eq=False)
class Ledger:
    """Accumulates :class:`Entry` totals keyed by ``(kind, group_name)``.

    Open one with :func:`recording`; read it with :meth:`sent`, :meth:`received`, :meth:`calls`.
    """

    entries: dict[tuple[str, str], Entry] = field(default_factory=dict)

    def add(self, kind: str, group: str, sent: int, received: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"ledger kind {kind!r} is not one of {KINDS}")
        entry = self.entries.setdefault((kind, group), Entry())
        entry.calls += 1
        entry.sent += int(sent)
        entry.received += int(received)

    def _select(self, kind: str | None, group: str | None) -> list[Entry]:
        return [e for (k, g), e in self.entries.items()
                if (kind is None or k == kind) and (group is None or g == group)]

    def sent(self, kind: str | None = None, group: str | None = None) -> int:
        """Bytes sent by this rank, filtered by kind and/or group name (None = all)."""
        return sum(e.sent for e in self._select(kind, group))

    def received(self, kind: str | None = None, group: str | None = None) -> int:
        return sum(e.received for e in self._select(kind, group))

    def calls(self, kind: str | None = None, group: str | None = None) -> int:
        return sum(e.calls for e in self._select(kind, group))

    def groups(self) -> list[str]:
        return sorted({g for _, g in self.entries})

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{"kind@group": {"calls": .., "sent": .., "received": ..}}``, JSON-friendly."""
        return {f"{k}@{g}": {"calls": e.calls, "sent": e.sent, "received": e.received}
                for (k, g), e in sorted(self.entries.items())}

    def clear(self) -> None:
        self.entries.clear()

    def table(self) -> str:
        rows = [f"{'kind':<15}{'group':<22}{'calls':>7}{'sent MB':>12}{'recv MB':>12}"]
        for (k, g), e in sorted(self.entries.items()):
            rows.append(f"{k:<15}{g:<22}{e.calls:>7}{e.sent / 1e6:>12.3f}{e.received / 1e6:>12.3f}")
        return "\n".join(rows)


_open: list[Ledger] = []
_lock = threading.Lock()


@contextmanager
def recording(ledger: Ledger | None = None) -> Iterator[Ledger]:
    """Record every collective issued through :mod:`commweave.comm` while the block runs.

    Ledgers nest: an inner block's traffic is also counted by the outer ones.
    """
    ledger = Ledger() if ledger is None else ledger
    with _lock:
        _open.append(ledger)
    try:
        yield ledger
    finally:
        with _lock:
            _open.remove(ledger)


def active() -> bool:
    return bool(_open)


def record(kind: str, group: str, sent: int, received: int) -> None:
    """Add one call to every open ledger (a no-op when none is open)."""
    if not _open:
        return
    with _lock:
        for ledger in _open:
            ledger.add(kind, group, sent, received)
