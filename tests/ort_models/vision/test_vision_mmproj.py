"""Reading llama.cpp's mmproj GGUFs: the files its converter wrote (tests/fixtures/vision,
made by make_vision_fixtures.py) read into the hyper-parameters llama.cpp reads, and every
way a file can be wrong refused with one line naming the problem."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_rewrite import rewrite

from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.vision.encoder import read_checked
from specd.ort_models.vision.mmproj import open_mmproj

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vision"
GEMMA3 = FIXTURES / "gemma3-mmproj.gguf"
QWEN25VL = FIXTURES / "qwen25vl-mmproj.gguf"


def test_reads_gemma3_projector_as_llama_cpp_does() -> None:
    _, family, hp = read_checked(GEMMA3)
    assert family.projector == "gemma3"
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.head_dim, hp.n_ff) == (32, 2, 2, 16, 64)
    assert (hp.image_size, hp.patch_size, hp.projection_dim) == (56, 14, 64)
    assert hp.n_merge == 2  # the test model's scale factor; Gemma 3's default is 4
    assert hp.ffn == "gelu" and hp.image_mean == (0.5, 0.5, 0.5)
    assert hp.eps == pytest.approx(1e-6)


def test_reads_qwen25vl_projector_as_llama_cpp_does() -> None:
    _, family, hp = read_checked(QWEN25VL)
    assert family.projector == "qwen2.5vl_merger"
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.projection_dim) == (32, 4, 2, 64)
    assert hp.ffn == "silu" and hp.n_wa_pattern == 2 and hp.n_merge == 2
    area = 14 * 14 * 2 * 2  # llama.cpp's set_limit_image_tokens(8, 4096)
    assert (hp.min_pixels, hp.max_pixels) == (8 * area, 4096 * area)


def test_a_text_model_is_refused_as_mmproj(tiny_model_factory: Callable[..., Path]) -> None:
    text = tiny_model_factory(arch="qwen2")
    with pytest.raises(GGUFError, match=r"'qwen2' model GGUF, not a multimodal projector"):
        open_mmproj(text)


@pytest.mark.parametrize(("change", "message"), [
    ({"keys": {"clip.projector_type": "llava9"}},
     r"no vision encoder for projector type 'llava9' "
     r"\(supported: gemma3, muse-glimmer, qwen2.5vl_merger\)"),
    ({"drop_keys": ("clip.has_vision_encoder",)}, r"no vision encoder"),
    ({"drop_keys": ("clip.projector_type",)}, r"names no projector type"),
    ({"drop_tensors": ("v.blk.1.attn_q.weight",)}, r"missing tensor 'v.blk.1.attn_q.weight'"),
    ({"drop_tensors": ("mm.soft_emb_norm.weight",)}, r"missing tensor 'mm.soft_emb_norm"),
    ({"tensors": {"v.blk.0.ffn_up.weight": np.zeros((48, 32))}},
     r"tensor v.blk.0.ffn_up.weight is \[48, 32\], but the clip.\* keys imply \[64, 32\]"),
    ({"keys": {"clip.vision.attention.head_count": 3}}, r"not .*head_count 3 heads"),
    ({"keys": {"clip.vision.image_size": 60}}, r"image_size 60 is not a whole number"),
    ({"drop_keys": ("clip.vision.image_mean",)}, r"image_mean' must be an array of 3"),
    ({"keys": {"clip.vision.block_count": 100000}}, r"block_count' is 100,000"),
])
def test_a_bad_gemma3_mmproj_names_its_problem(tmp_path: Path, change: dict[str, Any],
                                               message: str) -> None:
    bad = rewrite(GEMMA3, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message):
        read_checked(bad)


def test_qwen25vl_needs_its_window_pattern(tmp_path: Path) -> None:
    bad = rewrite(QWEN25VL, tmp_path / "bad.gguf", drop_keys=("clip.vision.n_wa_pattern",))
    with pytest.raises(GGUFError, match=r"missing metadata key 'clip.vision.n_wa_pattern'"):
        read_checked(bad)


def test_a_truncated_mmproj_fails_as_any_gguf(tmp_path: Path) -> None:
    data = QWEN25VL.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated"):
        read_checked(cut)


def test_the_rewrite_helper_keeps_a_good_file_good(tmp_path: Path) -> None:
    copy = rewrite(GEMMA3, tmp_path / "copy.gguf")
    assert read_checked(copy)[2] == read_checked(GEMMA3)[2]
    assert set(GGUFFile(copy).tensors) == set(GGUFFile(GEMMA3).tensors)
