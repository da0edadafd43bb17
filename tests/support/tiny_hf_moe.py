"""Tiny random Hugging Face Qwen3-MoE and gpt-oss checkpoints (transformers'
Qwen3MoeForCausalLM and GptOssForCausalLM, torch's random init at a fixed seed) converted
to GGUF by llama.cpp's own convert_hf_to_gguf.py, as a user's file comes to be.

The checkpoint's tokenizer is tiny_gguf's byte-level BPE vocabulary (tokenizer.json). The
converter names a BPE pre-tokenizer by hashing how the tokenizer splits a fixed text and
knows only the published tokenizers' hashes, so the conversion runs the converter's own
code with that one lookup answering "qwen2" (the pre-tokenizer this
vocabulary uses), as tests/fixtures/make_head_fixtures.py does; every tensor and key is
the converter's. Needs torch and transformers
(`skip_reason` says why not) and llama.cpp's source (bench/build_llama_cpp.sh).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from specd.daemon.benchmark.llama_cpp import root

from tiny_gguf import build_vocab

HIDDEN = 64


def source_dir() -> Path:
    """llama.cpp's source tree at the build specd follows."""
    return root() / "src" / "llama.cpp"


def skip_reason() -> str | None:
    """Why the conversion cannot run here, or None."""
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install torch transformers)"
    if not (source_dir() / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's source is not at {source_dir()} (bench/build_llama_cpp.sh)"
    return None


def write_tokenizer(root: Path) -> int:
    """tokenizer.json / tokenizer_config.json of tiny_gguf's qwen vocabulary; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    voc = build_vocab("qwen3")
    vocab = {t: i for i, t in enumerate(voc.tokens)}
    merges = [tuple(m.split(" ")) for m in voc.merges]
    tok = Tokenizer(models.BPE(vocab, merges))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": voc.tokens[voc.eos_id],
        "bos_token": None, "pad_token": voc.tokens[voc.pad_id]}))
    return len(voc.tokens)


def write_checkpoint(root: Path, *, seed: int = 0, n_expert: int = 8, n_used: int = 2,
                     n_ff_exp: int = 32, n_layer: int = 2) -> Path:
    """save_pretrained of a random Qwen3MoeForCausalLM (float32) with the tiny tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(root)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128,
        moe_intermediate_size=n_ff_exp, num_hidden_layers=n_layer, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=n_expert,
        num_experts_per_tok=n_used, norm_topk_prob=True, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], initializer_range=0.2)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # sharper routers, so each token's top experts stand apart
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(4.0)
    model.save_pretrained(root, safe_serialization=True)
    return root


def write_gpt_oss_checkpoint(root: Path, *, seed: int = 0, n_expert: int = 8, n_used: int = 2,
                             n_ff_exp: int = 32, n_layer: int = 2) -> Path:
    """save_pretrained of a random GptOssForCausalLM (float32, its experts unquantized)
    with the tiny tokenizer: YaRN (factor 32 from 256 positions), a window of 8 on the
    sliding layers, sinks of the scores' size, sharper routers."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(root)
    cfg = GptOssConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=n_ff_exp,
        num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=n_expert, num_experts_per_tok=n_used, sliding_window=8,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.2, layer_types=["sliding_attention", "full_attention"] * (
            n_layer // 2) + ["sliding_attention"] * (n_layer % 2),
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 256})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.weight.mul_(4.0)
            layer.self_attn.sinks.normal_(0.0, 1.0)
    model.save_pretrained(root, safe_serialization=True)
    return root


# runs in a fresh interpreter: llama.cpp's converter needs its own gguf-py, not the one
# this process imported
_CONVERT = """
import runpy, sys
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
script, sys.argv = sys.argv[1], ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
"""


def convert(checkpoint: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `checkpoint` (module docstring)."""
    src = source_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src)])}
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(src / "convert_hf_to_gguf.py"),
                        str(checkpoint), "--outfile",
                        str(out), "--outtype", outtype], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py exited {r.returncode}: {r.stderr[-3000:]}")
    return out
