"""Can this draft model speculate for that target? Checked on GGUF metadata, before load."""

from __future__ import annotations

from typing import Any

# llama.cpp allows a small vocab size difference (padding rows at the end)
MAX_VOCAB_SIZE_DIFFERENCE = 128


def _tokens(meta: dict[str, Any]) -> list[str]:
    return list(meta.get("tokenizer.ggml.tokens") or [])


def draft_incompatibilities(target: dict[str, Any], draft: dict[str, Any]) -> list[str]:
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
