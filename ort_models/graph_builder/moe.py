"""The mixture-of-experts feed-forward block (qwen3moe, gpt-oss), where a dense model has
mlp.feed_forward: a MoeRouter node picks each token's experts and weights, and two
GgufExperts nodes multiply each (token, expert) pair by that expert's matrices only: the
stacked gate and up, then down with the gated activation as its prologue and the weighted
sum over the token's experts as its epilogue. Both ops compute each row alone in a fixed
order (kernels/moe_router.c, kernels/gguf_experts.h), so a verified row equals a single
step. The experts stay as the GGUF stores them (F16 / BF16 widened to float32); they need
specd's kernels."""

from __future__ import annotations

from typing import Any

import numpy as np

from specd.ort_models.gguf_file import GGUFError, TensorInfo
from specd.ort_models.gguf_layouts import expert_rows
from specd.ort_models.native_ops import DOMAIN as NATIVE
from specd.ort_models.native_ops import unavailable_reason
from specd.ort_models.quant import DENSE_TYPES, EXPERT_TYPE_IDS, dense_float32

from .context import BuildContext
from .options import I64
from .pending import Activation, materialize

GATING = {"softmax": 0, "softmax_weight": 1}
PROLOGUE = {"silu": 2, "swiglu_oai": 3}  # GgufExperts' gated prologues
SWIGLU_OAI = {"alpha": 1.702, "limit": 7.0}  # llama.cpp's constants for gpt-oss
# the graph output of every MoE layer's router ids side by side, [S, n_layer * top_k]
EXPERT_IDS = "expert_ids"


def output_expert_ids(c: BuildContext) -> None:
    """The graph output EXPERT_IDS: each row's chosen experts in every MoE layer (layer i's
    top_k ids at columns i * top_k ..), so a pass can tell which experts its rows woke.
    A dense model has none."""
    if not c.expert_ids:
        return
    m = c.hp.moe
    assert m is not None
    c.g.op("Concat", c.expert_ids, axis=1, out=[EXPERT_IDS])
    c.g.output(EXPERT_IDS, I64, ["S", len(c.expert_ids) * m.n_used])


def moe_ffn(c: BuildContext, h: Activation, p: str) -> str:
    """The block `p`'s mixture-of-experts output [S, n_embd] for its normed input h."""
    g, m = c.g, c.hp.moe
    assert m is not None
    if c.options.kernels != "gguf":
        raise GGUFError(f"{c.f.path}: {c.hp.arch}'s experts run on specd's own CPU kernels, "
                        f"which this build does not use "
                        f"({unavailable_reason() or 'kernels=' + c.options.kernels})")
    x = materialize(c, h)  # [S, E]
    router = [x, g.weight(p + "ffn_gate_inp.weight", _float_rows(c, p + "ffn_gate_inp.weight"))]
    if m.biases:
        router.append(c.vector(p + "ffn_gate_inp.bias"))
    ids, weights = g.op("MoeRouter", router, 2, domain=NATIVE, top_k=m.n_used,
                        gating=GATING[m.gating], norm=int(m.norm), scale=float(m.scale))
    c.expert_ids.append(ids)
    gate_up = _experts(c, x, ids, [p + "ffn_gate_exps", p + "ffn_up_exps"])  # [S, k, 2F]
    down = p + "ffn_down_exps"
    w, attrs = _expert_weight(c, [down])
    attrs |= {"prologue": PROLOGUE[m.act]}
    if m.act == "swiglu_oai":
        attrs |= SWIGLU_OAI
    return g.op("GgufExperts", [gate_up, ids, w, _expert_bias(c, [down]), weights],
                domain=NATIVE, **attrs)  # [S, E]


def _experts(c: BuildContext, x: str, ids: str, names: list[str]) -> str:
    """x [S, K] through each token's experts of the 3-D tensors `names` (stacked into one
    product where their types agree) -> [S, top_k, N_0 + N_1 + ...]."""
    types = {c.f.tensor(n + ".weight").type_name for n in names}
    if len(types) > 1:  # one product each, side by side
        outs = [_experts(c, x, ids, [n]) for n in names]
        return c.g.op("Concat", outs, axis=-1)
    w, attrs = _expert_weight(c, names)
    return c.g.op("GgufExperts", [x, ids, w, _expert_bias(c, names)], domain=NATIVE, **attrs)


def _expert_weight(c: BuildContext, names: list[str]) -> tuple[str, dict[str, Any]]:
    """The experts of `names` (same type, same K), each expert's rows stacked in order, as
    GgufExperts' W initializer, and the op's attributes."""
    ts = [c.f.tensor(n + ".weight") for n in names]
    t0 = ts[0]
    if t0.type_name not in EXPERT_TYPE_IDS:
        raise GGUFError(f"{c.f.path}: {t0.name} is {t0.type_name}; experts are read as "
                        f"{', '.join(EXPERT_TYPE_IDS)}")
    n_expert, _, k = t0.shape
    rows = np.concatenate([_rows(t) for t in ts], axis=1)  # [n_expert, N, row bytes or K]
    name = "+".join(names) + ".experts"
    c.g.weight(name, expert_rows(t0.type_name, rows, k))
    return name, {"ggml_type": EXPERT_TYPE_IDS[t0.type_name], "K": k, "N": rows.shape[1]}


def _rows(t: TensorInfo) -> np.ndarray:
    """A 3-D tensor's rows [n_expert, N, row bytes] (float types: float32 [n_expert, N, K])."""
    n_expert, n, k = t.shape
    if t.type_name in DENSE_TYPES:
        return dense_float32(t).reshape(n_expert, n, k)
    return np.asarray(t.data, np.uint8).reshape(n_expert, n, -1)


def _expert_bias(c: BuildContext, names: list[str]) -> str:
    """The experts' biases [n_expert, N_0 + N_1 + ...] as one initializer, "" where none."""
    biases = [n + ".bias" for n in names]
    if not all(c.f.has_tensor(b) for b in biases):
        return ""
    vecs = [_float_rows(c, b) for b in biases]  # [n_expert, N_i] each
    return c.g.weight("+".join(biases), np.concatenate(vecs, axis=1))


def _float_rows(c: BuildContext, name: str) -> np.ndarray:
    """The 2-D GGUF tensor `name` as float32 [rows, cols] (the router, the experts' biases)."""
    t = c.f.tensor(name)
    if t.type_name not in DENSE_TYPES:
        raise GGUFError(f"{c.f.path}: {name} is {t.type_name}; specd reads it as "
                        f"{', '.join(DENSE_TYPES)}")
    return dense_float32(t).reshape(t.shape)
