"""M-RoPE (qwen2vl, Qwen2-VL's text model): the graph's rows rotated by their four
positions against the numpy reference's independent float64 forward; text rows at their
KV positions, an image's rows at grid positions, the text after it shifted, in every
attention kind and in packed passes; and the reader's checks of rope.dimension_sections."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf_rewrite import rewrite

from specd.daemon.models.building import build_options
from specd.ort_models import native_ops
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.graph_builder.mrope import pair_sections
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import Call, ModelRunner, text_rope_positions
from specd.ort_models.shared_initializers import same_named

from numpy_reference import ReferenceModel
from speculation_checks import assert_block_rows_equal_single_steps
from tiny_gguf import write_tiny_qwen2vl

native = pytest.mark.skipif(native_ops.unavailable_reason() is not None,
                            reason=f"specd's kernels: {native_ops.unavailable_reason()}")
ATTENTION = [pytest.param(BuildOptions(accuracy_level=1), id="exact"),
             pytest.param(BuildOptions(accuracy_level=1, attention="fused"), id="fused"),
             pytest.param(BuildOptions(accuracy_level=1, attention="native"), id="native",
                          marks=native)]
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64]
BEFORE, AFTER = [5, 17, 42], [100, 7, 3, 99]
GRID = (2, 3)  # an image's token rows and columns
TOL = 2e-4  # of the logits' scale: float32 against float64


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # sections [2, 1, 3, 0] over 8 pairs: sector i mod 6, so the last two pairs wrap to t
    return write_tiny_qwen2vl(tmp_path_factory.mktemp("qwen2vl") / "tiny.gguf",
                              sections=(2, 1, 3, 0), seed=3)


def _close(ours: np.ndarray, want: np.ndarray) -> None:
    scale = float(np.abs(want).max())
    assert scale > 0.1
    assert float(np.abs(ours - want).max()) / scale < TOL


def grid_positions(p0: int, rows: int, cols: int) -> np.ndarray:
    """An image's M-RoPE rows at rope position p0, as llama.cpp's mtmd: (p0, p0 + y,
    p0 + x, 0) in row-major order."""
    y, x = np.divmod(np.arange(rows * cols), cols)
    return np.stack([np.full(rows * cols, p0), p0 + y, p0 + x, np.zeros(rows * cols, int)])


def test_reads_sections(qwen2vl: Path) -> None:
    hp = read_hparams(GGUFFile(qwen2vl))
    assert hp.arch == "qwen2vl" and hp.rope_sections == (2, 1, 3, 0) and hp.mrope
    assert hp.qkv_bias and not hp.rope_interleaved
    assert pair_sections(hp).tolist() == [0, 0, 1, 2, 2, 2, 0, 0]


@pytest.mark.parametrize(("sections", "why"), [
    ([0, 0, 0, 0], "one of t/h/w non-zero"), ([4, 4, 4, 0], "cover more than the 8"),
    ([1, 2, 3, 4, 5], "up to 4 counts")])
def test_bad_sections_are_named(qwen2vl: Path, tmp_path: Path, sections: list[int],
                                why: str) -> None:
    bad = rewrite(qwen2vl, tmp_path / "bad.gguf",
                  keys={"qwen2vl.rope.dimension_sections": sections})
    with pytest.raises(GGUFError, match="rope.dimension_sections") as err:
        read_hparams(GGUFFile(bad))
    assert why in str(err.value)


def test_missing_sections_are_named(qwen2vl: Path, tmp_path: Path) -> None:
    bad = rewrite(qwen2vl, tmp_path / "bad.gguf", drop_keys=("qwen2vl.rope.dimension_sections",))
    with pytest.raises(GGUFError, match="qwen2vl.rope.dimension_sections"):
        read_hparams(GGUFFile(bad))


@pytest.mark.parametrize("options", ATTENTION)
def test_text_rows_match_reference(qwen2vl: Path, options: BuildOptions) -> None:
    """A prompt, then single steps: (p, p, p, 0) at each KV position."""
    r = ModelRunner(load_or_build(qwen2vl, options), n_ctx=256)
    ref = ReferenceModel(qwen2vl)
    want = ref.forward(PROMPT + [8, 9])
    ours = r.forward(0, PROMPT, 0, list(range(len(PROMPT))))
    _close(ours, want[:len(PROMPT)])
    for i, t in enumerate([8, 9]):
        _close(r.forward(0, [t], len(PROMPT) + i), want[len(PROMPT) + i:len(PROMPT) + i + 1])


@pytest.mark.parametrize("options", ATTENTION)
def test_shifted_rows_match_reference(qwen2vl: Path, options: BuildOptions) -> None:
    """Rows whose rope positions are not their KV positions (text after an image): the
    reference at those positions, the mask still by KV order."""
    r = ModelRunner(load_or_build(qwen2vl, options), n_ctx=256)
    ref = ReferenceModel(qwen2vl)
    rope = text_rope_positions(0, len(PROMPT), shift=0)
    rope[:, 4:] -= 2  # the rows after the fourth two positions back
    rope[3, :] = 0
    want = ref.step(PROMPT, ref.new_cache(), rope_positions=rope)
    out = r.forward_batch([Call(0, PROMPT, 0, list(range(len(PROMPT))),
                                rope_positions=rope)])[0]
    _close(out.logits, want)


@pytest.mark.parametrize("options", [p for p in ATTENTION if p.id != "fused"])
def test_image_grid_rows_match_reference(qwen2vl: Path, options: BuildOptions) -> None:
    """Text, an image's rows at their grid positions, text after it at max(rows, cols)
    past the image's start: as llama.cpp's mtmd decodes a Qwen-VL prompt."""
    r = ModelRunner(load_or_build(qwen2vl, options), n_ctx=256)
    emb = load_or_build(qwen2vl, replace(options, embeddings_input=True))
    r.attach_embeddings(emb, same_named(emb.model_path, r.built.model_path))
    n_image = GRID[0] * GRID[1]
    image = np.random.default_rng(0).normal(0, 1.0, (n_image, r.hp.n_embd)).astype(np.float32)
    p0 = len(BEFORE)
    after_start = p0 + n_image  # KV position of the text after the image
    shift = max(GRID) - n_image  # its rope positions: p0 + max(rows, cols) on
    ref = ReferenceModel(qwen2vl)
    cache = ref.new_cache()
    want = [ref.step(BEFORE, cache)[-1:],
            ref.step_embeddings(image, cache, rope_positions=grid_positions(p0, *GRID))[-1:],
            ref.step(AFTER, cache, rope_positions=text_rope_positions(after_start, len(AFTER),
                                                                       shift))]
    got = [r.forward(0, BEFORE, 0),
           r.forward_batch([Call(0, [0] * n_image, p0, embeds=image,
                                 rope_positions=grid_positions(p0, *GRID))])[0].logits,
           r.forward_batch([Call(0, AFTER, after_start, list(range(len(AFTER))),
                                 rope_positions=text_rope_positions(after_start, len(AFTER),
                                                                    shift))])[0].logits]
    for ours, w in zip(got, want, strict=True):
        _close(ours, w)


SERVING = [pytest.param(BuildOptions(), id="exact"),
           pytest.param(build_options("target"), id="serving")]


@pytest.mark.parametrize("options", SERVING)
def test_block_rows_equal_single_steps(qwen2vl: Path, options: BuildOptions) -> None:
    """A verified block's rows are the single steps' bit for bit: at KV positions, and
    shifted (text after an image), as speculation needs."""
    built = load_or_build(qwen2vl, options)
    assert_block_rows_equal_single_steps(built, PROMPT)
    rope = text_rope_positions(0, len(PROMPT), shift=-4)
    rope[:, :3] = text_rope_positions(0, 3)  # the first three before the "image"
    singles_r, block_r = (ModelRunner(built, n_ctx=256) for _ in range(2))
    singles = np.concatenate([singles_r.forward_batch([Call(
        0, [t], i, rope_positions=rope[:, i:i + 1])])[0].logits for i, t in enumerate(PROMPT)])
    block_r.forward_batch([Call(0, PROMPT[:3], 0, rope_positions=rope[:, :3])])
    block = block_r.forward_batch([Call(0, PROMPT[3:], 3, list(range(len(PROMPT) - 3)),
                                        rope_positions=rope[:, 3:])])[0].logits
    np.testing.assert_array_equal(block, singles[3:])


@native
def test_packed_pass_takes_each_calls_positions(qwen2vl: Path) -> None:
    """Two sequences in one native pass, one shifted: each row's logits are its call's
    alone, bit for bit."""
    options = BuildOptions(accuracy_level=1, attention="native")
    r = ModelRunner(load_or_build(qwen2vl, options), n_ctx=256, n_seq=2)
    shifted = text_rope_positions(0, len(PROMPT), shift=3)
    calls = [Call(0, PROMPT, 0, [len(PROMPT) - 1]),
             Call(1, PROMPT, 0, [len(PROMPT) - 1], rope_positions=shifted)]
    alone = [r.forward_batch([c])[0].logits for c in calls]
    both = r.forward_batch(calls)
    assert not np.array_equal(alone[0], alone[1])
    for a, b in zip(alone, both, strict=True):
        assert np.array_equal(a, b.logits)


def test_positions_checked(qwen2vl: Path, tiny_model_factory) -> None:
    r = ModelRunner(load_or_build(qwen2vl, BuildOptions(accuracy_level=1)), n_ctx=256)
    with pytest.raises(ValueError, match=r"M-RoPE positions \[4, 3\]"):
        r.forward_batch([Call(0, [1, 2, 3], 0, rope_positions=np.zeros((4, 2), np.int64))])
    plain = ModelRunner(load_or_build(tiny_model_factory(arch="qwen2", weight_type="F32"),
                                      BuildOptions(accuracy_level=1)), n_ctx=256)
    with pytest.raises(ValueError, match="one rope position per row"):
        plain.forward_batch([Call(0, [1, 2], 0, rope_positions=np.zeros((2, 2), np.int64))])
