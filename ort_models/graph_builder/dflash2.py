"""DFlash2's additions to a DFlash block (graph_builder/dflash.py builds the rest): the
grouped two-sided convolutions in its layers and the candidate selector after them.

Convolution (within the block, zero before its first row), on a layer's normed input
before attention (side 0) and on the attention output (side 1), and likewise around the
FFN, with coefficients of the normed input `dynamic` = conv_proj · h [S, 2·K·G]:

    out[t, c] = sum over taps k < K of (base[side, k, c] + dynamic[t, side, k, c // gs])
                                       · h[t - k, c]

(G groups of gs = E / G channels each). Selector, over the block rows read (`logits_rows`,
the first predicted from the block's anchor, each next from the row before): each row's
top-k candidates by logit, and the score of every (predecessor, successor) pair of
candidates,

    score[r, p, s] = logit[r, cand[r, s]] + sum_j succ[cand[r, s], j] · prev[pred[r, p], j]
                                                  · (selector_hidden · h_r)[j]

with pred[0, :] the anchor token and pred[r, :] = cand[r - 1, :]. The drafter walks the
lattice from the anchor by argmax, as llama.cpp does on the host.

Several blocks packed in one pass (`block_rows` [S], each row's index in its block, and
`row_anchors` [R], each block's anchor at its first read row, -1 elsewhere): the
convolutions read zero before each block's first row, and each block's first read row
takes its own anchor as predecessor.
"""

from __future__ import annotations

import numpy as np

from specd.ort_models.heads import HeadParams
from specd.ort_models.quant import dense_float32

from .attention import AttentionInputs, attention
from .context import BuildContext
from .linear import linear
from .mlp import feed_forward
from .norms import rms_norm
from .weights import matrix


def dflash2_layer(c: BuildContext, head: HeadParams, i: int, x: str, io: AttentionInputs,
                  block_rows: str | None = None) -> str:
    """Block i of a DFlash2 head on the residual stream x [S, E] -> the new stream
    (block_rows: packed blocks, module docstring)."""
    g, p = c.g, f"blk.{i}."
    h = rms_norm(c, x, c.vector(p + "attn_norm.weight"))  # [S, E]
    dynamic = linear(c, h, p + "attn_conv_proj.weight")  # [S, 2*K*G]
    h = block_conv(c, head, h, dynamic, p + "attn_conv_base", 0, block_rows)
    a = block_conv(c, head, attention(c, i, h, io), dynamic, p + "attn_conv_base", 1,
                   block_rows)
    x = g.op("Add", [x, a])
    f = rms_norm(c, x, c.vector(p + "ffn_norm.weight"))
    dynamic = linear(c, f, p + "ffn_conv_proj.weight")
    f = block_conv(c, head, f, dynamic, p + "ffn_conv_base", 0, block_rows)
    out = block_conv(c, head, feed_forward(c, f, p), dynamic, p + "ffn_conv_base", 1,
                     block_rows)
    return g.op("Add", [x, out])


def block_conv(c: BuildContext, head: HeadParams, h: str, dynamic: str, base_name: str,
               side: int, block_rows: str | None = None) -> str:
    """The grouped convolution (module docstring) of h [S, E] on `side` -> [S, E];
    block_rows [S] (packed blocks): a row reads zero where the tap reaches before its
    block."""
    g = c.g
    taps, gs, e = head.conv_kernel_size, head.conv_group_size, head.n_embd
    groups = e // gs
    base = dense_float32(c.f.tensor(base_name)).reshape(2, taps, e)[side]  # [K, E]
    coeff = g.op("Gather", [g.op("Reshape", [dynamic, g.const([0, 2, taps, groups])]),
                            g.const(side)], axis=1)  # [S, K, G]
    coeff = g.op("Expand", [g.op("Unsqueeze", [coeff, g.const([-1])]),
                            g.const([1, 1, 1, gs])])  # [S, K, G, gs]
    weight = g.op("Add", [g.op("Reshape", [coeff, g.const([0, taps, e])]),
                          g.weight(f"{base_name}.{side}", base)])  # [S, K, E]
    s_len = g.op("Shape", [h], end=1)  # [1]
    out = ""
    for tap in range(taps):
        w = g.op("Gather", [weight, g.const(tap)], axis=1)  # [S, E]
        shifted = h if tap == 0 else g.op("Slice", [
            g.op("Pad", [h, g.const([tap, 0, 0, 0])]), g.const([0]), s_len, g.const([0])])
        if tap and block_rows is not None:  # zero, as the Pad's, before each block
            inside = g.op("Unsqueeze", [g.op("GreaterOrEqual", [block_rows, g.const(tap)]),
                                        g.const([1])])  # [S, 1]
            shifted = g.op("Where", [inside, shifted, g.const(0.0, np.float32)])
        term = g.op("Mul", [w, shifted])  # row t reads row t - tap (zero before the block)
        out = term if not out else g.op("Add", [out, term])
    return out


def selector_lattice(c: BuildContext, head: HeadParams, logits: str, hidden: str,
                     anchor: str, row_anchors: str | None = None) -> tuple[str, str]:
    """The read rows' candidates [R, k] (int64 token ids, best logit first) and pair scores
    [R, k (predecessor), k (successor)] (module docstring), from their logits [R, V] and
    normed hidden states [R, E]; anchor [1] the block's first token (row_anchors [R],
    packed blocks: each block's anchor at its first read row, -1 elsewhere)."""
    g, k = c.g, head.selector_top_k
    unary, cand = g.op("TopK", [logits, g.const([k])], n_out=2, axis=1, largest=1,
                       sorted=1)  # [R, k], [R, k]
    n_rows = g.op("Shape", [cand], end=1)  # [1]
    first = g.op("Expand", [g.op("Unsqueeze", [anchor, g.const([0])]),
                            g.const([1, k])])  # [1, k]
    earlier = g.op("Slice", [cand, g.const([0]), g.op("Sub", [n_rows, g.const([1])]),
                             g.const([0])])  # [R - 1, k]
    pred = g.op("Concat", [first, earlier], axis=0)  # [R, k]
    if row_anchors is not None:  # each block's first read row: its own anchor
        own = g.op("Expand", [g.op("Unsqueeze", [row_anchors, g.const([1])]),
                              g.const([1, k])])  # [R, k]
        pred = g.op("Where", [g.op("GreaterOrEqual", [own, g.const(0)]), own, pred])
    prev = _rows(c, "selector_predecessor.weight", pred)  # [R, k, rank]
    succ = _rows(c, "selector_successor.weight", cand)  # [R, k, rank]
    gate = g.op("Unsqueeze", [linear(c, hidden, "selector_hidden.weight"), g.const([1])])
    pair = g.op("MatMul", [g.op("Mul", [prev, gate]),
                           g.op("Transpose", [succ], perm=[0, 2, 1])])  # [R, k, k]
    scores = g.op("Add", [pair, g.op("Unsqueeze", [unary, g.const([1])])])
    return cand, scores


def _rows(c: BuildContext, name: str, ids: str) -> str:
    """Rows of the table `name` [V, rank] at ids [R, k] -> [R, k, rank] float32."""
    g = c.g
    flat = matrix(c, name, exact=True).lookup(g, name, g.op("Reshape", [ids, g.const([-1])]))
    shape = g.op("Concat", [g.op("Shape", [ids]), g.const([-1])], axis=0)
    return g.op("Reshape", [flat, shape])


def output_transforms(c: BuildContext, head: HeadParams, logits: str) -> str:
    """logit_scale and final soft-capping, which DFlash2's selector reads its logits
    through (llama.cpp applies them there only)."""
    g = c.g
    if head.logit_scale is not None:
        logits = g.op("Mul", [logits, g.const(head.logit_scale, np.float32)])
    if head.final_logit_softcapping is not None:
        cap = g.const(head.final_logit_softcapping, np.float32)
        logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])
    return logits
