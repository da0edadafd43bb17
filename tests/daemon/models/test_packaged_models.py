"""Catalog entries that ship inside specd (drafter heads): resolved from the package's
`packaged/` folder, verified, never pulled or removed."""

from __future__ import annotations

import hashlib

import pytest

from specd.daemon.models import store as model_store
from specd.daemon.models.catalog import CATALOG, DEFAULT_TARGET, CatalogEntry
from specd.daemon.models.default_drafter import choice_table, default_drafter
from specd.daemon.models.store import (
    ModelStoreError,
    check_stored,
    list_local,
    model_path,
    pull,
    remove,
    resolve_model,
)
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import read_head

HEAD = "fake-head"
DATA = b"GGUF" + bytes(range(256)) * 100


@pytest.fixture
def packaged(tmp_path, monkeypatch):
    """A packaged entry whose file lies in a temp `packaged/` folder."""
    monkeypatch.setenv("SPECD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "packaged"
    folder.mkdir()
    (folder / "fake-head.gguf").write_bytes(DATA)
    monkeypatch.setattr(model_store, "packaged_dir", lambda: folder)
    entry = CatalogEntry(name=HEAD, description="a fake head", arch="dflash", wheels=(),
                         size=len(DATA), sha256=hashlib.sha256(DATA).hexdigest(),
                         license="none", packaged="fake-head.gguf",
                         head_for="qwen2.5-coder-1.5b-instruct")
    monkeypatch.setitem(CATALOG, HEAD, entry)

    def no_download(dist, version, dest):
        raise AssertionError("a packaged entry was downloaded")

    monkeypatch.setattr(model_store, "_download_wheel", no_download)
    return folder


def test_a_packaged_head_resolves_to_its_file_and_is_verified(packaged):
    assert model_path(HEAD) == packaged / "fake-head.gguf"
    assert resolve_model(HEAD, to_run=True) == packaged / "fake-head.gguf"
    assert resolve_model(HEAD, fetch=False) == packaged / "fake-head.gguf"
    assert pull(HEAD) == packaged / "fake-head.gguf"
    assert CATALOG[HEAD].runnable  # a head runs, though dflash is no target architecture
    assert HEAD not in [name for name, _, _ in list_local()]  # not a download


def test_a_damaged_packaged_head_is_refused_with_reinstall(packaged):
    (packaged / "fake-head.gguf").write_bytes(DATA[:-1] + b"x")
    with pytest.raises(ModelStoreError, match="damaged.*reinstall specd"):
        resolve_model(HEAD, to_run=True)
    (packaged / "fake-head.gguf").write_bytes(DATA[:-1])
    with pytest.raises(ModelStoreError, match="has size.*reinstall specd"):
        resolve_model(HEAD, to_run=True)


def test_a_missing_packaged_head_says_reinstall(packaged):
    (packaged / "fake-head.gguf").unlink()
    with pytest.raises(ModelStoreError, match="ships with specd.*reinstall specd"):
        resolve_model(HEAD)
    with pytest.raises(ModelStoreError, match="ships with specd.*reinstall specd"):
        pull(HEAD)


def test_a_packaged_head_is_not_removed(packaged):
    with pytest.raises(ModelStoreError, match="ships with specd"):
        remove(HEAD)
    assert (packaged / "fake-head.gguf").is_file()


SHIPPED = [e for e in CATALOG.values() if e.packaged is not None]


@pytest.mark.parametrize("entry", SHIPPED, ids=lambda e: e.name)
def test_each_shipped_head_is_whole_and_drafts_for_a_catalog_target(entry: CatalogEntry):
    path = model_path(entry.name)
    check_stored(entry.name, path)  # its size and sha256 are the catalog's
    assert path.stat().st_size <= 64 << 20  # package data stays small
    head = read_head(GGUFFile(path))
    assert head.kind == entry.arch and entry.head_for in CATALOG
    assert CATALOG[entry.head_for].head_for is None  # a target, not another head


def test_the_shipped_choices_name_catalog_models():
    table = choice_table()
    assert DEFAULT_TARGET in table
    for target, measured in table.items():
        assert target in CATALOG  # a drafter, or a head and a draft model joined by "+"
        assert {part for name in measured["speedup"] for part in name.split("+")} <= set(CATALOG)
        assert all(set(cells) == set(measured["workloads"])
                   for cells in measured["speedup"].values())
    assert default_drafter(DEFAULT_TARGET) is not None
