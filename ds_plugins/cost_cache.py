"""The ``cost_cache`` file: the "auto" selector's fitted alpha-beta parameters, kept between runs.

    {"format": "commweave-parm-costs", "version": 1,
     "entries": {"world4-mp2-esp2-ep2-gloo": [alpha_0, beta_0, ..., alpha_n, beta_n, overlap], ...}}

one entry per layout (ds_plugins.selector.layout_key), 2·len(cost_model.OPS) + 1 numbers in the order of
``cost_model.OPS``: every alpha (s) and beta (s per byte or per flop) finite and >= 0, the overlap
inefficiency in [0, 1]. Three rules, so that the file can neither break a run nor split the ranks:

- :func:`check` runs when the setting is parsed (ds_plugins.config), on every rank, before any collective:
  the path must be a regular file or a new one, not a symlink, in an existing directory this process can
  write to. A refusal names the key, the value and the rule, and ds_plugins.initialize (or ParmMoE's
  set-up) agrees on it over the world, so every rank raises it.
- :func:`read` never raises: a file that is missing gives no entry; one that cannot be read or parsed
  (commweave.values.load_json: a directory, garbage, duplicate keys, NaN), is not in this format, or whose
  entry has the wrong length (another version of the model) or a non-finite, negative or out-of-range
  number, gives a problem text. The selector agrees on every rank's outcome before using any of it.
- :func:`write` is atomic (commweave.files.write_atomic: a temporary file beside it, renamed over it), and
  only replaces a file that is absent or already a cost cache (never a DeepSpeed config that the setting
  was pointed at by mistake); a failure is a warning on the writing rank, never an error: the costs are
  fitted and in use already.
"""

from __future__ import annotations

import json
import math
import os
import warnings

from commweave import files, values
from ds_plugins import cost_model

NAME = 'parm cost_cache'
FORMAT = "commweave-parm-costs"
VERSION = 1


def width() -> int:
    """Numbers per entry: an alpha and a beta per modelled op, and the overlap inefficiency."""
    return 2 * len(cost_model.OPS) + 1


def check(path) -> str:
    """The path, or a ValueError naming the key, the value and the rule (module docstring)."""
    target = values.write_target(path, NAME)
    if not os.access(target.parent, os.W_OK | os.X_OK):
        values.refuse(NAME, str(path), f"must be a file in a directory this process can write to; "
                                       f"{str(target.parent)!r} is not writable")
    return os.fspath(path)


def _load(path: str) -> dict | None:
    """The file's entries (None when there is no file); ValueError when it is not a cost cache."""
    if not os.path.lexists(path):
        return None
    data = values.load_json(path, NAME, top=dict)
    if data.get("format") != FORMAT or data.get("version") != VERSION or not isinstance(data.get("entries"),
                                                                                        dict):
        values.refuse(NAME, path, f'must be a cost cache written by Parm ({{"format": "{FORMAT}", '
                                  f'"version": {VERSION}, "entries": {{...}}}}), not another JSON file')
    return data["entries"]


def _entry(entry, key: str) -> list[float]:
    rule = (f"entry {key!r} must be a list of {width()} finite numbers >= 0 (alpha and beta per op of "
            f"{cost_model.OPS}, then the overlap in [0, 1])")
    if not isinstance(entry, list) or len(entry) != width() or \
            any(isinstance(v, bool) or not isinstance(v, int | float) for v in entry):
        values.refuse(NAME, _short(entry), rule)
    out = [float(v) for v in entry]
    if not all(math.isfinite(v) and v >= 0 for v in out) or out[-1] > 1:
        values.refuse(NAME, _short(entry), rule)
    return out


def _short(entry) -> str:
    text = repr(entry)
    return text if len(text) <= 120 else text[:117] + "..."


def read(path: str | None, key: str) -> tuple[list[float] | None, str | None]:
    """(the entry for ``key`` or None, the problem with the file or None); never raises."""
    if path is None:
        return None, None
    try:
        entries = _load(path)
        if entries is None or key not in entries:
            return None, None
        return _entry(entries[key], key), None
    except ValueError as e:
        return None, str(e)
    except OSError as e:   # a race with the checks above: the file vanished or changed kind
        return None, f"{NAME}={path!r}: cannot be read ({e.strerror})"


def write(path: str, key: str, entry: list[float]) -> bool:
    """Add or replace ``key``'s entry; True when written, else a warning on this rank (module docstring).
    A file that is there but not a readable cost cache is left alone (it may be someone else's): the
    warning says to remove it."""
    try:
        entries = _load(path) or {}
        entries[key] = _entry(entry, key)
        text = json.dumps({"format": FORMAT, "version": VERSION, "entries": entries}, indent=1) + "\n"
        files.write_atomic(path, text, NAME)
        return True
    except (OSError, ValueError) as e:
        warnings.warn(f"parm: the fitted costs were not saved ({e}); they are in use for this run, and the "
                      "next run fits them again", RuntimeWarning, stacklevel=2)
        return False
