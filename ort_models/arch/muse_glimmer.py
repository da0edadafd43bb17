"""`muse-glimmer` (Meta's Onyx): the text model of llama.cpp's src/models/muse-glimmer.cpp.

- the token embeddings RMS-normed without a weight (eps: the model's rms eps);
- sliding-window layers (`attention.sliding_window`, required; which layers slide from
  `attention.sliding_window_pattern`, an array or a period, 4 where the file says
  nothing) rotate with NORM (interleaved) RoPE at `rope.freq_base_swa` (default: the
  model's base); global layers have no RoPE;
- q/k RMS norms per head, their weights synthesized at conversion (the q norm carries
  the model's qk scale, the k norm is ones), and 1/sqrt(head_dim) attention;
- a sigmoid output gate: sigmoid(attn_gate @ h) times the attention output, h the
  attention's normed input, before the output matrix;
- norms of the attention and FFN outputs before each residual add, eps 1e-8 (their
  `weight + 1` folded in at conversion), a SwiGLU FFN;
- logits times `logit_scale` (required), then soft-capped at `final_logit_softcapping`
  (30 where the file says nothing, as llama.cpp's default; 0: none).
"""

from __future__ import annotations

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .base import HParams, _count, _real, read_common
from .gemma3 import swa_pattern

DEFAULT_PATTERN = 4  # three sliding-window layers, then a global one
POST_NORM_EPS = 1e-8  # llama.cpp's constant for the post-attention and post-FFN norms
DEFAULT_SOFTCAP = 30.0  # llama_hparams' default, applied where the key is absent


def read_hparams(f: GGUFFile) -> HParams:
    n_layer = _count(f, "block_count", f.require("block_count"))
    window = _count(f, "attention.sliding_window", f.require("attention.sliding_window"))
    rope_base = _real(f, "rope.freq_base", f.arch_key("rope.freq_base", 10000.0))
    cap = f.arch_key("final_logit_softcapping", DEFAULT_SOFTCAP)
    if isinstance(cap, bool) or not isinstance(cap, int | float) or cap < 0:
        raise GGUFError(f"{f.path}: {f.arch}.final_logit_softcapping must be a number >= 0, "
                        f"got {cap!r}")
    hp = read_common(
        f, rope_interleaved=True, qk_norm=True, sliding_window=window,
        swa_layers=swa_pattern(f, n_layer, DEFAULT_PATTERN),
        rope_base_swa=_real(f, "rope.freq_base_swa", f.arch_key("rope.freq_base_swa",
                                                                rope_base)),
        post_norms=True, final_softcap=float(cap) or None, embedding_norm=True,
        rope_swa_only=True, attn_gate=True, post_norm_eps=POST_NORM_EPS,
        logit_scale=_real(f, "logit_scale", f.require("logit_scale")))
    _check_gates(f, hp)
    return hp


def _check_gates(f: GGUFFile, hp: HParams) -> None:
    """Each layer's attn_gate is [n_head * head_dim, n_embd], as attn_q."""
    want = (hp.n_head * hp.head_dim, hp.n_embd)
    for i in range(hp.n_layer):
        name = f"blk.{i}.attn_gate.weight"
        if f.has_tensor(name) and (got := tuple(int(d) for d in f.tensor(name).shape)) != want:
            raise GGUFError(f"{f.part_path(f.tensor(name))}: tensor {name} is {list(got)}, "
                            f"but the metadata implies {list(want)}")
