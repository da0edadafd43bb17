"""Where history speculation's indices are kept across restarts: nowhere, unless
`--history-file PATH` names a file only its owner may read, under the user's state dir.

The file holds each identity's tokens (the prompts and outputs of its recent requests),
so it is as private as the prompts themselves: a path outside the state dir, a link, a
file of another user or one others may read or write is refused with a message saying
why, never fixed (others may already have read it). It is written to a 0600 temporary
file beside it and renamed over it, so a crash leaves the old file or the new one.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import numpy as np

from specd.daemon.drafters.history import HistoryStore
from specd.ort_models.paths import privacy_problem, state_dir

SAVE_EVERY_S = 60.0  # a periodic save, at most this often (and one at shutdown)
_FORMAT = 1


class HistoryFileError(ValueError):
    """A history file that may not be used (message for the user)."""


def checked_path(path: str | Path) -> Path:
    """`path` made absolute, refused unless it lies under the state dir and, where it
    exists, is a regular file of this user that no one else may read or write."""
    p = Path(path).expanduser()
    p = p if p.is_absolute() else Path.cwd() / p
    home = state_dir().resolve()
    where = p.parent.resolve() / p.name
    if home not in where.parents:
        raise HistoryFileError(f"--history-file must be a file under the state dir {home} "
                               f"(set SPECD_STATE_DIR to move it), not {p}")
    try:
        st = where.lstat()
    except FileNotFoundError:
        return where
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise HistoryFileError(f"--history-file {where} is not a regular file")
    if problem := privacy_problem(st):
        fix = (f": delete it, or `chmod 600 {where}` if nobody else has read it"
               if problem.chmod_fixes else "")
        raise HistoryFileError(f"--history-file {where} {problem.text}{fix}")
    return where


class HistoryFile:
    """A store's file (checked_path): loaded once, saved periodically and at the end."""

    def __init__(self, path: str | Path):
        self.path = checked_path(path)
        self._saved_at = time.monotonic()

    def load(self, store: HistoryStore) -> int:
        """The file's indices into `store` (none where it does not exist yet); the tokens
        read."""
        checked_path(self.path)
        if not self.path.exists():
            return 0
        try:
            with np.load(self.path, allow_pickle=False) as f:
                if int(f["format"]) != _FORMAT:
                    raise HistoryFileError(f"{self.path} is not a history file this specd "
                                           "reads (delete it)")
                names = [str(n) for n in f["identities"]]
                held = {name: f[f"tokens_{i}"] for i, name in enumerate(names)}
        except (OSError, ValueError, KeyError) as exc:
            if isinstance(exc, HistoryFileError):
                raise
            raise HistoryFileError(f"{self.path} could not be read as a history file "
                                   f"({exc}): delete it") from None
        store.restore(held)
        return sum(int(t.size) for t in held.values())

    def save(self, store: HistoryStore) -> None:
        """The store's indices into the file, through a 0600 temporary file renamed over
        it."""
        held = store.snapshot()
        arrays: dict[str, np.ndarray] = {
            "format": np.asarray(_FORMAT), "identities": np.asarray(list(held), dtype=str)}
        for i, toks in enumerate(held.values()):
            arrays[f"tokens_{i}"] = toks
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                     | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, self.path)
        self._saved_at = time.monotonic()

    def save_if_due(self, store: HistoryStore) -> bool:
        """Save where SAVE_EVERY_S have passed since the last save; whether it saved."""
        if time.monotonic() - self._saved_at < SAVE_EVERY_S:
            return False
        self.save(store)
        return True
