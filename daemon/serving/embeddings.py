"""Embeddings from a model's last hidden state, as llama-server makes them.

The embedding model is the target, or a model of its own (`--embedding-model`). Its graph
outputs the residual stream after its last layer (a `hidden_layers` output, the one
drafter heads read); the output norm the logits head applies is applied here, then the
tokens' states are pooled (mean, the first token's: `cls`, the last
token's; or `none`: one vector per token) and the pooled vector normalised (llama.cpp's
embd_normalize: -1 none, 0 max-abs to int16's range, 1 taxicab, 2 euclidean, p > 2 the
p-norm).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.generation import prompt_calls
from specd.daemon.spec.media import PromptImage
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.quant import dense_float32

from .loaded_model import LoadedModel

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


@dataclass(frozen=True)
class EmbeddingHead:
    """How a model's hidden states become embeddings: the layer read, its output norm."""

    layer: int
    norm: np.ndarray  # [E] the output norm's weight
    eps: float
    pooling: str

    @classmethod
    def of(cls, f: GGUFFile, pooling: str | None) -> EmbeddingHead:
        """The model's last layer and output norm; `pooling`, else the model's own (an
        embedding model's GGUF names one; a generative model's "none" would give no
        vector per input), else mean."""
        hp = read_hparams(f)
        own = GGUF_POOLING.get(int(f.arch_key("pooling_type", 0)), "none")
        chosen = pooling or (own if own != "none" else "mean")
        if chosen not in POOLINGS:
            raise ValueError(f"unknown pooling {chosen!r} (one of {', '.join(POOLINGS)})")
        norm = dense_float32(f.tensor("output_norm.weight")).reshape(-1)  # [E]
        return cls(hp.n_layer - 1, norm, hp.rms_eps, chosen)


@dataclass
class Embedder:
    """A model whose graph outputs the head's layer (its runner while it is loaded), and
    the tokenizer of its model. `own`: a model of its own (its sequence 0, beside the
    target's slots); else the target, evaluating in the slot a request is given."""

    model: LoadedModel
    tokenizer: Tokenizer
    head: EmbeddingHead
    own: bool

    @property
    def pooling(self) -> str:
        return self.head.pooling

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    def embed(self, seq: int, tokens: list[int], normalize_p: int = 2,
              images: Sequence[PromptImage] = ()) -> np.ndarray:
        """The embedding of `tokens`, evaluated from position 0 of sequence `seq` (its KV
        then holds them): [E] pooled, or [n_tokens, E] with pooling "none". `images`: the
        prompt's images at their placeholders (spec/media.py), their rows evaluated from
        their embeddings as a generation's prefill evaluates them (RequestError where
        the model takes none: an embedding model of its own takes none)."""
        h = self.head
        runner = self.model.runner
        if images:
            calls = prompt_calls(runner, seq, tokens, images, (h.layer,))
            hidden = np.concatenate([  # [n, E]
                runner.forward_batch([c])[0].features[h.layer] for c in calls])
        else:
            _, features = runner.prefill_with_features(seq, tokens, 0, [h.layer])
            hidden = features[h.layer]  # [n, E]
        states = output_norm(hidden, h.norm, h.eps)  # [n, E]
        return normalize(pool(states, h.pooling), normalize_p if h.pooling != "none" else -1)
