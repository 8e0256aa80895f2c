"""Writing a file so that a crash, a concurrent reader or a planted symlink cannot hurt (issue 22).

:func:`write_atomic` writes ``path`` through a temporary file in the same directory, then renames it over
``path`` (``os.replace``: readers see the old file or the new one, never half of one). The temporary file
is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a name nobody can guess in advance (pid plus 64
random bits): a symlink planted at ``PATH.<pid>.tmp`` is never followed, and an existing file of that name
is never opened. The rename replaces a symlink at ``path`` itself rather than its target, and the target
is checked first (:func:`commweave.values.write_target`): ``path`` must be a regular file or new.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from commweave import values


def write_atomic(path, data: bytes | str, name: str, *, mode: int = 0o644) -> Path:
    """Replace ``path`` with ``data`` atomically (module docstring); ``name`` names it in errors."""
    target = values.write_target(path, name)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        values.refuse(name, str(target), f"cannot create a temporary file beside it ({e.strerror})")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)
    return target


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX: the directory entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
