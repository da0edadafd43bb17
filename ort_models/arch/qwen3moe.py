"""`qwen3moe` (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): qwen3's attention (NEOX rope, per-head
q/k norms) and in every layer a mixture of experts: a softmax router, the top
`expert_used_count` of `expert_count` experts (`ffn_gate_exps` / `ffn_up_exps` /
`ffn_down_exps`, 3-D), their weights renormalised to sum 1 (llama.cpp always does for this
architecture), optionally scaled by `expert_weights_scale`."""

from specd.ort_models.gguf_file import GGUFFile

from .base import HParams, read_common, read_moe


def read_hparams(f: GGUFFile) -> HParams:
    return read_common(f, rope_interleaved=False, qk_norm=True,
                       moe=read_moe(f, gating="softmax", norm=True))
