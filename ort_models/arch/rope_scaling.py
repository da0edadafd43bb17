"""Rotary position scaling as llama.cpp applies it: the GGUF's `rope.scaling.*` keys read into
`RopeScaling`, and the cos / sin tables of the rotation it gives.

llama.cpp (llama-model.cpp, llama-context.cpp, ggml's rope_yarn) reads `rope.scaling.type`
("none", "linear" or "yarn"; absent: linear), `rope.scaling.factor` (freq_scale = 1/factor;
absent or 0: no scaling), `rope.scaling.original_context_length` (YaRN's n_ctx_orig; absent:
the trained context) and `rope.scaling.attn_factor` (default 1). It takes YaRN's
beta_fast 32, beta_slow 1 and extrapolation factor 1 as its defaults, whatever the file
says, and its attention factor get_mscale(factor) / (1 + 0.1 ln factor) times attn_factor.
Per rotary pair i (angle theta_e = p * base^(-2i/d)), with corr_dims [lo, hi] from
ggml_rope_yarn_corr_dims:

    theta_i = freq_scale * theta_e                   (linear; YaRN before its ramp)
    ramp    = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)       (YaRN)
    theta   = theta_i * (1 - ramp) + theta_e * ramp                (YaRN)
    cos, sin = cos(theta) * m, sin(theta) * m,  m = attn_factor * (1 + 0.1 ln(1/freq_scale))
                                                     (YaRN; else m = attn_factor)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specd.ort_models.gguf_file import GGUFError, GGUFFile

KINDS = ("none", "linear", "yarn")
YARN_BETA_FAST = 32.0  # llama.cpp's hparams defaults, not read from the file
YARN_BETA_SLOW = 1.0


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" or "yarn"
    freq_scale: float  # 1 / rope.scaling.factor
    n_ctx_orig: int  # YaRN: the context the model was trained at before scaling
    attn_factor: float = 1.0  # rope.scaling.attn_factor

    @property
    def mscale(self) -> float:
        """The factor of cos and sin (float32 as llama.cpp computes it)."""
        f32 = np.float32
        if self.kind != "yarn":
            return float(f32(self.attn_factor))
        factor = f32(1.0) / f32(self.freq_scale)
        attn = (f32(0.1) * np.log(factor) + f32(1.0)) * (  # get_mscale(factor, 1), cancelled
            f32(1.0) / (f32(1.0) + f32(0.1) * np.log(factor))) * f32(self.attn_factor)
        return float(f32(attn) * (f32(1.0) + f32(0.1) * np.log(f32(1.0) / f32(self.freq_scale))))


def read_rope_scaling(f: GGUFFile, n_ctx_train: int) -> RopeScaling | None:
    """The file's rope scaling, None where it scales nothing."""
    kind = f.arch_key("rope.scaling.type", "linear")
    if kind not in KINDS:
        raise GGUFError(f"{f.path}: {f.arch}.rope.scaling.type {kind!r} is not supported "
                        f"(supported: {', '.join(KINDS)})")
    factor = f.arch_key("rope.scaling.factor", f.arch_key("rope.scale_linear", 0.0))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 0:
        raise GGUFError(f"{f.path}: {f.arch}.rope.scaling.factor must be a number >= 0, "
                        f"got {factor!r}")
    attn = f.arch_key("rope.scaling.attn_factor", 1.0)
    if isinstance(attn, bool) or not isinstance(attn, int | float) or not attn > 0:
        raise GGUFError(f"{f.path}: {f.arch}.rope.scaling.attn_factor must be a positive "
                        f"number, got {attn!r}")
    orig = f.arch_key("rope.scaling.original_context_length", n_ctx_train)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise GGUFError(f"{f.path}: {f.arch}.rope.scaling.original_context_length must be "
                        f"an integer >= 1, got {orig!r}")
    freq_scale = 1.0 if kind == "none" or factor == 0 else 1.0 / float(factor)
    if kind != "yarn" and freq_scale == 1.0 and attn == 1.0:
        return None
    return RopeScaling(kind=kind if kind != "none" else "linear", freq_scale=freq_scale,
                       n_ctx_orig=orig, attn_factor=float(attn))


def _corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims with llama.cpp's betas: the pairs below lo keep their
    angle, those past hi are interpolated, a ramp between."""
    lo = math.floor(_corr_dim(n_dims, n_ctx_orig, YARN_BETA_FAST, base))
    hi = math.ceil(_corr_dim(n_dims, n_ctx_orig, YARN_BETA_SLOW, base))
    return max(0.0, lo), min(n_dims - 1.0, hi)


def rope_cos_sin(scaling: RopeScaling | None, max_pos: int, rope_dim: int, base: float,
                 freq_factors: tuple[float, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_pos, rope_dim/2] float32 of the rotary angles at positions
    0 .. max_pos-1 (the module docstring's formula; float64, then rounded). `freq_factors`:
    rope_freqs.weight, one divisor per rotary pair of theta_e (as ggml's rope_ext)."""
    i = np.arange(rope_dim // 2, dtype=np.float64)  # [rot/2]
    inv = base ** (-2.0 * i / rope_dim)
    if freq_factors:
        inv = inv / np.asarray(freq_factors, np.float64)
    ext = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]  # [P, rot/2]
    if scaling is None:
        return np.cos(ext).astype(np.float32), np.sin(ext).astype(np.float32)
    theta = scaling.freq_scale * ext
    if scaling.kind == "yarn":
        lo, hi = yarn_corr_dims(rope_dim, scaling.n_ctx_orig, base)
        ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)  # [rot/2]
        theta = theta * (1.0 - ramp) + ext * ramp
    m = scaling.mscale
    return (np.cos(theta) * m).astype(np.float32), (np.sin(theta) * m).astype(np.float32)
