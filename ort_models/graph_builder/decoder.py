"""The whole decoder graph: graph inputs, token embedding, the layers, the logits head
(the graph contract: the package docstring)."""

from __future__ import annotations

import numpy as np

from specd.ort_models.arch import HParams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.onnx_writer import GraphWriter

from .attention import AttentionInputs, attention, attention_inputs
from .context import BuildContext
from .linear import linear
from .mlp import feed_forward
from .moe import output_expert_ids
from .norms import add_norm, rms_norm
from .options import F32, I64, BuildOptions, Progress
from .sampling import sample_tokens
from .weights import matrix


def build_graph(f: GGUFFile, hp: HParams, g: GraphWriter, options: BuildOptions,
                progress: Progress | None = None) -> None:
    """Write the decoder graph of the GGUF model `f` into `g`."""
    c = BuildContext(g, hp, f, options, progress, total=hp.n_layer + 2)
    if options.embeddings_input:  # an image's rows: [S, E], not scaled (llama.cpp scales
        ids = g.input("input_embeds", F32, ["S", hp.n_embd])  # token rows only)
    else:
        ids = g.input("input_ids", I64, ["S"])
    if options.attention == "native":  # the rows of B sequences: (slot, position, rows)
        g.input("segments", I64, ["B", 3])
    else:
        g.input("position", I64, [1])
        g.input("attn_len", I64, [1])
    g.input("logits_rows", I64, ["R"])
    if options.embeddings_input:
        io = attention_inputs(c, ids, causal=options.causal, block_end=True)
        x = ids  # [S, E] residual stream
    else:
        io = attention_inputs(c, ids)
        x = embedding(c, ids)  # [S, E] residual stream
        if hp.embedding_scale is not None:
            x = g.op("Mul", [x, g.const(hp.embedding_scale, np.float32)])
    if hp.embedding_norm:  # muse-glimmer: an RMS norm without a weight, of every row
        x = rms_norm(c, x, g.const(np.ones(hp.n_embd, np.float32), np.float32))
    c.tick("embedding")
    delta: str | None = None  # the block output not yet added to x
    for i in range(hp.n_layer):
        x, delta = decoder_layer(c, i, x, delta, io)
        if i in options.hidden_layers:
            g.op("Add", [x, delta], out=[f"hidden_{i}"])
            g.output(f"hidden_{i}", F32, ["S", hp.n_embd])
        c.shared.clear()
        c.tick(f"layer {i + 1}/{hp.n_layer}")

    assert delta is not None
    g.op("Identity", [logits_head(c, x, delta)], out=["logits"])
    g.output("logits", F32, ["R", options.logits_width(hp.n_vocab)])
    if options.sampler:
        sample_tokens(g, "logits")
    output_expert_ids(c)
    c.tick("output")


def embedding(c: BuildContext, ids: str) -> str:
    """Rows of token_embd at `ids` [S] -> [S, E], dequantized exactly as
    gguf.quants.dequantize does."""
    src = "token_embd.weight"
    w = matrix(c, src, exact=True)
    # a re-quantized tied output must not share the lookup's initializers
    name = f"{src}.exact" if c.options.requant else src
    return w.lookup(c.g, name, ids)


def decoder_layer(c: BuildContext, i: int, x: str, delta: str | None, io: AttentionInputs
                  ) -> tuple[str, str]:
    """Block i on the residual stream x + delta [S, E] (delta None: x alone): returns the
    new (x, delta), the block's feed-forward output left to add (the next norm adds it)."""
    p = f"blk.{i}."
    x, h = add_norm(c, x, delta, p + "attn_norm.weight")
    a = attention(c, i, h, io)
    eps = c.hp.post_norm_eps
    if c.hp.post_norms:  # gemma: the attention and FFN outputs normed before each residual
        a = rms_norm(c, a, c.vector(p + "post_attention_norm.weight"), eps)
    x, h = add_norm(c, x, a, p + c.hp.ffn_norm + ".weight")
    f = feed_forward(c, h, p)
    if c.hp.post_norms:
        f = rms_norm(c, f, c.vector(p + "post_ffw_norm.weight"), eps)
    return x, f


def logits_head(c: BuildContext, x: str, delta: str) -> str:
    """Logits [R, width] of the rows `logits_rows` of the residual stream x + delta: the
    output norm and matrix (the first `vocab_rows` ids where the options cut it)."""
    g, hp = c.g, c.hp
    rows_x = g.op("Gather", [x, "logits_rows"], axis=0)  # [R, E]
    rows_d = g.op("Gather", [delta, "logits_rows"], axis=0)
    _, h = add_norm(c, rows_x, rows_d, "output_norm.weight", keep_sum=False)
    out_name = "token_embd.weight" if hp.tied_embeddings else "output.weight"
    width = c.options.logits_width(hp.n_vocab)
    if width < hp.n_vocab:  # the first ids only (drafts)
        head = f"output.first{width}.weight"
        c.shared[head] = matrix(c, out_name).first_rows(width)
        out_name = head
    logits = linear(c, h, out_name)  # [R, width]
    if hp.logit_scale is not None:  # muse-glimmer's output multiplier
        logits = g.op("Mul", [logits, g.const(hp.logit_scale, np.float32)])
    if hp.final_softcap is not None:  # cap * tanh(logits / cap)
        cap = g.const(hp.final_softcap, np.float32)
        logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])
    return logits
