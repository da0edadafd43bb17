"""DSpark's Markov and confidence heads over a DFlash block's rows (graph_builder/dflash.py
builds the rest of the block).

For the block's read rows r = 0, 1, ... in order, with prev_0 the block's first token (the
anchor) and prev_{r+1} the argmax of row r's biased logits:

    logits_r     = base_r + W2 · W1[prev_r]                     (the Markov bias)
    confidence_r = sigmoid(conf_proj · [h_r ; W1[prev_r]] + b)   (where the head has one)

base_r: the row's logits through the LM head, in the head's own vocabulary (its draft
vocabulary where `d2t` reduces it: the chain's argmax is a draft row, mapped through d2t
to the target id the next W1 row is read at); h_r: the row's output-normed hidden state.
The rows of several blocks packed in one pass (`row_anchors`) restart the chain at each
block's first row with its own anchor. The chain runs as an ONNX Loop over the rows,
conditioned on the argmax whatever the request samples, as llama.cpp's graph does: each
row's distribution is still a fixed function of the context, so sampling from it and
verifying by rejection stays exact.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from specd.ort_models.heads import HeadParams
from specd.ort_models.quant import float_rows, load_matrix

from .context import BuildContext
from .linear import linear
from .options import F32, I64
from .weights import matrix

BOOL = TensorProto.BOOL


def markov_chain(c: BuildContext, head: HeadParams, base: str, hidden: str, anchor: str,
                 row_anchors: str | None = None) -> tuple[str, str | None]:
    """The biased logits [R, Vd] of the rows base [R, Vd] (hidden [R, E] their normed
    states, anchor [1] the block's first token) and their confidences [R] (None: the head
    has no confidence head). row_anchors [R] (the rows of several blocks packed): where
    >= 0, the row's prev is that anchor instead of the last row's argmax."""
    g = c.g
    names = {k: g.fresh(f"markov_{k}") for k in ("i", "cond", "prev")}
    inputs = [helper.make_tensor_value_info(names["i"], I64, []),
              helper.make_tensor_value_info(names["cond"], BOOL, []),
              helper.make_tensor_value_info(names["prev"], I64, [1])]
    outs = {k: g.fresh(f"markov_{k}_out") for k in ("cond", "prev", "logits", "conf")}
    out_infos = [helper.make_tensor_value_info(outs["cond"], BOOL, []),
                 helper.make_tensor_value_info(outs["prev"], I64, [1]),
                 helper.make_tensor_value_info(outs["logits"], F32, [1, None])]
    if head.has_confidence_head:
        out_infos.append(helper.make_tensor_value_info(outs["conf"], F32, [1]))
    c.shared.clear()
    with g.body("markov_step", inputs, out_infos) as body:
        prev = names["prev"]  # [1]
        if row_anchors is not None:  # a block's first row: its anchor
            a = g.op("Gather", [row_anchors, g.op("Unsqueeze", [names["i"], g.const([0])])],
                     axis=0)  # [1]
            prev = g.op("Where", [g.op("GreaterOrEqual", [a, g.const([0])]), a, prev])
        w1 = matrix(c, "markov_w1.weight", exact=True).lookup(
            g, "markov_w1.weight", prev)  # [1, rank]
        row = g.op("Gather", [base, g.op("Unsqueeze", [names["i"], g.const([0])])],
                   axis=0)  # [1, Vd]
        g.op("Add", [row, linear(c, w1, "markov_w2.weight")], out=[outs["logits"]])
        best = g.op("ArgMax", [outs["logits"]], axis=1, keepdims=0)  # [1]: a draft row
        if head.draft_vocab is not None:
            d2t = np.ascontiguousarray(c.f.tensor("d2t").data).view(np.int64)  # [Vd]
            g.op("Gather", [g.weight("markov.d2t", d2t), best], axis=0, out=[outs["prev"]])
        else:
            g.op("Identity", [best], out=[outs["prev"]])
        g.op("Identity", [names["cond"]], out=[outs["cond"]])
        if head.has_confidence_head:
            _confidence(c, hidden, names["i"], w1, outs["conf"])
    c.shared.clear()
    trips = g.op("Shape", [base], end=1)  # [1]: R
    trip = g.op("Squeeze", [trips, g.const([0])])
    # outputs: the last prev, then the scanned rows [R, 1, Vd] (and confidences [R, 1])
    n_out = 3 if head.has_confidence_head else 2
    results = g.op("Loop", [trip, g.const(True, np.bool_), anchor], n_out=n_out,
                   body=body[0])
    shape = g.op("Concat", [trips, g.const([-1])], axis=0)
    logits = g.op("Reshape", [results[1], shape])  # [R, Vd]
    conf = g.op("Reshape", [results[2], trips]) if head.has_confidence_head else None  # [R]
    return logits, conf


def _confidence(c: BuildContext, hidden: str, i: str, w1: str, out: str) -> None:
    """sigmoid(conf_proj · [hidden[i] ; w1] + bias) -> out [1]."""
    g = c.g
    weight = float_rows(load_matrix(c.f.tensor("conf_proj.weight")))  # [1, E + rank]
    if not g.has("conf_proj.W"):
        g.weight("conf_proj.W", np.ascontiguousarray(weight.T))  # [E + rank, 1]
    h = g.op("Gather", [hidden, g.op("Unsqueeze", [i, g.const([0])])], axis=0)  # [1, E]
    z = g.op("MatMul", [g.op("Concat", [h, w1], axis=1), "conf_proj.W"])  # [1, 1]
    if c.f.has_tensor("conf_proj.bias"):
        z = g.op("Add", [z, c.vector("conf_proj.bias")])
    g.op("Reshape", [g.op("Sigmoid", [z]), g.const([1])], out=[out])
