"""`qwen2vl` (the text model of Qwen2-VL and Qwen2.5-VL): Qwen2 with M-RoPE, as llama.cpp's
src/models/qwen2vl.cpp.

M-RoPE (llama.cpp's rope type MROPE, ggml_rope_multi): every row has four positions
(t, h, w, e) and `rope.dimension_sections` [s0, s1, s2, s3] says which one each rotary
pair reads: pair i (of rope_dim / 2) is in sector i mod (s0 + s1 + s2 + s3) and takes t
below s0, h below s0 + s1, w below s0 + s1 + s2, e past that; the angle is that position
times base^(-2i / rope_dim), rotated in NEOX halves. A text token at position p has
(p, p, p, 0); an image's tokens have their grid's (llama.cpp's mtmd, spec/media.py).
"""

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .base import HParams, read_common

N_SECTIONS = 4  # t, h, w and the unused e


def read_hparams(f: GGUFFile) -> HParams:
    hp = read_common(f, rope_interleaved=False, qkv_bias=True,
                     rope_sections=read_sections(f))
    if sum(hp.rope_sections) > hp.rope_dim // 2:
        raise GGUFError(f"{f.path}: {f.arch}.rope.dimension_sections {list(hp.rope_sections)} "
                        f"cover more than the {hp.rope_dim // 2} rotary pairs")
    return hp


def read_sections(f: GGUFFile) -> tuple[int, ...]:
    """`rope.dimension_sections`: four counts of rotary pairs (llama.cpp pads a shorter
    array with zeros), at least one of the first three non-zero."""
    raw = f.require("rope.dimension_sections")
    if (not isinstance(raw, list) or not 0 < len(raw) <= N_SECTIONS
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw)
            or not any(raw[:3])):
        raise GGUFError(f"{f.path}: {f.arch}.rope.dimension_sections must be up to "
                        f"{N_SECTIONS} counts >= 0, one of t/h/w non-zero, got {raw!r}")
    return tuple(raw) + (0,) * (N_SECTIONS - len(raw))
