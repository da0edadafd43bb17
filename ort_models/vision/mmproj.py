"""Reading llama.cpp's multimodal projector files (mmproj GGUFs), with clear errors.

`convert_hf_to_gguf.py --mmproj` writes a VLM's vision tower as its own GGUF:
architecture "clip", `clip.*` keys for the hyper-parameters, `v.*` tensors for the tower
and `mm.*` tensors for the projector into the text model's embedding width. The file goes
through `GGUFFile` (its header checked as every GGUF's is); here its keys are read into
`VisionHParams` with llama.cpp's defaults (clip.cpp `load_hparams`), and its tensors are
checked against them before anything is built: every tensor the family's graph reads is
there with the shape the keys imply, vectors are float, the data is laid out in order
(`tensor_checks.check_layout`), and every type is one specd reads.

A text model passed as mmproj, a file without a vision encoder, and a projector type
specd has no encoder for each fail with one `GGUFError` line saying so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.quant import check_supported
from specd.ort_models.tensor_checks import FLOAT_TYPES, check_layout

MMPROJ_ARCH = "clip"
# the largest dimensions credible in a vision tower (corrupt keys otherwise size tables)
MAX_WIDTH = 1 << 16
MAX_LAYERS = 1024
MAX_IMAGE_SIDE = 1 << 14


@dataclass(frozen=True)
class VisionHParams:
    """A vision tower's hyper-parameters, as llama.cpp reads them from an mmproj."""

    projector: str  # clip.projector_type, e.g. "gemma3", "qwen2.5vl_merger"
    n_embd: int  # the tower's width
    n_ff: int
    n_layer: int
    n_head: int
    head_dim: int
    eps: float  # its norms' epsilon
    image_size: int  # a fixed-size family's input side
    patch_size: int
    projection_dim: int  # the text model's embedding width
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    ffn: str  # "gelu" (tanh), "silu" or "gelu_quick": clip.use_gelu / clip.use_silu
    n_merge: int  # patches merged per side (the family's default unless a key says)
    n_wa_pattern: int  # qwen2.5-vl: every n-th layer attends globally (0: all do)
    min_pixels: int  # dynamic-size families: the resize's pixel bounds (0: fixed size)
    max_pixels: int


def open_mmproj(path: object) -> GGUFFile:
    """The mmproj GGUF at `path`, checked to be one (a text model's GGUF is refused)."""
    f = GGUFFile(path)  # type: ignore[arg-type]
    if f.arch != MMPROJ_ARCH:
        raise GGUFError(
            f"{f.path}: this is a {f.arch!r} model GGUF, not a multimodal projector: pass "
            f"the mmproj file (architecture 'clip', written by convert_hf_to_gguf.py "
            f"--mmproj, usually named mmproj-*.gguf) as --mmproj")
    if not f.get("clip.has_vision_encoder", False):
        kinds = [k for k in ("audio", "gen_audio") if f.get(f"clip.has_{k}_encoder")]
        what = f"only a {' and '.join(kinds)} encoder" if kinds else "no vision encoder"
        raise GGUFError(f"{f.path}: the mmproj has {what} (clip.has_vision_encoder is not "
                        f"set); specd reads images only")
    return f


def projector_type(f: GGUFFile) -> str:
    """clip.vision.projector_type (files with several modalities), else clip.projector_type."""
    for key in ("clip.vision.projector_type", "clip.projector_type"):
        value = f.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise GGUFError(f"{f.path}: metadata key {key!r} must be a string, got "
                                f"{type(value).__name__}")
            return value
    raise GGUFError(f"{f.path}: the mmproj names no projector type (clip.projector_type)")


def _int(f: GGUFFile, key: str, default: int | None = None, *, low: int = 1,
         high: int = MAX_WIDTH) -> int:
    value = f.get(key, default)
    if value is None:
        raise GGUFError(f"{f.path}: missing metadata key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"{f.path}: metadata key {key!r} must be an integer, got "
                        f"{type(value).__name__}")
    if not low <= value <= high:
        raise GGUFError(f"{f.path}: metadata key {key!r} is {value:,}; it must be between "
                        f"{low:,} and {high:,}")
    return value


def _floats3(f: GGUFFile, key: str, *, positive: bool) -> tuple[float, float, float]:
    value: Any = f.get(key)
    if (not isinstance(value, list) or len(value) < 3
            or not all(isinstance(v, int | float) and math.isfinite(v) for v in value[:3])):
        raise GGUFError(f"{f.path}: metadata key {key!r} must be an array of 3 finite "
                        f"numbers (one per RGB channel), got {value!r}")
    if positive and min(value[:3]) <= 0:
        raise GGUFError(f"{f.path}: metadata key {key!r} must be positive, got {value[:3]}")
    return float(value[0]), float(value[1]), float(value[2])


def read_vision_hparams(f: GGUFFile, *, n_merge: int, min_tokens: int = 0,
                        max_tokens: int = 0) -> VisionHParams:
    """The `clip.vision.*` keys of `f` with llama.cpp's defaults; `n_merge` is the
    family's default merge (clip.vision.projector.scale_factor or
    clip.vision.spatial_merge_size overrides it), min/max_tokens its token bounds for
    dynamic sizes (0: a fixed-size family)."""
    p = "clip.vision."
    n_embd = _int(f, p + "embedding_length")
    n_head = _int(f, p + "attention.head_count")
    head_dim = _int(f, p + "attention.head_dim", n_embd // n_head)
    if head_dim * n_head != n_embd:
        raise GGUFError(f"{f.path}: {p}embedding_length {n_embd} is not "
                        f"{p}attention.head_count {n_head} heads of {head_dim}")
    eps = f.get(p + "attention.layer_norm_epsilon", 1e-6)
    if not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
        raise GGUFError(f"{f.path}: {p}attention.layer_norm_epsilon must be a finite "
                        f"number >= 0, got {eps!r}")
    if f.get("clip.use_gelu") and f.get("clip.use_silu"):
        raise GGUFError(f"{f.path}: both clip.use_gelu and clip.use_silu are set")
    ffn = "gelu" if f.get("clip.use_gelu") else "silu" if f.get("clip.use_silu") else "gelu_quick"
    for key in (p + "projector.scale_factor", p + "spatial_merge_size"):
        if key in f.metadata:
            n_merge = _int(f, key, high=64)
    patch = _int(f, p + "patch_size", high=1024)
    area = patch * patch * n_merge * n_merge
    return VisionHParams(
        projector=projector_type(f), n_embd=n_embd, n_ff=_int(f, p + "feed_forward_length"),
        n_layer=_int(f, p + "block_count", high=MAX_LAYERS), n_head=n_head, head_dim=head_dim,
        eps=float(eps), image_size=_int(f, p + "image_size", high=MAX_IMAGE_SIDE),
        patch_size=patch, projection_dim=_int(f, p + "projection_dim"),
        image_mean=_floats3(f, p + "image_mean", positive=False),
        image_std=_floats3(f, p + "image_std", positive=True), ffn=ffn, n_merge=n_merge,
        n_wa_pattern=_int(f, p + "n_wa_pattern", 0, low=0, high=MAX_LAYERS),
        min_pixels=min_tokens * area, max_pixels=max_tokens * area)


def check_tensors(f: GGUFFile, shapes: dict[str, tuple[int, ...]]) -> None:
    """GGUFError naming the first tensor of `shapes` (name -> numpy shape) that is missing
    or shaped otherwise, or any tensor whose type specd does not read; vectors (norms,
    biases) must be float, as the encoder adds and multiplies them as they are."""
    for t in f.tensors.values():
        check_supported(t, f.path)
    for name, shape in shapes.items():
        t = f.tensor(name)  # "missing tensor 'v.blk.1.attn_q.weight'"
        if t.shape != shape:
            raise GGUFError(f"{f.path}: tensor {name} is {list(t.shape)}, but the clip.* "
                            f"keys imply {list(shape)}")
        if len(shape) == 1 and t.type_name not in FLOAT_TYPES:
            raise GGUFError(f"{f.path}: tensor {name} is stored as {t.type_name}; specd reads "
                            f"vectors (norms, biases) as {', '.join(FLOAT_TYPES)}")
    check_layout(f)
