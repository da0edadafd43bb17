"""The trained head as the GGUF llama.cpp's converter writes for a DFlash, DSpark or
EAGLE-3 checkpoint (`DFlashModel`, `DSparkModel` in conversion/qwen.py, `LlamaModel`'s
EAGLE-3 path in conversion/llama.py), through `convert_draft`'s writer: the same keys,
tensor names and types as `specd convert-draft` gives a z-lab checkpoint, the target's
tokenizer copied in. The export folder also holds the head's Hugging Face config.json and
a model card (what the GGUF's general.* keys are read from, as the converter reads them):
the target, the recipe and the training text with its licences.

A reduced draft vocabulary is written as llama.cpp reads one: the head's own
`output.weight` (the target's LM head rows of those ids) and `d2t`, absolute target ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specd.daemon.models.compat import head_incompatibilities
from specd.daemon.models.convert_draft.common import Checkpoint, HeadWriter, rope_parameters
from specd.daemon.models.convert_draft.target import read_target
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import MASK_TOKEN_KEY, HeadFormatError, HeadParams, read_head

from . import TrainError
from .config import HeadConfig

# the Hugging Face class names convert_draft (and llama.cpp's converter) read a config by
HF_ARCHS = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel",
            "eagle3": "LlamaForCausalLMEagle3"}


def hf_config(cfg: HeadConfig) -> dict[str, Any]:
    """The head's config.json in z-lab's DFlash layout (HF layer ids: llama.cpp's - 1), with
    a DSpark head's Markov rank and anchor-first block; an EAGLE-3 head's in SpecForge's."""
    if cfg.kind == "eagle3":
        return _eagle3_config(cfg)
    config: dict[str, Any] = {
        "architectures": [HF_ARCHS[cfg.kind]],
        "model_type": "qwen3",
        "hidden_size": cfg.n_embd,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head_kv,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.n_ff,
        "max_position_embeddings": cfg.n_ctx_train,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        "hidden_act": "silu",
        "vocab_size": cfg.target_vocab,
        "tie_word_embeddings": False,
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": [x - 1 for x in cfg.target_layers]},
    }
    if cfg.reduced:
        config["draft_vocab_size"] = cfg.draft_vocab
    if cfg.kind == "dspark":
        config |= {"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
                   "sample_from_anchor": True}
    return config


def _eagle3_config(cfg: HeadConfig) -> dict[str, Any]:
    """SpecForge's LlamaForCausalLMEagle3 config.json (its layer ids as llama.cpp writes
    them: eagle3.target_layers)."""
    return {"architectures": [HF_ARCHS["eagle3"]], "model_type": "llama",
            "hidden_size": cfg.n_embd, "num_hidden_layers": 1,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head_kv,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.n_ff,
            "max_position_embeddings": cfg.n_ctx_train, "rms_norm_eps": cfg.rms_eps,
            "rope_theta": cfg.rope_base, "hidden_act": "silu", "vocab_size": cfg.target_vocab,
            "draft_vocab_size": cfg.draft_vocab, "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": list(cfg.target_layers),
            "target_hidden_size": cfg.n_embd}


def model_card(cfg: HeadConfig, target: GGUFFile, sources: Sequence[dict[str, str]],
               recipe: dict[str, Any]) -> str:
    """README.md with the front matter llama.cpp's metadata reader takes general.* from."""
    front = ["---", "tags:", f"- {cfg.kind}", "- speculative-decoding", "- specd"]
    licence = target.get("general.license")
    if isinstance(licence, str) and licence:
        front.append(f"license: {licence}")
    front.append("---")
    title = {"dflash": "DFlash", "dspark": "DSpark", "eagle3": "EAGLE-3"}[cfg.kind]
    lines = [*front, "", f"# {title} head for {target.name or Path(target.path).name}", "",
             f"Trained by `specd train-draft` by self-distillation: {cfg.n_layer} layer(s), "
             f"width {cfg.n_embd}, " + (f"block {cfg.block_size}, " if cfg.kind != "eagle3"
                                        else "") + "reading target layers "
             f"{list(cfg.target_layers)} (llama.cpp's ids), "
             + (f"draft vocabulary {cfg.draft_vocab} (d2t)." if cfg.reduced
                else "the target's vocabulary."), "",
             "## Training text", ""]
    lines += [f"- {s['source']}: {s['description']} ({s['licence']})" for s in sources]
    lines += ["", "The labels are the target's own greedy replies to instructions made of "
              "this text.", "", "## Recipe", "", "```json", json.dumps(recipe, indent=1),
              "```", ""]
    return "\n".join(lines)


def write_card_folder(folder: Path, cfg: HeadConfig, target: GGUFFile,
                      sources: Sequence[dict[str, str]], recipe: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    (folder / "README.md").write_text(model_card(cfg, target, sources, recipe))


def write_head(out: Path, cfg: HeadConfig, tensors: dict[str, np.ndarray],
               d2t: np.ndarray | None, lm_rows: np.ndarray | None, target_path: Path,
               card_folder: Path, outtype: str = "f16") -> HeadParams:
    """Write the head GGUF `out` (via `out`.partial, checked before it takes the name):
    `tensors` the trained weights by llama.cpp name; a reduced head's d2t (target ids
    ascending) and, for the DFlash family, its LM head rows lm_rows [Vd, E] (an EAGLE-3
    head's own LM head is among its tensors). Returns the head as specd reads it."""
    config = json.loads((card_folder / "config.json").read_text())
    ck = Checkpoint(card_folder, config, config, HF_ARCHS[cfg.kind], {})
    target = read_target(target_path)
    eagle3 = cfg.kind == "eagle3"
    b = HeadWriter("eagle3" if eagle3 else "dflash", outtype)
    for name, data in tensors.items():
        b.add_tensor(name, np.ascontiguousarray(data, np.float32))
    if d2t is not None and not eagle3:
        assert lm_rows is not None and len(lm_rows) == len(d2t)
        b.add_tensor("output.weight", np.ascontiguousarray(lm_rows, np.float32))
    if d2t is not None:
        b.add_ids("d2t", d2t)
    if eagle3:  # as llama.cpp's converter orders an EAGLE-3 head's keys
        b.w.add_array(b.key("target_layers"), list(cfg.target_layers))
        b.w.add_uint32(b.key("target_hidden_size"), cfg.n_embd)
        b.w.add_bool(b.key("norm_before_residual"), False)
        b.w.add_bool(b.key("norm_before_fc"), False)
    b.add_general(card_folder)
    b.add_text_params(ck, cfg.n_layer, rope_parameters(ck))
    if eagle3:
        b.w.add_vocab_size(cfg.target_vocab)
        b.w.add_rope_dimension_count(cfg.head_dim)
    else:
        b.w.add_uint32(b.key("block_size"), cfg.block_size)
        b.w.add_array(b.key("target_layers"), list(cfg.target_layers))
    if cfg.kind == "dspark":
        b.w.add_bool(b.key("sample_from_anchor"), True)
        b.w.add_bool(b.key("has_confidence_head"), "conf_proj.weight" in tensors)
    b.add_quantization_version()
    b.add_tokenizer(target.tokenizer.items())
    named = target.tokenizer.get(MASK_TOKEN_KEY)
    if not eagle3 and named is None:  # EAGLE-3 has no block to fill
        b.w.add_mask_token_id(cfg.mask_token_id)
    elif not eagle3 and named is not None and named.value != cfg.mask_token_id:
        raise TrainError(f"the target names mask token {named.value}; the head was trained "
                         f"with {cfg.mask_token_id}, which its GGUF cannot say")
    partial = out.with_name(out.name + ".partial")
    try:
        b.write(partial)
        head = _check(partial, target_path)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return head


def _check(path: Path, target_path: Path) -> HeadParams:
    """The written head as specd's head reader reads it, checked against the target."""
    f, t = GGUFFile(path), GGUFFile(target_path)
    try:
        head = read_head(f)
    except HeadFormatError as exc:
        raise TrainError(f"the written head is malformed: {exc}") from None
    problems = head_incompatibilities(head, read_hparams(t), t.metadata, f.metadata)
    if problems:
        raise TrainError("the written head does not fit the target: " + "; ".join(problems))
    return head
