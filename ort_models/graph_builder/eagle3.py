"""The three graphs of an EAGLE-3 head (`ort_models/heads.py` reads its GGUF), over its own
one-layer KV cache:

encode  features [S, 3*E_t] of S target tokens (the three target layers' hidden states,
        concatenated) -> g [S, E] = fc · features (RMSNorm'd first where the head says
        `norm_before_fc`).
pair    input_ids [S] and g [S, E] at `position`: the K/V rows of those pairs (what the step
        graph writes for them; a row's K/V depend on its own input only), written into the
        cache, for the verified tokens: no attention, FFN or logits.
step    input_ids [S] and g [S, E] at `position`: the row at position P pairs the token at
        P + 1 with g of position P. Its one decoder layer reads
        [RMSNorm(embed(token)) ; RMSNorm_2(g)] (q/k/v take 2E inputs), attends causally
        over its cache, adds the residual g (its norm where `norm_before_residual`), and
        its FFN; `hidden` [R, E] is that pre-norm output of the rows `logits_rows` (the next
        step's g while drafting) and `logits` [R, vocab] their logits through output_norm
        and the LM head (the head's own over a reduced vocabulary, scattered to target ids
        through `d2t`; else the target's).

Graph inputs and outputs follow the decoder graph's contract (package docstring):
`position`, `attn_len`, `logits_rows`, past_/present_ key/value of the one layer. On
specd's attention (`dflash.packs_sequences`) the step takes `segments` [B, 3] (slot,
position, rows) instead of `position` and `attn_len`: the steps of B sequences in one
pass, each row over its own slot's cache, the caches of every slot bound at once; and
the pair graph takes `positions` [S], one per row, and returns the rows `key_0`, `value_0`
[S, Hkv*hd] rather than writing them: the pairs of several sequences in one pass, the
runner writing each into its slot (no cache input).
"""

from __future__ import annotations

import dataclasses

from specd.ort_models.arch import HParams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import HeadParams
from specd.ort_models.onnx_writer import GraphWriter

from .attention import (
    attention,
    attention_inputs,
    rotate,
    write_kv_rows,
    written_rows_positions,
)
from .context import BuildContext
from .decoder import embedding
from .dflash import head_hparams, lm_head, scatter_to_target
from .linear import linear
from .mlp import feed_forward
from .norms import rms_norm
from .options import F32, I64, BuildOptions, Progress
from .sampling import sample_tokens


def build_encode_graph(head_file: GGUFFile, head: HeadParams, target: HParams,
                       g: GraphWriter, options: BuildOptions,
                       progress: Progress | None = None) -> None:
    """Write the encode graph (module docstring) into `g`."""
    c = BuildContext(g, head_hparams(head, target), head_file, options, progress, total=1)
    width = len(head.target_layers) * head.target_hidden_size
    x = g.input("features", F32, ["S", width])
    if head.norm_before_fc:
        x = rms_norm(c, x, c.vector("enc.output_norm.weight"))
    g.op("Identity", [linear(c, x, "fc.weight")], out=["g"])  # [S, E]
    g.output("g", F32, ["S", head.n_embd])
    c.tick("encoder")


def build_pair_graph(head_file: GGUFFile, head: HeadParams, target_file: GGUFFile,
                     target: HParams, g: GraphWriter, options: BuildOptions,
                     progress: Progress | None = None) -> None:
    """Write the pair graph (module docstring) into `g`."""
    c = BuildContext(g, head_hparams(head, target), head_file, options, progress, total=1)
    tc = BuildContext(g, target, target_file, dataclasses.replace(options, max_positions=0),
                      None)
    ids = g.input("input_ids", I64, ["S"])
    packed = options.attention == "native"  # rows out, the runner writes them (docstring)
    pos_ids = written_rows_positions(c, ids, packed)  # [1, S]
    x = _layer_input(c, tc, head, ids, g.input("g", F32, ["S", head.n_embd]))[0]
    k = g.op("Unsqueeze", [linear(c, x, "blk.0.attn_k.weight"), g.const([0])])
    k3 = rotate(c, k, pos_ids, head.n_head_kv)  # [1, S, Hkv*hd]
    v = linear(c, x, "blk.0.attn_v.weight")  # [S, Hkv*hd]
    write_kv_rows(c, 0, k3, v, packed)
    c.tick("layer")


def _layer_input(c: BuildContext, tc: BuildContext, head: HeadParams, ids: str, feats: str
                 ) -> tuple[str, str]:
    """The layer's input [RMSNorm(embed(ids)) ; RMSNorm_2(g)] [S, 2E] and its residual."""
    g, p = c.g, "blk.0."
    embd = rms_norm(c, embedding(c if head.has_token_embd else tc, ids),
                    c.vector(p + "attn_norm.weight"))  # [S, E]
    g_norm = rms_norm(c, feats, c.vector(p + "attn_norm_2.weight"))  # [S, E]
    x = g.op("Concat", [embd, g_norm], axis=1)  # [S, 2E]
    return x, g_norm if head.norm_before_residual else feats


def build_step_graph(head_file: GGUFFile, head: HeadParams, target_file: GGUFFile,
                     target: HParams, g: GraphWriter, options: BuildOptions,
                     progress: Progress | None = None) -> None:
    """Write the step graph (module docstring) into `g`; the token embeddings and the LM
    head come from the target's file where the head has none of its own."""
    c = BuildContext(g, head_hparams(head, target), head_file, options, progress, total=2)
    tc = BuildContext(g, target, target_file, dataclasses.replace(options, max_positions=0),
                      None)
    ids = g.input("input_ids", I64, ["S"])
    feats = g.input("g", F32, ["S", head.n_embd])
    if options.attention == "native":  # the rows of B sequences: (slot, position, rows)
        g.input("segments", I64, ["B", 3])
    else:
        g.input("position", I64, [1])
        g.input("attn_len", I64, [1])
    g.input("logits_rows", I64, ["R"])
    io = attention_inputs(c, ids)
    p = "blk.0."
    x, residual = _layer_input(c, tc, head, ids, feats)
    ffn_in = g.op("Add", [attention(c, 0, x, io), residual])
    h = rms_norm(c, ffn_in, c.vector(p + "ffn_norm.weight"))
    hidden = g.op("Add", [feed_forward(c, h, p), ffn_in])  # [S, E] pre-norm
    c.shared.clear()
    c.tick("layer")
    rows = g.op("Gather", [hidden, "logits_rows"], axis=0)  # [R, E]
    g.op("Identity", [rows], out=["hidden"])
    g.output("hidden", F32, ["R", head.n_embd])
    normed = rms_norm(c, rows, c.vector("output_norm.weight"))
    logits = lm_head(c if head.has_output else tc, normed)  # [R, draft vocab]
    if head.draft_vocab is not None:
        logits = scatter_to_target(c, logits, head_file, target.n_vocab)
    g.op("Identity", [logits], out=["logits"])
    g.output("logits", F32, ["R", target.n_vocab])
    if options.sampler:
        sample_tokens(g, "logits")
    c.tick("output")
