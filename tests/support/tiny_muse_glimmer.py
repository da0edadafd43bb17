"""Tiny random `muse-glimmer` GGUF models, laid out as llama.cpp's converter writes them
(conversion/muse_glimmer.py): the keys it writes (the sliding window and its per-layer
pattern as an array, logit_scale, final_logit_softcapping) and its tensors (a q/k norm
per layer, the attention gate, the post-attention and post-FFN norms, an untied output).

The tensors draw from tiny_gguf's per-name generators, so a seed gives the same weights
whatever else is asked, and `perturb` makes a draft that mostly agrees with its target.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter, TokenType

import llama_cpp_convert
from tiny_gguf import (
    _FILE_TYPES,
    _tensor_data,
    _TensorSpec,
    add_tokenizer,
    build_vocab,
)

ARCH = "muse-glimmer"
# the chat format's special tokens, as single tokens of the tiny vocabulary
CHAT_SPECIALS = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>")


def llama_cpp_template() -> Path:
    """llama.cpp's muse-glimmer chat template (models/templates/muse-glimmer.jinja of
    the source specd follows); the calling test skips where that source is not there."""
    path = llama_cpp_convert.source() / "models" / "templates" / "muse-glimmer.jinja"
    if not path.is_file():
        pytest.skip(f"llama.cpp's muse-glimmer template is not at {path}")
    return Path(path)


def write_chat_model(path: Path) -> Path:
    """A tiny Q8_0 muse-glimmer with the chat format's specials and llama.cpp's template,
    for the chat routes' tests."""
    return write_tiny_muse_glimmer(path, weight_type="Q8_0", specials=CHAT_SPECIALS,
                                   context_length=4096,
                                   chat_template=llama_cpp_template().read_text())


def tensor_specs(n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
                 n_ff: int, vocab: int, weight_type: str) -> list[_TensorSpec]:
    """Every tensor of the model, in the converter's order."""
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    specs = [_TensorSpec("token_embd.weight", (vocab, n_embd), "embed", weight_type)]
    for i in range(n_layer):
        p = f"blk.{i}."
        specs += [
            _TensorSpec(p + "attn_norm.weight", (n_embd,), "norm", "F32"),
            _TensorSpec(p + "attn_q.weight", (q_dim, n_embd), "matmul", weight_type),
            _TensorSpec(p + "attn_k.weight", (kv_dim, n_embd), "matmul", weight_type),
            _TensorSpec(p + "attn_v.weight", (kv_dim, n_embd), "matmul", weight_type),
            _TensorSpec(p + "attn_q_norm.weight", (head_dim,), "norm", "F32"),
            _TensorSpec(p + "attn_k_norm.weight", (head_dim,), "norm", "F32"),
            _TensorSpec(p + "attn_gate.weight", (q_dim, n_embd), "matmul", weight_type),
            _TensorSpec(p + "attn_output.weight", (n_embd, q_dim), "matmul", weight_type),
            _TensorSpec(p + "post_attention_norm.weight", (n_embd,), "norm", "F32"),
            _TensorSpec(p + "ffn_norm.weight", (n_embd,), "norm", "F32"),
            _TensorSpec(p + "ffn_gate.weight", (n_ff, n_embd), "matmul", weight_type),
            _TensorSpec(p + "ffn_up.weight", (n_ff, n_embd), "matmul", weight_type),
            _TensorSpec(p + "ffn_down.weight", (n_embd, n_ff), "matmul", weight_type),
            _TensorSpec(p + "post_ffw_norm.weight", (n_embd,), "norm", "F32"),
        ]
    specs.append(_TensorSpec("output_norm.weight", (n_embd,), "norm", "F32"))
    specs.append(_TensorSpec("output.weight", (vocab, n_embd), "output", weight_type))
    return specs


def write_tiny_muse_glimmer(
    path: str | Path, *, weight_type: str = "F32", seed: int = 0, n_layer: int = 4,
    n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, head_dim: int = 32,
    n_ff: int = 128, sliding_window: int = 5, swa_pattern: list[bool] | int | None = None,
    logit_scale: float = 0.75, final_softcap: float | None = 30.0,
    rope_freq_base: float = 10000.0, rms_eps: float = 1e-5, context_length: int = 512,
    perturb: float | None = None, chat_template: str | None = None,
    specials: tuple[str, ...] = (),
) -> Path:
    """Write a tiny random muse-glimmer model and return its path. swa_pattern: one bool a
    layer (default: the converter's `layer_types` default, every 4th layer counted back
    from the last global), or a period written as a scalar; final_softcap None: the key
    left out (llama.cpp then caps at 30); specials: control tokens added to the
    vocabulary (in place of padding rows; "<|eot|>" among them is the end-of-turn token),
    as the chat format's <|start|>, <|message|>, <|eom|> and <|eot|>."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab("qwen3", 384 if specials else None)
    if specials:
        first = vocab.tokens.index("[PAD350]")
        for k, text in enumerate(specials):
            vocab.tokens[first + k] = text
            vocab.token_types[first + k] = int(TokenType.CONTROL)
    if swa_pattern is None:
        swa_pattern = [(n_layer - 1 - i) % 4 != 0 for i in range(n_layer)]
    w = GGUFWriter(str(path), ARCH)
    w.add_name(f"tiny-muse-glimmer-{weight_type}")
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_freq_base)
    if final_softcap is not None:
        w.add_final_logit_softcapping(final_softcap)
    w.add_logit_scale(logit_scale)
    w.add_sliding_window(sliding_window)
    if isinstance(swa_pattern, list):
        w.add_array(f"{ARCH}.attention.sliding_window_pattern", swa_pattern)
    else:
        w.add_uint32(f"{ARCH}.attention.sliding_window_pattern", swa_pattern)
    w.add_file_type(int(_FILE_TYPES[weight_type]))
    if weight_type not in ("F32", "F16", "BF16"):
        w.add_quantization_version(2)
    add_tokenizer(w, vocab)
    if "<|eot|>" in specials:
        w.add_eot_token_id(vocab.tokens.index("<|eot|>"))
    if chat_template is not None:  # in place of tiny_gguf's ChatML
        del w.kv_data[0]["tokenizer.chat_template"]
        w.add_chat_template(chat_template)
    for spec in tensor_specs(n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff,
                             len(vocab.tokens), weight_type):
        data, raw_dtype = _tensor_data(spec, seed, n_embd, perturb)
        w.add_tensor(spec.name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
