"""Built graphs on disk: one folder per (GGUF content hash, builder version, options).

A second load of the same file finds the folder and builds nothing. A build removes the
same file's graphs left by other builder versions, which nothing reads any more.

A build holds an exclusive lock on `<folder>.lock`: a second process that wants the same
graph waits for it and then uses it (it never rebuilds, nor removes, a complete folder
another may be loading). Under the lock, scratch folders of builds that were killed are
removed. A folder is complete when its meta.json is there and its files have the sizes
meta.json records, and where a file's modification time differs from the one recorded at
the build (it was written to, or copied), its sha256 still is the one recorded: hashing
only then keeps a load instant, and a process hashes a file once. An incomplete or
damaged folder is rebuilt, with a warning saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from .arch import HParams, read_hparams
from .gguf_file import GGUFFile, file_sha256
from .graph_builder import BUILDER_VERSION, BuildOptions, Progress, build_graph
from .onnx_writer import GraphWriter
from .paths import cache_dir, exclusive_lock
from .quant import check_supported
from .tensor_checks import check_model, check_values

if TYPE_CHECKING:
    import onnx

log = logging.getLogger("specd.cache")

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "weights.bin"
META_FILE = "meta.json"


@dataclass(frozen=True)
class BuiltModel:
    folder: Path
    hparams: HParams
    options: BuildOptions
    gguf_path: Path
    gguf_sha256: str
    built_now: bool = False

    @property
    def model_path(self) -> Path:
        return self.folder / MODEL_FILE

    @property
    def weights_bytes(self) -> int:
        return (self.folder / WEIGHTS_FILE).stat().st_size

    @functools.cached_property
    def read_bytes_per_token(self) -> int:
        """Initializer bytes a decode step reads: all but those it only looks rows up in
        (the token-embedding table unless the output matrix shares it, rotary tables)."""
        return graph_read_bytes(self.model_path)


# (op, input index) of inputs read by rows at the step's tokens or positions
ROW_LOOKUPS = {("Gather", 0), ("RotaryEmbedding", 2), ("RotaryEmbedding", 3),
               ("GroupQueryAttention", 7), ("GroupQueryAttention", 8),
               ("CachedAttention", 6), ("CachedAttention", 7),
               ("CachedAttentionF16", 6), ("CachedAttentionF16", 7)}


def initializer_sizes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of each initializer: its external-data length, else its inline data."""
    return {t.name: int(next((e.value for e in t.external_data if e.key == "length"), 0))
            or len(t.raw_data) for t in model.graph.initializer}


def graph_read_bytes(model_path: Path) -> int:
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    sizes = initializer_sizes(model)
    read = {name for node in model.graph.node for i, name in enumerate(node.input)
            if name in sizes and (node.op_type, i) not in ROW_LOOKUPS}
    return sum(sizes[n] for n in read)


def validate_gguf(f: GGUFFile) -> HParams:
    """Everything that can be checked without reading the weights: architecture, tensor
    types, the tensors against the hyper-parameters (`tensor_checks.check_model`)."""
    hp = read_hparams(f)
    for t in f.tensors.values():
        check_supported(t, f.path)
    check_model(f, hp)
    return hp


def graph_folder(sha256: str, options: BuildOptions) -> Path:
    return cache_dir() / "graphs" / f"{sha256[:24]}-b{BUILDER_VERSION}-{options.key()}"


def prune_stale_graphs(sha256: str) -> list[Path]:
    """Remove this GGUF's graphs built by other builder versions (no specd of this
    version reads them, and a 1.5B model's graph is over a gigabyte); returns them."""
    gone = []
    for old in (cache_dir() / "graphs").glob(f"{sha256[:24]}-b*-*"):
        version = old.name[len(sha256[:24]) + 2:].split("-", 1)[0]
        if version == BUILDER_VERSION or ".tmp" in old.name:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
            gone.append(old)
        elif old.suffix == ".lock":  # the lock file of an old version's build
            old.unlink(missing_ok=True)
    return gone


def is_complete(folder: Path) -> bool:
    """meta.json is there, the files it lists have the sizes it records, and any whose
    modification time is not the one recorded still has the recorded sha256."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        sizes = meta.get("file_sizes", {})
        stats = {name: (folder / name).stat() for name in sizes}
        if any(stats[name].st_size != size for name, size in sizes.items()):
            return False
        return _unchanged(folder, meta, stats)
    except (OSError, ValueError, AttributeError, TypeError, KeyError):  # a damaged meta.json
        return False


# (folder, file) -> (size, mtime) this process found to hold the recorded sha256, or not
_CHECKED: dict[tuple[str, str], tuple[int, int, bool]] = {}


def _unchanged(folder: Path, meta: dict[str, Any], stats: dict[str, os.stat_result]) -> bool:
    """Whether the files meta.json records a sha256 for still have it, hashing only those
    modified since the build (or since their last check); folders built before sha256s
    were recorded are checked by size alone."""
    sums, mtimes = meta.get("file_sha256") or {}, meta.get("file_mtimes") or {}
    refreshed = False
    for name, digest in sums.items():
        st = stats[name]
        key, now = (str(folder), name), (st.st_size, st.st_mtime_ns)
        if mtimes.get(name) == st.st_mtime_ns:
            continue
        seen = _CHECKED.get(key)
        if seen is None or seen[:2] != now:
            good = file_sha256(folder / name) == digest
            _CHECKED[key] = (*now, good)
            if not good:
                log.warning("graph cache: %s changed since it was built (its sha256 is not "
                            "the one recorded); rebuilding %s", name, folder)
            else:  # intact (copied, or touched): its new time is recorded below
                refreshed = True
        if not _CHECKED[key][2]:
            return False
        mtimes[name] = st.st_mtime_ns
    if refreshed:
        _write_meta(folder, {**meta, "file_mtimes": mtimes})
    return True


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """Replace meta.json at once (readers see the old or the new); best effort: a file that
    cannot be written is only hashed again by the next process."""
    tmp = folder / f"{META_FILE}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder / META_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)


def load_or_build(path: str | os.PathLike[str], options: BuildOptions | None = None,
                  progress: Progress | None = None) -> BuiltModel:
    options = options or BuildOptions()
    f = GGUFFile(path)
    hp = validate_gguf(f)
    options = options.for_vocab(hp.n_vocab)
    sha = f.content_hash()
    folder = graph_folder(sha, options)
    built_now = False
    if not is_complete(folder):
        check_values(f)  # a pass over the weights: only where they are built
        with exclusive_lock(folder.with_name(f"{folder.name}.lock")):
            if not is_complete(folder):  # another process may have built it meanwhile
                _build_into(f, hp, options, folder, progress)
                prune_stale_graphs(sha)
                built_now = True
    return BuiltModel(folder, hp, options, Path(path), sha, built_now)


def _build_into(f: GGUFFile, hp: HParams, options: BuildOptions, folder: Path,
                progress: Progress | None) -> None:
    def write(tmp: Path) -> list[str]:
        with open(tmp / WEIGHTS_FILE, "wb") as wf:
            g = GraphWriter(wf, WEIGHTS_FILE)
            build_graph(f, hp, g, options, progress)
        g.save(tmp / MODEL_FILE)
        return [MODEL_FILE, WEIGHTS_FILE]

    meta = {"builder_version": BUILDER_VERSION, "gguf": str(f.path),
            "hparams": dataclasses.asdict(hp), "options": dataclasses.asdict(options)}
    build_folder(folder, write, meta, Path(f.path).name)


def build_folder(folder: Path, write: Callable[[Path], list[str]], meta: dict[str, Any],
                 what: str) -> None:
    """Build into a scratch folder with `write(scratch) -> the files it wrote`, record
    meta.json (with those files' sizes, times and sha256s: `is_complete`), then rename it
    into place. The
    caller holds the folder's lock, so no other process is building or loading an
    incomplete folder."""
    for scratch in folder.parent.glob(f"{folder.name}.tmp*"):  # builds that were killed
        pid = scratch.name.rsplit(".tmp", 1)[-1]
        # (under the lock none is alive; where there is no lock, as on Windows, a live
        # build's folder must be left alone)
        if not pid.isdigit() or not psutil.pid_exists(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        files = write(tmp)
        for name in files:
            _fsync(tmp / name)
        stats = {n: (tmp / n).stat() for n in files}  # a rename keeps the times
        meta = {**meta, "file_sizes": {n: st.st_size for n, st in stats.items()},
                "file_mtimes": {n: st.st_mtime_ns for n, st in stats.items()},
                "file_sha256": {n: file_sha256(tmp / n) for n in files}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        _fsync(tmp / META_FILE)
        shutil.rmtree(folder, ignore_errors=True)  # incomplete or damaged: see is_complete
        os.replace(tmp, folder)
    except OSError as exc:
        raise OSError(exc.errno, f"building the graph of {what} in {folder.parent} failed: "
                      f"{exc.strerror or exc} (the graph takes about the size of the GGUF "
                      "file, or more for re-quantized drafts; SPECD_CACHE_DIR moves the "
                      "cache)") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
