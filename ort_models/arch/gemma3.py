"""`gemma3`: NEOX rope, per-head q/k norms, embeddings scaled by sqrt(n_embd), norms of the
attention and FFN outputs, a GELU-gated FFN, tied output, optional final soft-capping, and
sliding-window layers with their own rope base, as llama.cpp reads them.

Sliding windows: `gemma3.attention.sliding_window` (0 or absent: every layer global);
which layers slide, from `attention.sliding_window_pattern`: an array (one bool a layer)
or a period n (every n-th layer global, the others sliding), Gemma 3's period 6 where the
file says nothing. `rope.freq_base_swa` (default 10000) is the sliding layers' rope base.
"""

from __future__ import annotations

import dataclasses
import math

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .base import HParams, _count, _real, read_common

DEFAULT_PATTERN = 6  # Gemma 3: five sliding-window layers, then a global one
DEFAULT_ROPE_BASE_SWA = 10000.0


def read_hparams(f: GGUFFile) -> HParams:
    n_layer = _count(f, "block_count", f.require("block_count"))
    window = _count(f, "attention.sliding_window", f.arch_key("attention.sliding_window", 0),
                     lo=0)
    swa = swa_pattern(f, n_layer) if window else ()
    cap = f.arch_key("final_logit_softcapping", None)
    hp = read_common(
        f, rope_interleaved=False, qk_norm=True, sliding_window=window, swa_layers=swa,
        rope_base_swa=_real(f, "rope.freq_base_swa",
                            f.arch_key("rope.freq_base_swa", DEFAULT_ROPE_BASE_SWA)),
        post_norms=True, ffn_act="gelu",
        final_softcap=None if not cap else _real(f, "final_logit_softcapping", cap))
    # llama.cpp: the embeddings scaled by sqrt(n_embd); Gemma 3 27B's q scale is
    # 1/sqrt(n_embd / n_head), every other size's 1/sqrt(head_dim)
    return dataclasses.replace(
        hp, embedding_scale=math.sqrt(hp.n_embd),
        attention_scale=1.0 / math.sqrt(hp.n_embd / hp.n_head) if n_layer == 62 else None)


def swa_pattern(f: GGUFFile, n_layer: int, default: int = DEFAULT_PATTERN
                ) -> tuple[bool, ...]:
    """Per layer, whether it slides: the file's array, or its period n (every n-th layer
    global; `default` where the file says nothing), as llama.cpp's load_swa_pattern."""
    key = f"{f.arch}.attention.sliding_window_pattern"
    raw = f.metadata.get(key, default)
    if isinstance(raw, list):
        if len(raw) != n_layer or not all(isinstance(x, bool) for x in raw):
            raise GGUFError(f"{f.path}: {key} must be {n_layer} booleans, one a layer")
        return tuple(raw)
    period = _count(f, "attention.sliding_window_pattern", raw, lo=0)
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layer))
