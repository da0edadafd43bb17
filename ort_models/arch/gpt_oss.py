"""`gpt-oss` (gpt-oss-20b, gpt-oss-120b), as llama.cpp's openai-moe graph runs it: NEOX rope
(YaRN-scaled where the file says: rope_scaling.py), q/k/v and output products with
biases, a learned sink logit per head in every attention softmax (`attn_sinks`),
sliding-window layers alternating with global ones (`attention.sliding_window`; the
pattern's period 2 where the file gives none: even layers slide), and in every layer a
mixture of experts: a router with a bias, the top `expert_used_count` of its logits, a
softmax over those k, experts with biases through the clamped SwiGLU (alpha 1.702,
limit 7). The FFN's input norm is `post_attention_norm` (of the residual after attention);
the output matrix is never tied."""

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .base import HParams, _count, _real, read_common, read_moe
from .gemma3 import swa_pattern

SWA_PERIOD = 2  # llama.cpp's load_swa_pattern(ml, 2) for this architecture


def read_hparams(f: GGUFFile) -> HParams:
    n_layer = _count(f, "block_count", f.require("block_count"))
    window = _count(f, "attention.sliding_window", f.require("attention.sliding_window"),
                    lo=0)
    base = _real(f, "rope.freq_base", f.arch_key("rope.freq_base", 10000.0))
    hp = read_common(
        f, rope_interleaved=False, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
        ffn_norm="post_attention_norm", sliding_window=window,
        swa_layers=swa_pattern(f, n_layer, SWA_PERIOD) if window else (),
        rope_base_swa=_real(f, "rope.freq_base_swa", f.arch_key("rope.freq_base_swa", base)),
        moe=read_moe(f, gating="softmax_weight", act="swiglu_oai", biases=True))
    if hp.tied_embeddings:
        raise GGUFError(f"{f.path}: gpt-oss has an output matrix (output.weight); "
                        f"this file has none")
    return hp
