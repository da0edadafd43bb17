"""Which mmproj goes with a target: the one asked for (-mm/--mmproj, or none), the
catalog's, else one beside the model file (llama.cpp's mmproj*.gguf naming) whose
projection width fits the model."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf_rewrite import rewrite

from specd.daemon.cli.main import build_parser
from specd.daemon.models import catalog
from specd.daemon.models.catalog import CATALOG, CatalogEntry
from specd.daemon.models.mmproj import find_mmproj, mmproj_beside
from specd.daemon.models.store import ModelStoreError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vision"
QWEN = FIXTURES / "qwen25vl-mmproj.gguf"  # projection width 64
GEMMA = FIXTURES / "gemma3-mmproj.gguf"


@pytest.fixture
def folder(tmp_path: Path, tiny_model_factory: Callable[..., Path]) -> Path:
    """A folder with a tiny text model of embedding width 64, as model.gguf."""
    shutil.copy(tiny_model_factory(arch="qwen2", n_embd=64), tmp_path / "tiny-vl-q8.gguf")
    return tmp_path


def test_no_projector_beside_the_model(folder: Path) -> None:
    model = folder / "tiny-vl-q8.gguf"
    assert mmproj_beside(model) is None
    assert find_mmproj(str(model), model) is None


def test_the_projector_beside_the_model_is_found(folder: Path) -> None:
    model = folder / "tiny-vl-q8.gguf"
    shutil.copy(QWEN, folder / "mmproj-tiny-vl-f32.gguf")
    assert find_mmproj(str(model), model) == folder / "mmproj-tiny-vl-f32.gguf"


def test_a_projector_of_another_width_is_not_taken(folder: Path) -> None:
    model = folder / "tiny-vl-q8.gguf"
    rewrite(QWEN, folder / "mmproj-other.gguf", keys={"clip.vision.projection_dim": 32})
    assert mmproj_beside(model) is None
    shutil.copy(folder / "tiny-vl-q8.gguf", folder / "mmproj-a-text-model.gguf")  # not clip
    assert mmproj_beside(model) is None


def test_of_several_the_one_named_like_the_model_wins(folder: Path) -> None:
    model = folder / "tiny-vl-q8.gguf"
    shutil.copy(GEMMA, folder / "mmproj-another-model.gguf")
    shutil.copy(QWEN, folder / "mmproj-tiny-vl-f16.gguf")
    assert mmproj_beside(model) == folder / "mmproj-tiny-vl-f16.gguf"


def test_asked_for_wins_and_none_turns_images_off(folder: Path) -> None:
    model = folder / "tiny-vl-q8.gguf"
    shutil.copy(QWEN, folder / "mmproj-tiny-vl.gguf")
    assert find_mmproj(str(model), model, str(GEMMA)) == GEMMA
    assert find_mmproj(str(model), model, "none") is None
    with pytest.raises(ModelStoreError, match="neither an existing file nor a catalog model"):
        find_mmproj(str(model), model, str(folder / "missing.gguf"))


def test_the_catalogs_projector(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = folder / "tiny-vl-q8.gguf"
    entry = CatalogEntry(name="tiny-vl", description="", arch="qwen2", wheels=(), size=0,
                         sha256="", license="", mmproj=str(GEMMA))
    monkeypatch.setitem(CATALOG, "tiny-vl", entry)
    assert catalog.CATALOG["tiny-vl"].mmproj == str(GEMMA)
    assert find_mmproj("tiny-vl", model) == GEMMA


def test_serve_and_generate_take_mmproj() -> None:
    p = build_parser()
    assert p.parse_args(["serve", "-mm", "x.gguf"]).mmproj == "x.gguf"
    assert p.parse_args(["generate", "--mmproj", "none", "hi"]).mmproj == "none"
    assert p.parse_args(["serve"]).mmproj is None
