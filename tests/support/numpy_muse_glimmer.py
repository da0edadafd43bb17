"""An independent float64 numpy forward pass of llama.cpp's `muse-glimmer` graph
(src/models/muse-glimmer.cpp), over the GGUF file as numpy_reference reads it:

* x = RMSNorm(token_embd[ids]) without a weight (eps: layer_norm_rms_epsilon);
* per layer: h = RMSNorm(x) * attn_norm; q, k, v = Wq h, Wk h, Wv h, per head
  RMSNorm'd (q, k) with attn_q_norm / attn_k_norm; layers that slide (the
  sliding_window_pattern array, or a period, default 4) rotate q and k with NORM
  (interleaved) rope at rope.freq_base_swa (default rope.freq_base) and see their own
  key and the window - 1 before it; global layers neither rotate nor slide;
  softmax(q.k / sqrt(head_dim)) v, times sigmoid(W_gate h), through attn_output;
* a = RMSNorm(a, eps 1e-8) * post_attention_norm; x += a; the FFN
  down(silu(gate(h)) * up(h)) on RMSNorm(x) * ffn_norm, normed the same way with
  post_ffw_norm, added;
* logits = output @ RMSNorm(x) * output_norm, times logit_scale, then
  cap * tanh(logits / cap) (final_logit_softcapping, default 30; 0: none).

Nothing from specd is imported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from numpy_reference import KVCache, ReferenceModel, read_gguf, rms_norm, rope, silu

POST_NORM_EPS = 1e-8


class MuseGlimmerReference(ReferenceModel):
    """ReferenceModel's decoding (step, greedy, margins) over muse-glimmer's layers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata, self.weights, self.tensor_types = read_gguf(self.path)
        md, a = self.metadata, "muse-glimmer"
        if md["general.architecture"] != a:
            raise ValueError(f"not a muse-glimmer file: {md['general.architecture']!r}")
        self.arch = a
        self.n_layer = int(md[f"{a}.block_count"])
        self.n_embd = int(md[f"{a}.embedding_length"])
        self.n_head = int(md[f"{a}.attention.head_count"])
        self.n_head_kv = int(md[f"{a}.attention.head_count_kv"])
        self.head_dim = int(md.get(f"{a}.attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(md.get(f"{a}.rope.dimension_count", self.head_dim))
        self.eps = float(md[f"{a}.attention.layer_norm_rms_epsilon"])
        self.rope_base = float(md.get(f"{a}.rope.freq_base", 10000.0))
        self.rope_base_swa = float(md.get(f"{a}.rope.freq_base_swa", self.rope_base))
        self.window = int(md[f"{a}.attention.sliding_window"])
        pattern = md.get(f"{a}.attention.sliding_window_pattern", 4)
        self.swa = ([bool(x) for x in pattern] if isinstance(pattern, list) else
                    [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1
                     for i in range(self.n_layer)])
        self.logit_scale = float(md[f"{a}.logit_scale"])
        self.softcap = float(md.get(f"{a}.final_logit_softcapping", 30.0))
        self.vocab_size = int(self.weights["token_embd.weight"].shape[0])
        self.embed_scale = 1.0
        self.bos_id = md.get("tokenizer.ggml.bos_token_id")
        self.eos_id = md.get("tokenizer.ggml.eos_token_id")
        self.tied = False
        self.output_weight = self.weights["output.weight"]

    def _layers(self, x: np.ndarray, cache: KVCache, layer_inputs: dict[int, np.ndarray] | None,
                *, causal: bool, rope_positions: np.ndarray | None = None) -> np.ndarray:
        if rope_positions is not None:
            raise ValueError("muse-glimmer has one rope position per row, not four")
        start, n_new = cache.length, x.shape[0]
        positions = np.arange(start, start + n_new)
        hd, nh, nkv, w = self.head_dim, self.n_head, self.n_head_kv, self.weights
        key_pos = np.arange(start + n_new)
        seen_to = positions[:, None] if causal else np.full((n_new, 1), start + n_new - 1)
        mask = key_pos[None, :] > seen_to  # True = masked
        x = rms_norm(x, np.ones(self.n_embd), self.eps)  # the embedding norm
        first = not cache.keys
        for layer in range(self.n_layer):
            if layer_inputs is not None:
                layer_inputs[layer] = x
            p = f"blk.{layer}."
            h = rms_norm(x, w[p + "attn_norm.weight"], self.eps)
            q = (h @ w[p + "attn_q.weight"].T).reshape(n_new, nh, hd).transpose(1, 0, 2)
            k = (h @ w[p + "attn_k.weight"].T).reshape(n_new, nkv, hd).transpose(1, 0, 2)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n_new, nkv, hd).transpose(1, 0, 2)
            gate = 1.0 / (1.0 + np.exp(-(h @ w[p + "attn_gate.weight"].T)))  # [T, nh*hd]
            q = rms_norm(q, w[p + "attn_q_norm.weight"], self.eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], self.eps)
            if self.swa[layer]:  # NORM rope on the sliding layers only
                q = rope(q, positions, self.n_rot, self.rope_base_swa, neox=False)
                k = rope(k, positions, self.n_rot, self.rope_base_swa, neox=False)
            if first:
                cache.keys.append(k)
                cache.values.append(v)
            else:
                cache.keys[layer] = np.concatenate([cache.keys[layer], k], axis=1)
                cache.values[layer] = np.concatenate([cache.values[layer], v], axis=1)
            keys = np.repeat(cache.keys[layer], nh // nkv, axis=0)  # [nh, S, hd]
            vals = np.repeat(cache.values[layer], nh // nkv, axis=0)
            scores = (q @ keys.transpose(0, 2, 1)) / np.sqrt(float(hd))  # [nh, T, S]
            masked = mask
            if self.swa[layer]:
                masked = mask | (positions[:, None] - key_pos[None, :] >= self.window)
            scores = np.where(masked[None], -np.inf, scores)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = (probs @ vals).transpose(1, 0, 2).reshape(n_new, nh * hd) * gate
            a = attn @ w[p + "attn_output.weight"].T
            x = x + rms_norm(a, w[p + "post_attention_norm.weight"], POST_NORM_EPS)
            h = rms_norm(x, w[p + "ffn_norm.weight"], self.eps)
            f = (silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
                 ) @ w[p + "ffn_down.weight"].T
            x = x + rms_norm(f, w[p + "post_ffw_norm.weight"], POST_NORM_EPS)
        if layer_inputs is not None:
            layer_inputs[self.n_layer] = x
        logits = rms_norm(x, w["output_norm.weight"], self.eps) @ self.output_weight.T
        logits = logits * self.logit_scale
        if self.softcap:
            logits = self.softcap * np.tanh(logits / self.softcap)
        return logits
