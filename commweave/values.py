"""One rule per kind of value: every entry point checks its inputs with these (issue 22).

Each checker takes the value and the name the user knows it by (a config key, a flag, a variable, an
argument) and returns the value normalised, or raises a ``ValueError`` (:func:`refuse`) whose text is
``"<name>=<value!r>: <rule>"``: the argument, the value and the rule, always in that order::

    port = values.port(os.environ["MASTER_PORT"], "MASTER_PORT", strings=True)
    timeout = values.seconds(args.timeout, "--commweave-timeout-s", strings=True)
    raw = values.load_json(path, "--atlas-topology", top=dict)

The kinds, and why each rule is what it is:

- names that reach a shell, a hostfile or a socket: :func:`host_name` (RFC 1123), :func:`ip_address`
  (an IPv6 zone id must be an interface name: ``ipaddress`` accepts ``;``, ``$()`` and spaces after
  ``%``), :func:`address` (either), :func:`ifname` (Linux interface names), :func:`port`;
- numbers: :func:`number` (finite, in a stated range, with a unit), :func:`integer` (an int, never a bool
  or a float, in a range), :func:`product` (sizes whose product the kernels or the planner index must fit
  in int64, or in what one allocation can map: :data:`MAX_ALLOC_BYTES`), :func:`seconds` (timeouts:
  :data:`TIMEOUT_RANGE_S`);
- :func:`boolean` (bools only: ``"false"`` is a non-empty, truthy string) and :func:`choice` (a string
  from a fixed set, exact case);
- paths: :func:`directory`, :func:`regular_file` (for reading), :func:`write_target` (a file to create or
  replace: never through a symlink), :func:`confined` (a relative name that stays inside a directory);
- JSON: :func:`load_json` / :func:`parse_json` refuse what Python's ``json`` lets through silently
  (duplicate keys: the last wins; ``NaN``/``Infinity``; ``1e400`` -> inf; 400-digit integers) or fails on
  obscurely (2,000-deep nesting: RecursionError; a FIFO: blocks; ``/dev/zero``: reads forever).

Values from environment variables and command lines arrive as strings: the numeric checkers take
``strings=True`` there and then accept plain decimal text only (no spaces, no ``_``, no ``inf``/``nan``,
which ``float()`` would accept). Nothing here communicates: a distributed caller checks on every rank and
agrees on the verdict (``comm.agree``) before its first collective.
"""

from __future__ import annotations

import ipaddress
import json
import math
import operator
import os
import re
import stat
from collections.abc import Iterable
from itertools import accumulate
from pathlib import Path
from typing import Any, NoReturn

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# x86-64 with 4-level paging gives a process 2**47 bytes of virtual addresses (128 TiB); no CPU or GPU
# allocation can be larger, so a size beyond it is refused before anything is allocated, whatever the
# machine (between the machine's memory and this bound the allocator's own out-of-memory error stands).
MAX_ALLOC_BYTES = 2**47


def refuse(name: str, value: Any, rule: str) -> NoReturn:
    """Raise the ValueError of a refusal. A plain ValueError (callers and tests compare the type by name),
    with ``name``, ``value`` and ``rule`` as attributes for callers that relay them."""
    error = ValueError(f"{name}={value!r}: {rule}")
    error.name, error.value, error.rule = name, value, rule
    raise error


def is_valid(check, value, *args, **kwargs) -> bool:
    """Whether ``check(value, "value", ...)`` accepts ``value`` (for callers that build their own message)."""
    try:
        check(value, "value", *args, **kwargs)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Names: host names, addresses, interfaces, ports
# ---------------------------------------------------------------------------------------------------------

# RFC 1123 §2.1: dot-separated labels of 1-63 ASCII letters, digits and '-', no label starting or ending
# with '-', 253 characters in all. So no shell metacharacter, no leading '-' (an ssh option), no '#' (a
# hostfile comment), no ',' (a second host for pdsh -w), no ':' or '@' (DeepSpeed's --include syntax).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
HOST_NAME_RULE = ("must be an RFC 1123 host name: dot-separated labels of 1-63 letters, digits and '-', "
                  "not starting or ending with '-', at most 253 characters")
# Linux interface names (net/core/dev.c dev_valid_name): 1-15 bytes. The kernel allows more bytes than
# these, but no interface a job names needs them, and each of the others is a hazard in a shell line.
_IFNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}", re.ASCII)
IFNAME_RULE = ("must be a Linux interface name: 1-15 characters from A-Z a-z 0-9 _ . -, not starting "
               "with '.' or '-'")
IP_RULE = ("must be an IPv4 or IPv6 address; an IPv6 zone id after '%' "
           f"{IFNAME_RULE.removeprefix('must be ')} or a scope number (RFC 6874)")


def host_name(value, name: str) -> str:
    if not isinstance(value, str) or len(value) > 253 or _HOST_NAME.fullmatch(value) is None:
        refuse(name, value, HOST_NAME_RULE)
    return value


def ip_address(value, name: str) -> str:
    """An IPv4 or IPv6 literal, returned as given. ``ipaddress`` accepts any text but '/' and '%' as an
    IPv6 zone id (shell metacharacters and spaces included), and an address reaches pdsh's remote shell
    line unquoted: the zone id must be an interface name (a scope number matches that rule too)."""
    if not isinstance(value, str) or not value.isascii():
        refuse(name, value, IP_RULE)
    try:
        parsed = ipaddress.ip_address(value)
    except ValueError:
        refuse(name, value, IP_RULE)
    zone = getattr(parsed, "scope_id", None)
    if zone is not None and _IFNAME.fullmatch(zone) is None:
        refuse(name, value, IP_RULE)
    return value


def address(value, name: str) -> str:
    """A host name or an IP literal: what ``--master_addr``, MASTER_ADDR and a topology ``addr`` accept."""
    if is_valid(host_name, value) or is_valid(ip_address, value):
        return value
    refuse(name, value, f"must be a host name or an IP address: {HOST_NAME_RULE.removeprefix('must be ')}, "
                        f"or {IP_RULE.removeprefix('must be ')}")


def ifname(value, name: str) -> str:
    if not isinstance(value, str) or _IFNAME.fullmatch(value) is None:
        refuse(name, value, IFNAME_RULE)
    return value


def port(value, name: str, *, strings: bool = False) -> int:
    """A TCP port in [1, 65535] (0, "any free port", is not an address a peer can reach)."""
    return integer(value, name, lo=1, hi=65535, unit="TCP port", strings=strings)


# ---------------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------------

# Plain decimal text, as a person writes a number in a variable or a flag. float() also takes " 1 ",
# "1_000", "inf", "nan" and "infinity"; int() takes "1_000" and "٣" (an Arabic-Indic three).
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_INTEGER = re.compile(r"[+-]?\d{1,19}", re.ASCII)   # int64 needs 19 digits at most


def _bounds(lo, hi, unit: str, lo_open: bool = False) -> str:
    left = "(" if lo_open else "["
    return f"{left}{lo:g}, {hi:g}]" + (f" {unit}" if unit else "")


def number(value, name: str, *, lo: float, hi: float, unit: str, lo_open: bool = False,
           strings: bool = False) -> float:
    """A finite real number in [lo, hi] (``lo_open``: (lo, hi]) of ``unit``, as a float. Bools are refused
    (``True`` is 1 to Python, never a rate or a latency); strings only with ``strings`` (plain decimals)."""
    rule = f"must be a finite number in {_bounds(lo, hi, unit, lo_open)}"
    if isinstance(value, str) and strings:
        if _DECIMAL.fullmatch(value) is None:
            refuse(name, value, rule + " (plain decimal text)")
        result = float(value)
    elif isinstance(value, bool) or not isinstance(value, int | float):
        refuse(name, value, rule)
    else:
        try:
            result = float(value)
        except OverflowError:   # an int beyond a double, e.g. a 400-digit integer
            refuse(name, value, rule)
    if not math.isfinite(result) or result > hi or result < lo or (lo_open and result == lo):
        refuse(name, value, rule)
    return result


def integer(value, name: str, *, lo: int = 0, hi: int = INT64_MAX, unit: str = "",
            strings: bool = False) -> int:
    """An integer in [lo, hi]: an ``int`` or anything with ``__index__`` (numpy and 0-d integer tensors),
    never a bool or a float (4.0 is refused: a size written as a float is usually a computation gone
    wrong); strings only with ``strings`` (decimal digits)."""
    rule = f"must be an integer in [{lo}, {hi}]" + (f" ({unit})" if unit else "")
    if isinstance(value, str) and strings:
        if _INTEGER.fullmatch(value) is None:
            refuse(name, value, rule)
        result = int(value)
    else:
        try:
            if isinstance(value, bool):
                raise TypeError
            result = operator.index(value)
        except TypeError:
            refuse(name, value, rule)
    if not lo <= result <= hi:
        refuse(name, value, rule)
    return result


def product(name: str, factors: Iterable[int], *, limit: int = INT64_MAX, unit: str = "elements",
            limit_name: str | None = None) -> int:
    """The product of non-negative sizes, refused when it exceeds ``limit`` (int64 by default: what the
    kernels index with; :data:`MAX_ALLOC_BYTES` for bytes to allocate), which ``limit_name`` names in the
    message. Computed exactly (Python ints): E·C = 2**32 · 2**32 is 2**64 here, not the 0 of int64."""
    factors = list(factors)
    total = math.prod(factors)
    if total > limit:
        shown = " x ".join(str(f) for f in factors)
        refuse(name, shown, f"the product is {total} {unit}, more than {limit} "
                            f"({limit_name or ('int64' if limit == INT64_MAX else 'the limit')})")
    return total


def boolean(value, name: str) -> bool:
    if not isinstance(value, bool):
        refuse(name, value, "must be true or false (a boolean: strings such as 'false' or '0' are refused, "
                            "a non-empty string would read as true)")
    return value


def choice(value, name: str, options: Iterable[str]) -> str:
    options = tuple(options)
    if not isinstance(value, str) or value not in options:
        refuse(name, value, f"must be one of {options}")
    return value


# Timeouts. torch's Work.wait takes a timedelta in milliseconds: below 1 ms it rounds to 0, torch's "no
# timeout", and from about 1e14 s the conversion overflows (OverflowError at the first wait). The floor is
# 1 s, not 1 ms: a healthy collective on a loaded machine, a WAN round trip (ATLAS links of hundreds of
# ms, TCP's 200 ms minimum retransmission timeout, its 1 s SYN retry) or a process-group rendezvous can
# take longer than a fraction of a second, so a sub-second bound fails healthy jobs. The ceiling is one
# week: longer than any wait a person means, and 6.05e8 ms fits every millisecond counter in int32
# (24.8 days), so no layer below (gloo, NCCL, chrono) can overflow it.
TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)


def seconds(value, name: str, *, what: str = "the timeout", strings: bool = False) -> float:
    """A timeout in seconds within :data:`TIMEOUT_RANGE_S` (1 s .. 1 week), as a float."""
    lo, hi = TIMEOUT_RANGE_S
    try:
        return number(value, name, lo=lo, hi=hi, unit="s", strings=strings)
    except ValueError:
        refuse(name, value, f"{what} must be a finite number of seconds in [{lo:g}, {hi:g}] (1 s to 1 week"
                            ": shorter would fail healthy waits and under 1 ms means no timeout to torch)")


# ---------------------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------------------

def _path(value, name: str, rule: str) -> Path:
    if not isinstance(value, str | os.PathLike):
        refuse(name, value, rule)
    text = os.fspath(value)
    if not isinstance(text, str) or not text or "\0" in text:
        refuse(name, value, rule)
    return Path(text)


def _stat(path: Path, name: str, value, rule: str, follow: bool = True) -> os.stat_result | None:
    try:
        return os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        refuse(name, value, f"{rule} ({e.strerror})")


def _existing(value, name: str, rule: str, is_kind) -> Path:
    path = _path(value, name, rule)
    st = _stat(path, name, value, rule)
    if st is None or not is_kind(st.st_mode):
        refuse(name, value, rule + (" (no such file)" if st is None else f", not a {_kind(st)}"))
    return path


def directory(value, name: str) -> Path:
    return _existing(value, name, "must be an existing directory", stat.S_ISDIR)


def regular_file(value, name: str) -> Path:
    """An existing regular file to read (a symlink to one is fine): not a directory, FIFO or device."""
    return _existing(value, name, "must be an existing regular file", stat.S_ISREG)


def write_target(value, name: str) -> Path:
    """A file to create or replace: its directory exists, and the path itself is not a symlink (a link
    planted there would redirect the write) nor anything but a regular file. Write it with
    ``commweave.files.write_atomic``, which opens its temporary file with O_NOFOLLOW | O_EXCL."""
    rule = "must be a regular file (or a new one) in an existing directory, not a symlink"
    path = _path(value, name, rule)
    st = _stat(path, name, value, rule, follow=False)
    if st is not None and not stat.S_ISREG(st.st_mode):
        refuse(name, value, f"{rule}; it is a {_kind(st)}")
    parent = _stat(path.parent, name, value, rule)
    if parent is None or not stat.S_ISDIR(parent.st_mode):
        refuse(name, value, f"{rule}; {str(path.parent)!r} is not an existing directory")
    return path


def confined(root, value, name: str) -> Path:
    """``root / value`` for a relative name that stays inside the directory ``root``: not absolute, no
    '..' component, and no symlink on the way that leads out (checked on the resolved paths)."""
    rule = f"must be a relative path inside {str(root)!r} (no '/' at the start, no '..')"
    rel = _path(value, name, rule)
    if rel.is_absolute() or ".." in rel.parts:
        refuse(name, value, rule)
    base = Path(root).resolve()
    target = (base / rel).resolve()
    if target != base and base not in target.parents:
        refuse(name, value, f"{rule}; it resolves to {str(target)!r}")
    return Path(root) / rel


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink"), (stat.S_ISREG, "regular file")):
        if test(mode):
            return kind
    return "special file"


# ---------------------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------------------

JSON_MAX_BYTES = 16 * 2**20   # far above any config, topology or cache this project reads
JSON_MAX_DEPTH = 32           # a topology nests 5 deep, a DeepSpeed config 4
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class _JsonRefusal(Exception):
    """Raised inside json's hooks, turned into a refusal naming the source outside them."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, v in pairs:
        if key in out:
            raise _JsonRefusal(f"duplicate key {key!r} in one object (Python's json would keep the last "
                               "silently): name each key once")
        out[key] = v
    return out


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _JsonRefusal(f"the number {text} overflows a double (it would read as {v})")
    return v


def _int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > 19 or not -INT64_MAX - 1 <= int(text) <= INT64_MAX:
        raise _JsonRefusal(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} ({len(digits)} digits) "
                           "does not fit in int64")
    return int(text)


def _constant(text: str):
    raise _JsonRefusal(f"{text} is not JSON (RFC 8259 has no NaN or Infinity): write a finite number")


def parse_json(text: str, name: str, *, max_bytes: int = JSON_MAX_BYTES, max_depth: int = JSON_MAX_DEPTH,
               top: type | None = None):
    """Decode JSON text under the rules of :func:`load_json`; ``name`` says where it came from. Every
    error is a refusal (json's own errors are turned into one)."""
    if not isinstance(text, str):
        refuse(name, type(text).__name__, "must be JSON text (a str)")
    if len(text) > max_bytes:
        refuse(name, f"<{len(text)} characters>", f"JSON larger than {max_bytes} bytes")
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if depth > max_depth:
        refuse(name, f"<JSON nested {depth} deep>", f"JSON may nest at most {max_depth} arrays/objects deep")
    try:
        out = json.loads(text, object_pairs_hook=_pairs, parse_float=_float, parse_int=_int,
                         parse_constant=_constant)
    except _JsonRefusal as e:
        refuse(name, "<JSON>", str(e))
    except json.JSONDecodeError as e:
        refuse(name, "<JSON>", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except RecursionError:   # the depth scan above makes this unreachable; kept as the last defence
        refuse(name, "<JSON>", f"JSON may nest at most {max_depth} deep")
    if top is not None and not isinstance(out, top):
        refuse(name, f"<JSON {type(out).__name__}>",
               f"the top level must be a JSON {_JSON_NAMES.get(top, top)}")
    return out


_JSON_NAMES = {dict: "object", list: "array", str: "string"}


def load_json(path, name: str, *, max_bytes: int = JSON_MAX_BYTES, max_depth: int = JSON_MAX_DEPTH,
              top: type | None = None):
    """Read a JSON file: a regular file (a directory, a FIFO or /dev/zero is refused before any read) of
    at most ``max_bytes``, UTF-8, nesting at most ``max_depth``, no duplicate key at any depth, no
    NaN/Infinity, no number that overflows a double or an int64; ``top``: the type of the top level."""
    rule = "must be a readable regular JSON file"
    p = _path(path, name, rule)
    try:
        # O_NONBLOCK: opening a FIFO for reading must not wait for a writer (regular files ignore it)
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        refuse(name, str(p), f"{rule} (no such file)")
    except OSError as e:
        refuse(name, str(p), f"{rule} ({e.strerror})")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            refuse(name, str(p), f"{rule}, not a {_kind(st)}")
        if st.st_size > max_bytes:
            refuse(name, str(p), f"JSON file of {st.st_size} bytes, more than {max_bytes}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        refuse(name, str(p), f"JSON file of more than {max_bytes} bytes (it grew while read)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        refuse(name, str(p), f"not UTF-8 text (byte {e.start})")
    try:
        return parse_json(text, name, max_bytes=max_bytes, max_depth=max_depth, top=top)
    except ValueError as e:
        refuse(name, str(p), e.rule)
