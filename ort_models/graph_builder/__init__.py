"""Build one ONNX decoder graph from a GGUF file.

Graph contract (S >= 1 new tokens on top of the KV cache):

inputs
    input_ids    int64 [S]           tokens at positions pos .. pos+S-1
    position     int64 [1]           pos: where the first new token goes
    attn_len     int64 [1]           keys attended: a bucket end >= pos+S (see ATTN_BUCKET);
                                     a runner's filler rows (CUDA) may lie past it
    logits_rows  int64 [R]           rows of the S new tokens whose logits are wanted
    rope_positions int64 [4, S]      M-RoPE models only (qwen2vl): each row's (t, h, w, e)
                                     rotary positions (mrope.py); `position` stays the
                                     KV row the first token goes to
    past_key_i / past_value_i float32 [1, n_kv, kv_len, head_dim]  per layer i (kv_len >= n_ctx)
  attention="native" instead: the rows of several sequences in one call
    segments     int64 [B, 3]        per sequence (slot, pos, rows): its next `rows` rows
                                     of input_ids, at positions pos.., over its cache slot
    past_key_i / past_value_i [n_seq, n_kv, kv_len, head_dim]  every slot's buffers
outputs
    logits       float32 [R, vocab] (vocab: the first `vocab_rows` ids, where set)
    present_key_i / present_value_i  the same buffers, written in place at pos..pos+S-1
    hidden_l     float32 [S, n_embd] residual stream after layer l (optional)
  sampler=True adds the SampleTokens node after the logits, with its inputs sample_* and
  outputs sampled_* (their contract: ort_models/sampling_op.py)
  embeddings_input=True instead: input_embeds float32 [S, n_embd] in place of input_ids,
    the rows as they are (an image's projected tokens, llama.cpp's embeddings batch); with
    causal=False each row sees its whole call's rows (gemma3's images). A graph of its
    own, run beside the text graph over its KV cache (ModelRunner.attach_embeddings)

Batch invariance: every op computes a row the same way whatever S is, so a verified row
equals a single-token step bit for bit. MatMulNBits (accuracy_level 4) and prepacked
MatMul are row-invariant (MatMulNBits from M = 2 on some CPUs: the runner measures it and
runs single steps as two rows there, row_invariance.py); attention is written out
(TensorScatter + MatMul + Softmax) over `attn_len` keys, padded to a multiple of
ATTN_BUCKET with masked keys, so a row's softmax and weighted sum see exactly the same
numbers in a block as alone, as long as the block does not cross a bucket boundary (the
runner guarantees that for verify).
Drafts may take attention="fused" instead: GroupQueryAttention, faster, not row-invariant
(`attn_len` is then unused). Where specd's own kernels run (native_ops), kernels="gguf"
multiplies Q4_0 / Q4_1 / Q4_K / Q6_K matrices with GgufMatMul on the GGUF's own blocks and
attention="native" rotates, writes the cache in place and attends over it in one
CachedAttention node: both compute each row alone in a fixed order, so they are
row-invariant by construction (`attn_len` is unused there too). Wherever specd's ops are
registered the gated feed-forward activation is one SwiGlu node over the stacked gate/up
product (elementwise, the same operations whatever S).

Modules
    options    BuildOptions, BUILDER_VERSION, ATTN_BUCKET and the other constants
    context    BuildContext: the state one build threads through the others
    weights    the matrix kinds (dense, MatMulNBits, GGUF rows) behind one interface
    pending    activations left for a GgufMatMul prologue (the interface; the kinds are
               norms.PendingNorm and mlp.PendingSwiGlu)
    linear     products of activations with matrices, stacked where the kinds allow
    norms      RMS norms, the residual add + norm
    mlp        the gated feed-forward block
    mrope      M-RoPE's per-row rotary tables from the rows' four positions
    attention  the three kinds of attention and the inputs they share
    decoder    the whole graph: inputs, embedding, layers, logits head (build_graph)
    sampling   the token decision after the logits (the SampleTokens node)
"""

from .decoder import build_graph
from .moe import EXPERT_IDS
from .mrope import ROPE_POSITIONS
from .options import ATTN_BUCKET, BUILDER_VERSION, BuildOptions, Progress

__all__ = ["ATTN_BUCKET", "BUILDER_VERSION", "EXPERT_IDS", "ROPE_POSITIONS", "BuildOptions",
           "Progress", "build_graph"]
