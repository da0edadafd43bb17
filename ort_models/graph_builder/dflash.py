"""The two graphs of a DFlash-family head (DFlash, DSpark, DFlash2; `ort_models/heads.py`
reads its GGUF), over one draft KV cache that both bind:

injection  features [S, L*E_t] of S verified target tokens at `position`:
           g = RMSNorm_enc(fc · features); for every head layer K = RoPE(k_norm(W_k g)),
           V = W_v g, written into the cache at the tokens' positions. No logits. Beside
           a packing block graph (`packs_sequences`) it takes `positions` [S] instead, one
           per row, and returns each layer's rows `key_i`, `value_i` [S, Hkv*hd] rather
           than writing them: the rows of several sequences in one pass, the runner
           writing each into its slot (no cache input).
block      input_ids [B] = [last, MASK × (B - 1)] at `position`: the head's Qwen3-style
           layers, each row attending to all `attn_len` (= position + B) keys: the
           injected context and the whole block (not causal within it, unless the head
           says so); logits [R, vocab] of the rows `logits_rows` through the LM head (the
           target's unless the head has its own), scattered to target ids through `d2t`
           where the head drafts a reduced vocabulary (-inf elsewhere). A DSpark head's
           rows go through its Markov chain first (graph_builder/dspark.py), over the
           rows in the order given (packed: `row_anchors` [R], the anchor at each block's
           first read row, -1 elsewhere), and its confidence head adds `confidence` [R]. A
           DFlash2 head's layers add grouped convolutions, and its selector replaces the
           logits by the rows' top-k `candidates` [R, k] and their pair `scores`
           [R, k, k] (graph_builder/dflash2.py).

Graph inputs and outputs follow the decoder graph's contract (package docstring):
`position`, `attn_len`, `logits_rows`, past_/present_ key/value per layer. A DFlash block
on specd's attention (`packs_sequences`) takes `segments` [B, 3] (slot, position, rows)
instead of `position` and `attn_len`: the blocks of B sequences in one pass, each row
over its own slot's cache, the caches of every slot bound at once; `logits_rows` index
the packed rows; its injection graph returns the K/V rows of any sequences' tokens. A
head of an M-RoPE target takes its block rows' rope positions apart from where they are
written (`rope_positions` [4, S], only t read), and its injection returns its rows at
`positions` [S] however it attends: after an image it skips, its rows are not at their
rope positions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specd.ort_models.arch import HParams
from specd.ort_models.arch.rope_scaling import RopeScaling
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import HeadParams
from specd.ort_models.onnx_writer import GraphWriter

from .attention import (
    AttentionInputs,
    attention,
    attention_inputs,
    rotate,
    shared_value,
    write_kv_rows,
    written_rows_positions,
)
from .context import BuildContext
from .decoder import decoder_layer, embedding
from .dflash2 import dflash2_layer, output_transforms, selector_lattice
from .dspark import markov_chain
from .linear import linear
from .mlp import feed_forward
from .norms import add_norm, head_norm, rms_norm
from .options import ACCURACY_LEVEL, F32, I64, BuildOptions, Progress
from .pending import materialize
from .sampling import sample_tokens

BUILT_EXTRAS = ("conf_proj.bias", "rope_freqs.weight")  # optional tensors these graphs build
FEATURE_LIMIT = 65504.0  # non-finite or huge target features are clamped to float16's range


def head_hparams(head: HeadParams, target: HParams) -> HParams:
    """The head's decoder as HParams, over the target's vocabulary (the DFlash family's
    Qwen3-style layers have per-head q/k norms; EAGLE-3's llama layer has none). A
    DFlash-family head of an M-RoPE target rotates its block's rows at positions the
    runner gives (`rope_positions`, every rotary pair in the t section: one position per
    row): after an image it skipped, its K/V rows are not at their rope positions
    (daemon/drafters/dflash.py)."""
    given = target.mrope and head.kind != "eagle3"
    return HParams(arch="dflash", n_layer=head.n_layer, n_embd=head.n_embd,
                   n_head=head.n_head, n_head_kv=head.n_head_kv, head_dim=head.head_dim,
                   n_ff=head.n_ff, n_vocab=target.n_vocab, n_ctx_train=head.n_ctx_train,
                   rms_eps=head.rms_eps, rope_base=head.rope_base, rope_dim=head.rope_dim,
                   rope_interleaved=head.rope_interleaved, qk_norm=head.kind != "eagle3",
                   # llama.cpp's dflash graph: one rope for every layer, sliding or not
                   sliding_window=head.sliding_window,
                   swa_layers=head.sliding_window_pattern,
                   embedding_scale=head.embedding_scale,
                   attention_scale=head.attention_scale, ffn_act=head.hidden_act,
                   rope_scaling=RopeScaling("linear", 1.0 / head.rope_scaling_factor,
                                            head.n_ctx_train) if (
                       head.rope_scaling == "linear" and head.rope_scaling_factor) else None,
                   rope_freq_factors=head.rope_freq_factors,
                   rope_sections=(head.rope_dim // 2,) if given else ())


def packs_sequences(head: HeadParams, kernels: str) -> bool:
    """Whether the head's attending graph (DFlash's block, EAGLE-3's step) runs on specd's
    CachedAttention (a DFlash block not causal within itself) with `segments`, packing the
    calls of several sequences in one pass: where specd's kernels run (kernels "gguf") and
    the head_dim is whole lanes. Where a block's rows interact, each block restarts at
    its own first rows: DSpark's Markov chain and DFlash2's lattice at `row_anchors`,
    DFlash2's convolutions at `block_rows`. Not a head with sliding-window layers (the
    block's rows see the block after them, which specd's attention does not do within a
    window), nor one whose layers share K as V or have attention sinks (written out)."""
    return (kernels == "gguf" and head.head_dim % 8 == 0 and not head.sliding_window
            and not head.shared_kv
            and not any(name.endswith(ATTENTION_EXTRAS) for name in head.extra_tensors))


def head_options(target: HParams, accuracy_level: int = ACCURACY_LEVEL,
                 kernels: str = "ort", requant: str = "", sampler: bool = False,
                 packed: bool = False) -> BuildOptions:
    """Head graphs: attention written out (the block is not causal), float32 cache, rotary
    tables as long as the target's context; kernels "gguf": specd's GgufMatMul for the
    matrix types it reads (the others as ONNX Runtime's); requant "q4k": every matrix
    re-quantized to Q4_K for it, as drafts' are (the shared LM head included); sampler: a
    block's proposals chosen in the graph (SampleTokens after its logits); packed
    (`packs_sequences`): the block or step on specd's attention, taking `segments`."""
    return BuildOptions(attention="native" if packed else "exact", kv_dtype="f32",
                        max_positions=target.n_ctx_train,
                        accuracy_level=accuracy_level, kernels=kernels, requant=requant,
                        sampler=sampler)


# optional tensors of a DFlash-family layer these graphs build (llama.cpp's dflash graph):
# in its attention (every kind), and around it (DFlash and DSpark layers)
ATTENTION_EXTRAS = ("attn_sinks.weight",)
LAYER_EXTRAS = ("post_attention_norm.weight", "post_ffw_norm.weight",
                "layer_output_scale.weight")


def unsupported(head: HeadParams) -> list[str]:
    """What a head uses that these graphs do not build (empty: buildable), each naming the
    feature, and where llama.cpp's graph for the kind does not read it either."""
    out = []
    eagle = head.kind == "eagle3"
    if head.rope_scaling not in (None, "none", "linear"):
        out.append(f"rope scaling {head.rope_scaling}")
    if head.rope_sections:
        out.append("M-RoPE sections")
    if eagle:  # llama.cpp's eagle3 graph reads none of these: silu, 1/sqrt(hd), full attention
        out += [f"{name} (llama.cpp's eagle3 graph has none)" for name, value in (
            ("sliding-window attention", head.sliding_window),
            ("embedding scale", head.embedding_scale),
            ("attention scale", head.attention_scale),
            ("attention value scale", head.attention_value_scale)) if value]
    elif head.kind == "dflash2" and head.attention_value_scale is not None:
        out.append("attention value scale in a DFlash2 head")
    built = BUILT_EXTRAS if eagle else BUILT_EXTRAS + ATTENTION_EXTRAS + LAYER_EXTRAS
    extras = [name for name in head.extra_tensors if not name.endswith(built)]
    if head.kind == "dflash2":  # its layers (graph_builder/dflash2.py) have none of these
        extras += [name for name in head.extra_tensors if name.endswith(LAYER_EXTRAS)]
    if extras:
        out.append("tensors " + ", ".join(sorted(extras)))
    return out


def build_injection_graph(head_file: GGUFFile, head: HeadParams, target: HParams,
                          g: GraphWriter, options: BuildOptions,
                          progress: Progress | None = None) -> None:
    """Write the injection graph (module docstring) into `g`."""
    c = BuildContext(g, head_hparams(head, target), head_file, options, progress,
                     total=head.n_layer + 1)
    width = len(head.target_layers) * head.target_hidden_size
    features = g.input("features", F32, ["S", width])
    # rows out, the runner writes them (docstring); so too for an M-RoPE target, whose
    # head's rows are rotated at positions apart from where they are written
    packed = options.attention == "native" or c.hp.mrope
    pos_ids = written_rows_positions(c, features, packed)  # [1, S]
    finite = g.op("Where", [g.op("IsNaN", [features]), g.const(0.0, np.float32), features])
    x = g.op("Clip", [finite, g.const(-FEATURE_LIMIT, np.float32),
                      g.const(FEATURE_LIMIT, np.float32)])  # [S, L*E_t]
    fused = rms_norm(c, linear(c, x, "fc.weight"), c.vector("enc.output_norm.weight"))  # [S, E]
    c.tick("encoder")
    nkv = c.hp.n_head_kv
    for i in range(head.n_layer):
        p = f"blk.{i}."
        kp = linear(c, fused, p + "attn_k.weight")  # [S, Hkv*hd]
        k = head_norm(c, kp, nkv, p + "attn_k_norm.weight")
        k3 = rotate(c, g.op("Unsqueeze", [k, g.const([0])]), pos_ids, nkv)  # [1, S, Hkv*hd]
        v = (linear(c, fused, p + "attn_v.weight") if head_file.has_tensor(p + "attn_v.weight")
             else shared_value(c, kp))  # [S, Hkv*hd]
        write_kv_rows(c, i, k3, v, packed)
        c.shared.clear()
        c.tick(f"layer {i + 1}/{head.n_layer}")


def build_block_graph(head_file: GGUFFile, head: HeadParams, target_file: GGUFFile,
                      target: HParams, g: GraphWriter, options: BuildOptions,
                      progress: Progress | None = None) -> None:
    """Write the block graph (module docstring) into `g`; the token embeddings and the LM
    head come from the target's file where the head has none of its own."""
    c = BuildContext(g, head_hparams(head, target), head_file, options, progress,
                     total=head.n_layer + 2)
    # the target's tensors, for what the head shares (its own names do not clash: a head
    # has token_embd / output only where it does not share them)
    tc = BuildContext(g, target, target_file, dataclasses.replace(options, max_positions=0),
                      None)
    ids = g.input("input_ids", I64, ["S"])
    if options.attention == "native":  # the blocks of B sequences: (slot, position, rows)
        g.input("segments", I64, ["B", 3])
    else:
        g.input("position", I64, [1])
        g.input("attn_len", I64, [1])
    g.input("logits_rows", I64, ["R"])
    io = attention_inputs(c, ids, causal=head.causal)
    # packed blocks of a head whose rows interact (DSpark's chain, DFlash2's convolutions
    # and lattice): each block's first read row restarts at its anchor (-1 elsewhere),
    # and DFlash2's rows know their index in their block
    packed = options.attention == "native" and head.kind in ("dspark", "dflash2")
    row_anchors = g.input("row_anchors", I64, ["R"]) if packed else None
    block_rows = g.input("block_rows", I64, ["S"]) if packed and head.kind == "dflash2" else None
    x = embedding(c if head.has_token_embd else tc, ids)  # [S, E]
    if head.embedding_scale is not None:  # (Gemma targets' embeddings, shared unscaled)
        x = g.op("Mul", [x, g.const(head.embedding_scale, np.float32)])
    c.tick("embedding")
    normed = _layers_and_norm(c, head, x, io, block_rows)  # [R, E] the rows read, output-normed
    logits = lm_head(c if head.has_output else tc, normed)  # [R, draft vocab]
    anchor = g.op("Gather", [ids, g.const([0])], axis=0)  # [1] the block's first token
    if head.kind == "dspark":
        logits, confidence = markov_chain(c, head, logits, normed, anchor, row_anchors)
        if confidence is not None:
            g.op("Identity", [confidence], out=["confidence"])
            g.output("confidence", F32, ["R"])
    if head.kind == "dflash2":
        logits = output_transforms(c, head, logits)
    if head.draft_vocab is not None and head_file.has_tensor("d2t"):
        logits = scatter_to_target(c, logits, head_file, target.n_vocab)
    if head.kind == "dflash2":
        cand, scores = selector_lattice(c, head, logits, normed, anchor, row_anchors)
        k = head.selector_top_k
        g.op("Identity", [cand], out=["candidates"])
        g.output("candidates", I64, ["R", k])
        g.op("Identity", [scores], out=["scores"])
        g.output("scores", F32, ["R", k, k])
    else:
        g.op("Identity", [logits], out=["logits"])
        g.output("logits", F32, ["R", target.n_vocab])
        if options.sampler:
            sample_tokens(g, "logits")
    c.tick("output")


def _layers_and_norm(c: BuildContext, head: HeadParams, x: str, io: AttentionInputs,
                     block_rows: str | None = None) -> str:
    """The head's layers over the block x [S, E]; the rows `logits_rows` output-normed
    [R, E] (with the head's eps, whoever owns the LM head). block_rows: DFlash2's packed
    blocks."""
    g = c.g
    if head.kind == "dflash2":
        for i in range(head.n_layer):
            x = dflash2_layer(c, head, i, x, io, block_rows)
            c.shared.clear()
            c.tick(f"layer {i + 1}/{head.n_layer}")
        rows = g.op("Gather", [x, "logits_rows"], axis=0)  # [R, E]
        return rms_norm(c, rows, c.vector("output_norm.weight"))
    delta: str | None = None
    extras = head.attention_value_scale is not None or any(
        name.endswith(LAYER_EXTRAS) for name in head.extra_tensors)
    for i in range(head.n_layer):
        x, delta = (_layer_with_extras(c, head, i, x, delta, io) if extras
                    else decoder_layer(c, i, x, delta, io))
        c.shared.clear()
        c.tick(f"layer {i + 1}/{head.n_layer}")
    assert delta is not None
    rows_x = g.op("Gather", [x, "logits_rows"], axis=0)  # [R, E]
    rows_d = g.op("Gather", [delta, "logits_rows"], axis=0)
    _, h = add_norm(c, rows_x, rows_d, "output_norm.weight", keep_sum=False)
    return materialize(c, h)


def _layer_with_extras(c: BuildContext, head: HeadParams, i: int, x: str, delta: str | None,
                       io: AttentionInputs) -> tuple[str, str]:
    """`decoder_layer` with what llama.cpp's dflash layer adds where the head has it: the
    attention output scaled (attention.value_scale), the attention and FFN outputs
    RMSNorm'd before their residual adds (each where its post-norm tensor is), the layer's
    output scaled (layer_output_scale). Returns (x, delta) as decoder_layer does."""
    g, p = c.g, f"blk.{i}."
    x, h = add_norm(c, x, delta, p + "attn_norm.weight")
    a = attention(c, i, h, io)  # [S, E]
    if head.attention_value_scale is not None:
        a = g.op("Mul", [a, g.const(head.attention_value_scale, np.float32)])
    if c.f.has_tensor(p + "post_attention_norm.weight"):
        a = rms_norm(c, a, c.vector(p + "post_attention_norm.weight"))
    x, h = add_norm(c, x, a, p + "ffn_norm.weight")
    f = feed_forward(c, h, p)
    if c.f.has_tensor(p + "post_ffw_norm.weight"):
        f = rms_norm(c, f, c.vector(p + "post_ffw_norm.weight"))
    if not c.f.has_tensor(p + "layer_output_scale.weight"):
        return x, f
    scale = c.vector(p + "layer_output_scale.weight")  # [1]: (x + f) * scale, left as a pair
    return g.op("Mul", [x, scale]), g.op("Mul", [f, scale])


def lm_head(c: BuildContext, h: str) -> str:
    """Logits of the normed rows h through `c`'s file's output matrix (tied: its token
    embeddings)."""
    name = "output.weight" if c.f.has_tensor("output.weight") else "token_embd.weight"
    return linear(c, h, name)


def scatter_to_target(c: BuildContext, logits: str, head_file: GGUFFile, n_vocab: int
                       ) -> str:
    """Draft-vocabulary logits [R, Vd] at their target ids (`d2t`, absolute) in [R, n_vocab],
    -inf at every other id."""
    g = c.g
    raw = np.ascontiguousarray(head_file.tensor("d2t").data)  # I64, checked by read_head
    d2t = raw.view(np.int64).reshape(1, -1)  # [1, Vd]
    shape = g.op("Shape", [logits])  # [2]: R, Vd
    index = g.op("Expand", [g.weight("d2t", d2t), shape])  # [R, Vd]
    full_shape = g.op("Concat", [g.op("Shape", [logits], end=1), g.const([n_vocab])], axis=0)
    base = g.op("Expand", [g.const(-np.inf, np.float32), full_shape])  # [R, n_vocab]
    return g.op("ScatterElements", [base, index, logits], axis=1)
