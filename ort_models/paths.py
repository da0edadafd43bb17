"""Where specd keeps things on disk (platformdirs; overridable with SPECD_* env vars)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP = "specd"


def _dir(env: str, default: str) -> Path:
    value = os.environ.get(env)
    path = Path(value) if value else Path(default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Built ONNX graphs, content-hash index."""
    return _dir("SPECD_CACHE_DIR", platformdirs.user_cache_dir(APP))


def data_dir() -> Path:
    """Downloaded models (the model store)."""
    return _dir("SPECD_DATA_DIR", platformdirs.user_data_dir(APP))


def config_dir() -> Path:
    return _dir("SPECD_CONFIG_DIR", platformdirs.user_config_dir(APP))


def state_dir() -> Path:
    """Pid file, logs, token file."""
    return _dir("SPECD_STATE_DIR", platformdirs.user_state_dir(APP))


def runtime_dir() -> Path:
    """The Unix socket."""
    value = os.environ.get("SPECD_RUNTIME_DIR")
    if value:
        return _dir("SPECD_RUNTIME_DIR", value)
    return _dir("SPECD_RUNTIME_DIR", platformdirs.user_runtime_dir(APP))


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `lock_path` (created if missing), held for the block:
    another process asking for it waits. Where the platform has no flock (Windows), a
    no-op."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)



@dataclass(frozen=True)
class PrivacyProblem:
    """Why a file is not private to this user, for a message naming the file."""

    text: str  # "belongs to uid N, not to this user" / "may be read or written by ..."
    chmod_fixes: bool  # the file is this user's: `chmod 600` makes it private


def privacy_problem(st: os.stat_result) -> PrivacyProblem | None:
    """Why a file with status `st` is not private to this user; None where it is. Files
    holding secrets or prompts are refused on either, never fixed silently."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return PrivacyProblem(f"belongs to uid {st.st_uid}, not to this user", False)
    mode = stat.S_IMODE(st.st_mode)
    if os.name == "posix" and mode & 0o077:
        return PrivacyProblem(f"may be read or written by other users (mode {mode:04o})",
                              True)
    return None
