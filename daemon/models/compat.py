"""Can this draft model or drafter head speculate for that target? Checked on GGUF
metadata, before load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specd.ort_models.arch import HParams
from specd.ort_models.heads import HeadParams

# llama.cpp allows a small vocab size difference (padding rows at the end)
MAX_VOCAB_SIZE_DIFFERENCE = 128


def _tokens(meta: Mapping[str, Any]) -> list[str]:
    return list(meta.get("tokenizer.ggml.tokens") or [])


def draft_incompatibilities(target: Mapping[str, Any], draft: Mapping[str, Any]) -> list[str]:
    """Every way the draft's vocabulary differs from the target's (empty: compatible)."""
    problems: list[str] = []
    tm, dm = target.get("tokenizer.ggml.model"), draft.get("tokenizer.ggml.model")
    if tm != dm:
        problems.append(f"vocab type differs: target {tm!r}, draft {dm!r}")
    tt, dt = _tokens(target), _tokens(draft)
    if abs(len(tt) - len(dt)) > MAX_VOCAB_SIZE_DIFFERENCE:
        problems.append(f"vocab size differs by {abs(len(tt) - len(dt))} (target {len(tt)}, "
                        f"draft {len(dt)}; at most {MAX_VOCAB_SIZE_DIFFERENCE} allowed)")
    for key, label in (("tokenizer.ggml.bos_token_id", "BOS"),
                       ("tokenizer.ggml.eos_token_id", "EOS")):
        a, b = target.get(key), draft.get(key)
        if a != b:
            problems.append(f"{label} token id differs: target {a}, draft {b}")
    if target.get("tokenizer.ggml.add_bos_token") != draft.get("tokenizer.ggml.add_bos_token"):
        problems.append("add_bos_token differs: target "
                        f"{target.get('tokenizer.ggml.add_bos_token')}, draft "
                        f"{draft.get('tokenizer.ggml.add_bos_token')}")
    n = min(len(tt), len(dt))
    diff = [i for i in range(n) if tt[i] != dt[i]]
    if diff:
        i = diff[0]
        problems.append(f"{len(diff)} token texts differ, first at id {i}: target {tt[i]!r}, "
                        f"draft {dt[i]!r}")
    return problems


def head_incompatibilities(head: HeadParams, target: HParams,
                           target_meta: Mapping[str, Any] | None = None,
                           head_meta: Mapping[str, Any] | None = None) -> list[str]:
    """Every way the head does not fit the target (empty: it fits): the features it reads
    (their width, the layers), and the vocabulary its ids and shared tensors assume. With
    both files' metadata, a head that carries a tokenizer (llama.cpp's converter copies
    the target's) is also compared with the target's as a draft model's is."""
    problems: list[str] = []
    key = f"{head.arch}.target_layers"
    if head.target_hidden_size != target.n_embd:
        problems.append(f"target hidden size differs: the head reads features "
                        f"{head.target_hidden_size} wide, the target's n_embd is "
                        f"{target.n_embd}")
    for layer in head.target_layers:
        if layer < 1:
            problems.append(f"target layer {layer} in {key} is the token embedding, which "
                            "specd's target graph does not output")
        elif layer > target.n_layer:
            problems.append(f"target layer {layer} in {key} is past the target's depth: it "
                            f"has {target.n_layer} layers (ids 1..{target.n_layer} can be "
                            "read)")
    if head.n_vocab is not None and head.n_vocab != target.n_vocab:
        problems.append(f"vocabulary size differs: target {target.n_vocab}, head "
                        f"{head.n_vocab}")
    for own, what in ((head.has_token_embd, "token embedding"), (head.has_output, "LM head")):
        if not own and head.n_embd != target.n_embd:
            problems.append(f"the head shares the target's {what} (it has none of its own), "
                            f"but its n_embd {head.n_embd} is not the target's "
                            f"{target.n_embd}")
    if head.d2t_max_id is not None and head.d2t_max_id >= target.n_vocab:
        problems.append(f"d2t maps a draft row to target id {head.d2t_max_id}, past the "
                        f"target's vocabulary of {target.n_vocab}")
    if head.mask_token_id is not None and head.mask_token_id >= target.n_vocab:
        problems.append(f"mask token id {head.mask_token_id} is past the target's "
                        f"vocabulary of {target.n_vocab}")
    if target_meta is not None and head_meta is not None and _tokens(head_meta):
        problems += [f"head tokenizer: {p}"
                     for p in draft_incompatibilities(target_meta, head_meta)]
    return problems
