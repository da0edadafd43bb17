"""Embeddings from the target's last hidden state, as llama-server makes them.

The target graph outputs the residual stream after its last layer (a `hidden_layers`
output, the one drafter heads read); the output norm the logits head applies is applied
here, then the tokens' states are pooled (mean, the first token's: `cls`, the last
token's; or `none`: one vector per token) and the pooled vector normalised (llama.cpp's
embd_normalize: -1 none, 0 max-abs to int16's range, 1 taxicab, 2 euclidean, p > 2 the
p-norm).
"""

from __future__ import annotations

import numpy as np

POOLINGS = ("mean", "cls", "last", "none")
# llama.cpp's `{arch}.pooling_type` values
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}


def output_norm(hidden: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of hidden [n, E] with the model's output-norm weight [E], float64 out."""
    h = np.asarray(hidden, dtype=np.float64)  # [n, E]
    scale = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)  # [n, 1]
    return h * scale * np.asarray(weight, dtype=np.float64)


def pool(states: np.ndarray, pooling: str) -> np.ndarray:
    """states [n, E] -> [E] (or [n, E] for "none")."""
    if pooling == "mean":
        return states.mean(axis=0)
    if pooling == "cls":
        return states[0]
    if pooling == "last":
        return states[-1]
    if pooling == "none":
        return states
    raise ValueError(f"unknown pooling {pooling!r} (one of {', '.join(POOLINGS)})")


def normalize(v: np.ndarray, p: int = 2) -> np.ndarray:
    """v [..., E] normalised over its last axis as llama.cpp's common_embd_normalize."""
    v = np.asarray(v, dtype=np.float64)
    if p < 0:
        return v
    if p == 0:  # max absolute value to 32760 (int16's range)
        norm = np.abs(v).max(axis=-1, keepdims=True) / 32760.0
    elif p == 2:
        norm = np.sqrt((v * v).sum(axis=-1, keepdims=True))
    else:
        norm = (np.abs(v) ** p).sum(axis=-1, keepdims=True) ** (1.0 / p)
    return np.divide(v, norm, out=np.zeros_like(v), where=norm > 0)
