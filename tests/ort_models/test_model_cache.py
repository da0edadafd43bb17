"""The graph cache's integrity (issue 40, item 6): a graph folder records its files' sizes,
times and sha256s; a weights file damaged without a change of size is found and rebuilt,
with a warning, while an intact folder loads without hashing anything."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from specd.ort_models import model_cache
from specd.ort_models.model_cache import META_FILE, WEIGHTS_FILE, is_complete, load_or_build
from specd.ort_models.runner import ModelRunner


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(built: model_cache.BuiltModel) -> np.ndarray:
    return ModelRunner(built, n_ctx=256, threads=1).prefill(0, [3, 1, 4, 1, 5])


def _hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record the files model_cache hashes from now on."""
    seen: list[Path] = []
    real = model_cache.file_sha256

    def counting(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(model_cache, "file_sha256", counting)
    return seen


def test_a_build_records_sizes_times_and_sha256s(tiny_model_factory, cache) -> None:
    built = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=21))
    meta = json.loads((built.folder / META_FILE).read_text())
    for name in ("model.onnx", WEIGHTS_FILE):
        st = (built.folder / name).stat()
        assert meta["file_sizes"][name] == st.st_size
        assert meta["file_mtimes"][name] == st.st_mtime_ns
        data = (built.folder / name).read_bytes()
        assert meta["file_sha256"][name] == hashlib.sha256(data).hexdigest()


def test_weights_damaged_without_a_size_change_are_rebuilt(tiny_model_factory, cache,
                                                          caplog, monkeypatch) -> None:
    """Before: the damaged graph was used (its size was all that was checked)."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=22)
    first = load_or_build(path)
    want = _logits(first)
    weights = first.folder / WEIGHTS_FILE
    with open(weights, "r+b") as fh:  # bytes of a weight matrix, the size unchanged
        fh.seek(weights.stat().st_size // 2)
        fh.write(b"\x7f" * 64)
    model_cache._CHECKED.clear()  # as a new process finds it
    hashed = _hashes(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="specd.cache"):
        again = load_or_build(path)
    assert again.built_now and again.folder == first.folder
    assert [r.getMessage() for r in caplog.records if r.name == "specd.cache"] == [
        f"graph cache: {WEIGHTS_FILE} changed since it was built (its sha256 is not the one "
        f"recorded); rebuilding {first.folder}"]
    # found damaged (once, though looked at twice), then hashed by the build to record it
    assert [p.name for p in hashed].count(WEIGHTS_FILE) == 2
    np.testing.assert_array_equal(_logits(again), want)
    hashed.clear()
    assert not load_or_build(path).built_now and hashed == []  # rebuilt: trusted again


def test_an_intact_folder_is_not_hashed_and_a_touched_one_once(tiny_model_factory, cache,
                                                             monkeypatch) -> None:
    path = tiny_model_factory(arch="llama", weight_type="F16", seed=23)
    built = load_or_build(path)
    model_cache._CHECKED.clear()
    hashed = _hashes(monkeypatch)
    assert is_complete(built.folder) and hashed == []  # times as recorded: no hashing
    weights = built.folder / WEIGHTS_FILE
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a copy, a touch
    assert is_complete(built.folder) and hashed == [weights]  # hashed: intact
    meta = json.loads((built.folder / META_FILE).read_text())
    assert meta["file_mtimes"][WEIGHTS_FILE] == weights.stat().st_mtime_ns  # recorded
    model_cache._CHECKED.clear()
    assert not load_or_build(path).built_now and hashed == [weights]


def test_a_folder_built_before_sha256s_were_recorded_is_checked_by_size(
        tiny_model_factory, cache) -> None:
    built = load_or_build(tiny_model_factory(arch="llama", weight_type="F16", seed=24))
    meta_path = built.folder / META_FILE
    meta = json.loads(meta_path.read_text())
    del meta["file_sha256"], meta["file_mtimes"]
    meta_path.write_text(json.dumps(meta))
    assert is_complete(built.folder)
    weights = built.folder / WEIGHTS_FILE
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size - 1)
    assert not is_complete(built.folder)
