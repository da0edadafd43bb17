"""Self-attention over the KV cache, in the three kinds BuildOptions.attention names:
"exact" written out (TensorScatter + MatMul + Softmax, row-invariant), "fused"
(GroupQueryAttention) and "native" (specd's CachedAttention)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from specd.ort_models.arch import HParams
from specd.ort_models.arch.rope_scaling import rope_cos_sin
from specd.ort_models.native_ops import DOMAIN as NATIVE
from specd.ort_models.onnx_writer import MS, GraphWriter

from .context import BuildContext
from .linear import grouped_linears, linear, linears, split
from .mrope import MROPE, mrope_rows
from .norms import head_norm, rms_norm
from .options import F16, F32, I64
from .pending import Activation


@dataclass
class AttentionInputs:
    """What every layer's attention shares, built once per graph; a kind's tensors are ""
    where the graph uses another kind."""

    pos_ids: str  # [1, S] positions of the new tokens ("" on native attention); M-RoPE:
    # the rows' indices into their own tables (mrope.py)
    s_len: str  # [1] S
    mask: str = ""  # exact: [S, T] additive causal mask
    mask_swa: str = ""  # exact, sliding-window layers: the causal mask within the window
    shape4: str = ""  # exact: [Hkv, G, -1, attn_len]
    shape3: str = ""  # exact: [Hkv, -1, attn_len]
    qpad: str = ""  # exact, group size 1: a zero query row [Hkv, 1, hd]
    ppad: str = ""  # exact, group size 1: zero probabilities [Hkv, 1, attn_len]
    seqlens_k: str = ""  # fused: int32 [1] pos + S - 1
    total_len: str = ""  # fused: int32 scalar pos + S
    causal: bool = True  # False: a row sees its whole block (exact and native only)


def rope_tables(hp: HParams, max_pos: int, base: float | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_pos, rope_dim/2] float32 of the rotary angles (base: the rope base,
    default the model's), scaled as the model's rope scaling says."""
    base = hp.rope_base if base is None else base
    return rope_cos_sin(hp.rope_scaling, max_pos, hp.rope_dim, base, hp.rope_freq_factors)


def rotary_positions(c: BuildContext, s_len: str) -> str:
    """The positions [1, S] of S new tokens from the graph input `position` (s_len: [1] S),
    and the rotary tables (`rotary_tables`)."""
    g = c.g
    pos_ids = g.op("Unsqueeze", [g.op("Add", [g.op("Range", [
        g.const(0), g.op("Squeeze", [s_len, g.const([0])]), g.const(1)]), "position"]),
        g.const([0])])  # [1, S]
    rotary_tables(c)
    return pos_ids


def written_rows_positions(c: BuildContext, rows: str, packed: bool) -> str:
    """The positions [1, S] of rows [S, ...] whose K/V a graph writes (a head's injection
    or pairs), and the rotary tables: given per row by the graph input `positions` where
    the runner writes the rows (`packed`, `write_kv_rows`), else counted from `position`."""
    g = c.g
    if packed:
        pos_ids = g.op("Unsqueeze", [g.input("positions", I64, ["S"]), g.const([0])])
        rotary_tables(c)
        return pos_ids
    g.input("position", I64, [1])
    return rotary_positions(c, g.op("Shape", [rows], end=1))


def rotary_tables(c: BuildContext) -> None:
    """The rotary tables as initializers: rope.cos / rope.sin, and rope_swa.cos /
    rope_swa.sin where sliding-window layers have a rope base of their own."""
    g, hp = c.g, c.hp
    if g.has("rope.cos"):  # written already (M-RoPE's tables read them)
        return
    max_pos = c.options.max_positions or hp.n_ctx_train
    bases = {"rope": hp.rope_base} | {rope_table(hp, i): hp.rope_base_of(i)
                                       for i in range(hp.n_layer)
                                       if hp.uses_rope(i) and not hp.mrope}
    for name, base in bases.items():
        cos, sin = rope_tables(hp, max_pos, base)
        g.weight(f"{name}.cos", cos)
        g.weight(f"{name}.sin", sin)
    if hp.mrope or not all(hp.uses_rope(i) for i in range(hp.n_layer)):
        # layers without RoPE, or rotated before it (M-RoPE), specd's attention rotates
        # 0 dims: empty tables [P, 0]
        empty = g.const(np.zeros((max_pos, 0), np.float32), np.float32)
        for part in ("cos", "sin"):
            g.op("Identity", [empty], out=[f"{NOPE}.{part}"])


NOPE = "nope"  # the empty rotary tables of layers without RoPE


def rope_table(hp: HParams, layer: int) -> str:
    """The name of the rotary tables `layer` reads (their .cos and .sin)."""
    if not hp.uses_rope(layer):
        return NOPE
    if hp.mrope:
        return MROPE
    return "rope_swa" if hp.rope_base_of(layer) != hp.rope_base else "rope"


def rotate(c: BuildContext, x3: str, pos_ids: str, n_heads: int, table: str = "rope") -> str:
    """RoPE of x3 [1, S, n_heads*hd] at `pos_ids` [1, S] with the tables rotary_positions
    wrote (`table`: their name)."""
    hp = c.hp
    return c.g.op("RotaryEmbedding", [x3, pos_ids, f"{table}.cos", f"{table}.sin"],
                  domain=MS, interleaved=int(hp.rope_interleaved),
                  rotary_embedding_dim=hp.rope_dim, num_heads=n_heads)


def kv_cache_io(c: BuildContext, i: int) -> None:
    """Layer i's cache buffers as graph inputs (past_*) and outputs (present_*); on specd's
    attention, those of every sequence slot (rows of several sequences run in one call,
    each over its slot: the graph input `segments`), and a sliding-window layer's may be
    a shorter ring (`n_ring` rows)."""
    g, hp = c.g, c.hp
    kv_type = F16 if c.options.kv_dtype == "f16" else F32
    native = c.options.attention == "native"
    rows = "n_ring" if hp.is_swa(i) and native else "n_ctx"
    shape = ["n_seq" if native else 1, hp.n_head_kv, rows, hp.head_dim]
    for name in (f"past_key_{i}", f"past_value_{i}"):
        g.input(name, kv_type, shape)
    for name in (f"present_key_{i}", f"present_value_{i}"):
        g.output(name, kv_type, shape)


def attention_inputs(c: BuildContext, ids: str, *, causal: bool = True,
                     block_end: bool = False) -> AttentionInputs:
    """The new tokens' positions, the rotary tables (rope.cos, rope.sin) and what the
    graph's kind of attention needs besides, from the graph inputs `ids` ([S], or [S, *]:
    its rows are the new tokens), `position` and `attn_len` (native: `segments`).
    causal=False (exact or native attention): every new row attends to all `attn_len` keys
    (native: its segment's), later rows of its block included. block_end (`ids` [S, *]):
    exact attention masks the keys past the block's last row, and a sliding-window layer
    the keys a window back from each row (a row's view is then the native kernel's)."""
    g, hp = c.g, c.hp
    rows_2d = not causal or block_end
    s_len = g.op("Shape", [ids], end=1) if rows_2d else g.op("Shape", [ids])  # [1]
    if not causal and c.options.attention not in ("exact", "native"):
        raise ValueError("attention over a whole block (not causal) is written out or "
                         "specd's: attention 'exact' or 'native', not "
                         f"{c.options.attention!r}")
    if c.options.attention == "native":  # CachedAttention takes `segments`, masks by itself
        rotary_tables(c)
        return AttentionInputs(mrope_rows(c, s_len) if hp.mrope else "", s_len, causal=causal)
    io = AttentionInputs(mrope_rows(c, s_len) if hp.mrope else rotary_positions(c, s_len),
                         s_len)
    if c.options.attention == "fused":  # GroupQueryAttention's int32 lengths; it masks itself
        end = g.op("Cast", [g.op("Add", ["position", s_len])], to=TensorProto.INT32)
        io.seqlens_k = g.op("Sub", [end, g.const([1], np.int32)])  # [1]
        io.total_len = g.op("Squeeze", [end, g.const([0])])  # scalar
        return io
    nkv, grp = hp.n_head_kv, hp.group_size
    io.shape4 = g.op("Concat", [g.const([nkv, grp, -1]), "attn_len"], axis=0)
    io.shape3 = g.op("Concat", [g.const([nkv, -1]), "attn_len"], axis=0)
    if grp == 1:
        io.qpad = g.const(np.zeros((nkv, 1, hp.head_dim), np.float32), np.float32)
        t_len = g.op("Concat", [g.const([nkv, 1]), "attn_len"], axis=0)
        io.ppad = g.op("ConstantOfShape", [t_len], value=_f32_tensor(0.0))
    swa = hp.sliding_window and any(hp.is_swa(i) for i in range(hp.n_layer))
    if block_end and not causal:
        io.causal = False
        io.mask = _causal_mask(g, s_len, whole_block=True)
        if swa:
            io.mask_swa = _causal_mask(g, s_len, hp.sliding_window, whole_block=True)
        return io
    io.mask = _causal_mask(g, s_len) if causal else g.const(0.0, np.float32)
    if swa:  # (a drafter head's block, not causal: every key up to its end, in the window)
        io.mask_swa = _causal_mask(g, s_len, hp.sliding_window, whole_block=not causal)
    return io


def attention(c: BuildContext, i: int, h: Activation, io: AttentionInputs) -> str:
    """Layer i's attention block for its normed input h: the q/k/v products, the cache
    update (graph inputs past_key_i / past_value_i, outputs present_key_i /
    present_value_i) and the output product -> [S, n_embd]."""
    g, hp = c.g, c.hp
    hd, nkv = hp.head_dim, hp.n_head_kv
    p = f"blk.{i}."
    names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    kv_cache_io(c, i)
    if not c.f.has_tensor(names[2]):  # a drafter head's layer without attn_v
        return linear(c, _attention_shared_kv(c, i, h, io, names[:2]),
                      p + "attn_output.weight")
    if c.options.attention == "native" and not hp.qk_norm and not hp.mrope:
        # CachedAttention reads q, k and v out of the stacked products, no Split between
        return linear(c, _cached_attention(c, i, grouped_linears(c, h, names), io.causal),
                      p + "attn_output.weight")
    gate_names = [p + "attn_gate.weight"] if hp.attn_gate else []
    # [S, H*hd], [S, Hkv*hd], [S, Hkv*hd] (and the gate's [S, H*hd])
    q, k, v, *gate = linears(c, h, names + gate_names)
    if hp.qk_norm:
        q = head_norm(c, q, hp.n_head, p + "attn_q_norm.weight")
        k = head_norm(c, k, nkv, p + "attn_k_norm.weight")
    if c.options.attention == "native":
        if hp.mrope:  # each row by its four positions, here: the kernel takes one
            q, k = (_rotate_rows(c, t, n, io) for t, n in ((q, hp.n_head), (k, nkv)))
        out = _cached_attention(c, i, [(q, names[:1]), (k, names[1:2]), (v, names[2:])],
                                io.causal)
        return linear(c, gated(c, out, gate), p + "attn_output.weight")
    q3, k3 = (g.op("Unsqueeze", [t, g.const([0])]) for t in (q, k))  # [1, S, *]
    fused = c.options.attention == "fused"
    v3 = g.op("Unsqueeze", [v, g.const([0])]) if fused else ""
    if fused and hp.rope_dim == hd and hp.uses_rope(i) and not hp.mrope:
        out = _fused_attention(c, i, q3, k3, v3, io, rotary=True)
    else:
        if hp.uses_rope(i):
            table = rope_table(hp, i)
            q3 = rotate(c, q3, io.pos_ids, hp.n_head, table)  # [1, S, H*hd]
            k3 = rotate(c, k3, io.pos_ids, nkv, table)
        if fused:
            out = _fused_attention(c, i, q3, k3, v3, io, rotary=False)
        else:
            out = _exact_attention(c, i, q3, k3, v, io)
    return linear(c, gated(c, out, gate), p + "attn_output.weight")


def _rotate_rows(c: BuildContext, x: str, n_heads: int, io: AttentionInputs) -> str:
    """x [S, n_heads*hd] rotated by each row's M-RoPE positions -> [S, n_heads*hd]."""
    g = c.g
    x3 = rotate(c, g.op("Unsqueeze", [x, g.const([0])]), io.pos_ids, n_heads, MROPE)
    return g.op("Squeeze", [x3, g.const([0])])


def gated(c: BuildContext, out: str, gate: list[str]) -> str:
    """The attention output [S, H*hd] times sigmoid of the gate's product (muse-glimmer's
    output gate), or as it is where the model has none (`gate` empty)."""
    if not gate:
        return out
    return c.g.op("Mul", [out, c.g.op("Sigmoid", [gate[0]])])


def shared_value(c: BuildContext, k: str) -> str:
    """The values of a layer without attn_v, from its key product k [S, Hkv*hd] before
    its norm and rotary (llama.cpp's dflash layers): each head's RMSNorm, unweighted."""
    g, hp = c.g, c.hp
    name = "shared_kv.ones"
    ones = name if g.has(name) else g.weight(name, np.ones(hp.head_dim, np.float32))
    y = rms_norm(c, g.op("Reshape", [k, g.const([0, hp.n_head_kv, hp.head_dim])]), ones)
    return g.op("Reshape", [y, g.const([0, hp.n_head_kv * hp.head_dim])])


def _attention_shared_kv(c: BuildContext, i: int, h: Activation, io: AttentionInputs,
                         names: list[str]) -> str:
    """Written-out attention of a layer whose values are its keys (`shared_value`) ->
    [S, H*hd]."""
    if c.options.attention != "exact":
        raise ValueError(f"blk.{i} has no attn_v: its shared K/V attention is written out "
                         f"(attention 'exact'), not {c.options.attention!r}")
    g, hp = c.g, c.hp
    p = f"blk.{i}."
    q, k = linears(c, h, names)  # [S, H*hd], [S, Hkv*hd]
    v = shared_value(c, k)
    if hp.qk_norm:
        q = head_norm(c, q, hp.n_head, p + "attn_q_norm.weight")
        k = head_norm(c, k, hp.n_head_kv, p + "attn_k_norm.weight")
    table = rope_table(hp, i)
    q3, k3 = (rotate(c, g.op("Unsqueeze", [t, g.const([0])]), io.pos_ids, n, table)
              for t, n in ((q, hp.n_head), (k, hp.n_head_kv)))
    return _exact_attention(c, i, q3, k3, v, io)


def _fused_attention(c: BuildContext, i: int, q3: str, k3: str, v3: str, io: AttentionInputs,
                     *, rotary: bool) -> str:
    """GroupQueryAttention on [1, S, *] projections (rotated inside if `rotary`), writing
    the cache buffers in place -> [S, H*hd]."""
    g, hp = c.g, c.hp
    table = rope_table(hp, i)
    extra = [f"{table}.cos", f"{table}.sin"] if rotary else []
    # a sliding-window layer's query sees itself and the window - 1 keys before it: in
    # GroupQueryAttention's terms, a local window of that many keys
    window = {"local_window_size": hp.sliding_window} if hp.is_swa(i) else {}
    if hp.attn_sinks:  # head_sink: input 11, after position_ids and attention_bias
        extra = [*(extra or ["", ""]), "", "", _sinks(c, i)]
    out, _, _ = g.op("GroupQueryAttention", [q3, k3, v3, f"past_key_{i}", f"past_value_{i}",
                                             io.seqlens_k, io.total_len, *extra], 3,
                     domain=MS, out=[g.fresh("gqa"), f"present_key_{i}", f"present_value_{i}"],
                     num_heads=hp.n_head, kv_num_heads=hp.n_head_kv,
                     scale=hp.attn_scale, do_rotary=int(rotary),
                     rotary_interleaved=int(hp.rope_interleaved), **window)  # [1, S, H*hd]
    return g.op("Reshape", [out, g.const([-1, hp.n_head * hp.head_dim])])


def write_kv(c: BuildContext, i: int, k3: str, v: str) -> tuple[str, str]:
    """New keys/values -> [1, Hkv, S, hd], written in place into layer i's cache at
    `position`; returns the updated caches."""
    g, hp = c.g, c.hp
    hd, nkv = hp.head_dim, hp.n_head_kv
    k4 = g.op("Transpose", [g.op("Reshape", [k3, g.const([1, -1, nkv, hd])])], perm=[0, 2, 1, 3])
    v4 = g.op("Transpose", [g.op("Reshape", [v, g.const([1, -1, nkv, hd])])], perm=[0, 2, 1, 3])
    if c.options.kv_dtype == "f16":  # rounded once, when written
        k4, v4 = (g.op("Cast", [t], to=F16) for t in (k4, v4))
    ck = g.op("TensorScatter", [f"past_key_{i}", k4, "position"], axis=2,
              out=[f"present_key_{i}"])
    cv = g.op("TensorScatter", [f"past_value_{i}", v4, "position"], axis=2,
              out=[f"present_value_{i}"])
    return ck, cv


def write_kv_rows(c: BuildContext, i: int, k3: str, v: str, packed: bool) -> None:
    """Layer i's new K/V rows (k3 [1, S, Hkv*hd] rotated, v [S, Hkv*hd]): graph outputs
    key_i / value_i [S, Hkv*hd] for the runner to write into each row's slot (`packed`),
    else written into the layer's cache at `position` (its buffers declared here)."""
    g = c.g
    if packed:
        width = c.hp.n_head_kv * c.hp.head_dim
        g.op("Squeeze", [k3, g.const([0])], out=[f"key_{i}"])
        g.output(f"key_{i}", F32, ["S", width])
        g.op("Identity", [v], out=[f"value_{i}"])
        g.output(f"value_{i}", F32, ["S", width])
    else:
        kv_cache_io(c, i)
        write_kv(c, i, k3, v)


def _cached_attention(c: BuildContext, i: int, products: list[tuple[str, list[str]]],
                      causal: bool = True) -> str:
    """specd's CachedAttention on the unrotated projections: rotary, the write of the new
    keys and values into layer i's cache in place, and the exact attention over it in one
    node: [S, H*hd]; the rows are `segments` (slot, position, rows) of several sequences.
    `products`: the q, k and v products as `grouped_linears` gives them; q + k + v or
    q + k stacked in one are read in place (`packed`), anything else split. causal False:
    each segment's rows see the whole segment (a drafter head's block)."""
    shapes = [len(group) for _, group in products]
    if shapes == [3]:
        packed, (t,) = 2, [y for y, _ in products]
        q = k = v = t
    elif shapes == [2, 1]:
        packed, q, v = 1, products[0][0], products[1][0]
        k = q
    else:
        packed = 0
        q, k, v = [t for y, group in products for t in split(c, y, group)]
    g, hp = c.g, c.hp
    op = "CachedAttentionF16" if c.options.kv_dtype == "f16" else "CachedAttention"
    rotary = hp.uses_rope(i) and not hp.mrope  # M-RoPE: rotated before (_rotate_rows)
    table = rope_table(hp, i) if rotary else NOPE
    optional = ({"packed": packed} if packed else {}) | (
        {"window": hp.sliding_window} if hp.is_swa(i) else {}) | (
        {} if causal else {"causal": 0})
    sinks = [_sinks(c, i)] if hp.attn_sinks else []
    out, _, _ = g.op(op, [q, k, v, f"past_key_{i}", f"past_value_{i}", "segments",
                          f"{table}.cos", f"{table}.sin", *sinks], 3, domain=NATIVE,
                     out=[g.fresh("attn"), f"present_key_{i}", f"present_value_{i}"],
                     num_heads=hp.n_head, kv_num_heads=hp.n_head_kv,
                     scale=hp.attn_scale, rotary_dim=hp.rope_dim if rotary else 0,
                     interleaved=int(hp.rope_interleaved), **optional)
    return out


def _sinks(c: BuildContext, i: int) -> str:
    """Layer i's attention sinks [n_head]: a logit per query head in every softmax."""
    return c.vector(f"blk.{i}.attn_sinks.weight")


def _exact_attention(c: BuildContext, i: int, q3: str, k3: str, v: str,
                     io: AttentionInputs) -> str:
    """Attention written out over the first `attn_len` cached keys, each row computed the
    same way whatever S -> [S, H*hd]."""
    g, hp = c.g, c.hp
    hd, nkv, grp = hp.head_dim, hp.n_head_kv, hp.group_size
    ck, cv = write_kv(c, i, k3, v)
    zero, two = g.const([0]), g.const([2])
    keys = g.op("Reshape", [g.op("Slice", [ck, zero, "attn_len", two]), g.const([nkv, -1, hd])])
    vals = g.op("Reshape", [g.op("Slice", [cv, zero, "attn_len", two]), g.const([nkv, -1, hd])])
    # queries -> [Hkv, G*S, hd]; query head h uses kv head h // G
    q4 = g.op("Transpose", [g.op("Reshape", [q3, g.const([-1, nkv, grp, hd])])],
              perm=[1, 2, 0, 3])  # [Hkv, G, S, hd]
    qm = g.op("Reshape", [q4, g.const([nkv, -1, hd])])
    if grp == 1:  # keep M >= 2 so MLAS never takes its M == 1 GEMV path (not row-invariant)
        qm = g.op("Concat", [qm, io.qpad], axis=1)
    scores = g.op("MatMul", [qm, g.op("Transpose", [keys], perm=[0, 2, 1])])  # [Hkv, M, T]
    scores = g.op("Mul", [scores, g.const(hp.attn_scale, np.float32)])
    if grp == 1:
        scores = g.op("Slice", [scores, g.const([0]), io.s_len, g.const([1])])
    s4 = g.op("Reshape", [scores, io.shape4])  # [Hkv, G, S, T]
    mask = io.mask_swa if hp.is_swa(i) else io.mask
    sinks = f"blk.{i}.attn_sinks.weight"
    if c.f.has_tensor(sinks):  # one more logit per head in the softmax (gpt-oss, heads)
        probs = _softmax_with_sinks(c, g.op("Add", [s4, mask]), sinks)
    else:
        probs = g.op("Softmax", [g.op("Add", [s4, mask])], axis=-1)
    probs = g.op("Reshape", [probs, io.shape3])  # [Hkv, G*S, T]
    if grp == 1:
        probs = g.op("Concat", [probs, io.ppad], axis=1)
    out = g.op("MatMul", [probs, vals])  # [Hkv, M, hd]
    if grp == 1:
        out = g.op("Slice", [out, g.const([0]), io.s_len, g.const([1])])
    out = g.op("Transpose", [g.op("Reshape", [out, g.const([nkv, grp, -1, hd])])],
               perm=[2, 0, 1, 3])  # [S, Hkv, G, hd]
    return g.op("Reshape", [out, g.const([-1, hp.n_head * hd])])


def _softmax_with_sinks(c: BuildContext, scores: str, sinks: str) -> str:
    """Softmax over the keys of scores [Hkv, G, S, T] with each query head's sink logit
    (`sinks` [H], query head h = kv head * G + g) in its denominator, as llama.cpp's
    soft_max with sinks: exp(s - m) / (sum exp(s - m) + exp(sink - m))."""
    g, hp = c.g, c.hp
    sink = g.op("Reshape", [c.vector(sinks), g.const([hp.n_head_kv, hp.group_size, 1, 1])])
    shape = g.op("Concat", [g.op("Shape", [scores], end=3), g.const([1])], axis=0)
    both = g.op("Concat", [scores, g.op("Expand", [sink, shape])], axis=-1)  # [.., T + 1]
    probs = g.op("Softmax", [both], axis=-1)
    return g.op("Slice", [probs, g.const([0]), g.op("Shape", [scores], start=3),
                          g.const([3])])  # [Hkv, G, S, T]


def _causal_mask(g: GraphWriter, s_len: str, window: int = 0, *,
                 whole_block: bool = False) -> str:
    """[S, T] additive mask: 0 where key t <= position p of row s (and, with a window,
    t > p - window: the query and the window - 1 keys before it), -inf elsewhere.
    whole_block: t up to the block's last position instead of p (a block not causal
    within itself), the window still counted back from p."""
    t = g.op("Range", [g.const(0), g.op("Squeeze", ["attn_len", g.const([0])]), g.const(1)])
    rows = g.op("Range", [g.const(0), g.op("Squeeze", [s_len, g.const([0])]), g.const(1)])
    row_pos = g.op("Unsqueeze", [g.op("Add", [rows, "position"]), g.const([1])])  # [S, 1]
    if whole_block:  # [1, T]: every key before the block's end
        allowed = g.op("Less", [t, g.op("Add", ["position", s_len])])
    else:
        allowed = g.op("LessOrEqual", [t, row_pos])  # [S, T]
    if window:
        recent = g.op("Greater", [t, g.op("Sub", [row_pos, g.const(window)])])
        allowed = g.op("And", [allowed, recent])
    return g.op("Where", [allowed, g.const(0.0, np.float32), g.const(-np.inf, np.float32)])


def _f32_tensor(value: float) -> TensorProto:
    from onnx import helper

    return helper.make_tensor("value", F32, [1], [value])
