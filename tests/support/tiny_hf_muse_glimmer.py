"""Tiny random Hugging Face muse-glimmer checkpoints (transformers'
`MuseGlimmerForConditionalGeneration`, a small vision tower beside the text model, as the
released checkpoints have one), for llama.cpp's converter to turn into GGUF files: the
text model, and with `convert_vlm` its vision projector too (`--mmproj`).

The tower: 5 blocks (windowed, windowed, windowed, global, global: every 4th and the last
attend globally), a 4 × 4 position table (windows of 4 × 4 patches of 14 pixels), merge 2.

Random weights with magnitudes that give a tiny model decided greedy choices: matrices of
std gain / sqrt(fan_in), the zero-centred layer norms (the converter adds 1) and the final
norm jittered by 0.1, the output matrix of std 3 / sqrt(hidden). Needs torch.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from llama_cpp_convert import write_tokenizer

TEXT: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "sliding_window": 5, "rms_norm_eps": 1e-5, "final_logit_softcapping": 30.0,
    "qk_scale_factor": 3.87, "output_multiplier": 1.5, "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
    "num_attention_heads": 2, "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4,
    "merge_size": 2, "max_position_embeddings": 16,
}
# the image processor's settings the converter reads (mean and std into the mmproj)
PREPROCESSOR: dict[str, Any] = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14,
    "temporal_patch_size": 2, "merge_size": 2, "max_image_tokens": 4096,
}


def _values(name: str, shape: tuple[int, ...], seed: int, hidden: int,
            centred: bool = True) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    z = rng.standard_normal(shape)
    if centred and name.endswith("layernorm.weight"):  # the model uses 1 + weight
        return 0.1 * z
    if len(shape) == 1:
        return 1.0 + 0.1 * z
    if name.endswith("lm_head.weight"):
        return 3.0 / np.sqrt(hidden) * z
    gain = 5.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
    return gain / np.sqrt(shape[-1]) * z


def write_checkpoint(folder: Path, *, seed: int = 0, specials: tuple[str, ...] = (),
                     **text: Any) -> Path:
    """A checkpoint with its tokenizer (`specials` added to its special tokens) in
    `folder` (text: TEXT's keys overridden)."""
    import torch
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    n_tokens = write_tokenizer(folder, extra_specials=specials)
    vocab = -(-n_tokens // 32) * 32
    cfg = MuseGlimmerConfig(
        text_config={**TEXT, **text, "vocab_size": vocab, "eos_token_id": 2, "bos_token_id": 0},
        vision_config=VISION, projector_hidden_size=64,
        # the pixel shuffle's width: merge² patches of the tower's
        out_hidden_size=VISION["hidden_size"] * VISION["merge_size"] ** 2,
        image_token_id=vocab - 1, video_token_id=vocab - 2)
    torch.manual_seed(seed)
    model = MuseGlimmerForConditionalGeneration(cfg).eval()
    hidden = cfg.text_config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(_values(name, tuple(p.shape), seed, hidden)))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return folder


def convert_vlm(root: Path, *, seed: int = 0, specials: tuple[str, ...] = ()
                ) -> tuple[Path, Path]:
    """root/text.gguf (f16) and root/mmproj.gguf (float32, so that llama.cpp computes the
    tower in float32 too) from a fresh checkpoint, by llama.cpp's own converter."""
    from llama_cpp_convert import convert

    checkpoint = write_checkpoint(root / "hf", seed=seed, specials=specials)
    text = convert(checkpoint, root / "text.gguf", outtype="f16")
    return text, convert(checkpoint, root / "mmproj.gguf", outtype="f32", mmproj=True)


ASSISTANT: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"], "block_size": 4,
    "target_layer_ids": [0, 2], "rope_parameters": {"rope_type": "default",
                                                    "rope_theta": 10000.0},
}


def write_assistant(folder: Path, target_vocab: int, *, seed: int = 0, **config: Any) -> Path:
    """A tiny transformers `MuseGlimmerAssistantModel` (the DFlash drafter: `encoder.fc`,
    `encoder.output_norm_enc`, Exaone4-style layers with per-head q/k norms, Q/K in
    rotate_half order; its norms are plain weights, drawn around 1) for a target of
    `target_vocab` tokens (written as vocab_size, so that llama.cpp's converter keeps the
    target's padding rows), its mask token the last padding row (config: ASSISTANT's keys
    overridden)."""
    import torch
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg = MuseGlimmerAssistantConfig(**{**ASSISTANT, "vocab_size": target_vocab,
                                        "mask_token_id": target_vocab - 1,
                                        "bos_token_id": 0, "eos_token_id": 2,
                                        "pad_token_id": None, **config})
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(_values(name, tuple(p.shape), seed, cfg.hidden_size,
                                                 centred=False)))
    model.save_pretrained(folder, safe_serialization=True)
    return folder
