"""What a build is asked for (BuildOptions), and the constants graphs and their callers share.

BUILDER_VERSION names the bytes a build writes: it is part of every cached graph's folder
name, so a change to the graphs must come with a new version (and only then).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from onnx import TensorProto

from specd.ort_models.quant import REQUANT_KINDS

BUILDER_VERSION = "15"
# attention is computed over `attn_len` keys, a multiple of this (see the package docstring)
ATTN_BUCKET = 256
ACCURACY_LEVEL = 4
ATTENTION_KINDS = ("exact", "fused", "native")
# "ort": every quantized matrix through MatMulNBits (lossless re-layout); "gguf": Q4_0 /
# Q4_1 / Q4_K / Q6_K matrices through specd's GgufMatMul kernel on the GGUF's own blocks
# (native_ops)
KERNEL_KINDS = ("ort", "gguf")
F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
I64 = TensorProto.INT64

# progress(done, total, label): called after the embedding, each layer and the output
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class BuildOptions:
    hidden_layers: tuple[int, ...] = ()  # extra outputs: residual stream after these layers
    max_positions: int = 0  # rope table size; 0 = the model's trained context
    # MatMulNBits accuracy: 4 = int8 activations (fast, row-invariant); 1 = fp32 (tests)
    accuracy_level: int = ACCURACY_LEVEL
    # "" keeps every weight exactly as the GGUF has it (targets); "q4" re-quantizes the
    # matrices to 4 bits (drafts: fewer bytes per step, the output stays the target's)
    requant: str = ""
    # "exact": attention written out, batch-invariant (targets: a verified row must equal
    # a single step); "fused": ORT's GroupQueryAttention, fewer nodes and no KV prefix
    # copy, but a row's result depends on the block around it (~1e-7), so drafts only;
    # "native": specd's CachedAttention kernel (rotary + cache write + exact attention in
    # one node), batch-invariant, no copy (native_ops)
    attention: str = "exact"
    kernels: str = "ort"
    # KV cache element type: "f32", or "f16" (half the memory and the attention's reads;
    # native attention only, which converts exactly to float32 before any arithmetic)
    kv_dtype: str = "f32"
    # logits for the ids below this only, 0 = all (drafts: a draft then proposes only
    # those ids, and its output matrix, a quarter of a small draft's bytes, is cut)
    vocab_rows: int = 0
    # SampleTokens and TokenLogprobs nodes after the logits (specd's kernels): the calls of
    # a pass may have their tokens and logprobs decided in the graph (sampling_op)
    sampler: bool = False
    # the rows come in as embeddings (graph input `input_embeds` [S, n_embd], an image's
    # projected tokens) in place of token ids; `causal` False: the rows of a call see each
    # other whole (llama.cpp's non-causal image batches, gemma3). The text graph's bytes
    # are those of the defaults, so this is a graph of its own beside it
    embeddings_input: bool = False
    causal: bool = True

    def __post_init__(self) -> None:
        if self.vocab_rows < 0:
            raise ValueError(f"vocab_rows must be >= 0 (0: all), got {self.vocab_rows}")
        if self.requant not in REQUANT_KINDS:
            raise ValueError(f"unknown requant {self.requant!r} (one of "
                             f"{', '.join(repr(k) for k in REQUANT_KINDS)})")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r} (one of "
                             f"{', '.join(ATTENTION_KINDS)})")
        if self.kernels not in KERNEL_KINDS:
            raise ValueError(f"unknown kernels {self.kernels!r} (one of "
                             f"{', '.join(KERNEL_KINDS)})")
        if self.kv_dtype not in ("f32", "f16"):
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r} (f32 or f16)")
        if self.kv_dtype == "f16" and self.attention != "native":
            raise ValueError("kv_dtype 'f16' needs attention='native'")
        if self.sampler and not self.uses_native:
            raise ValueError("sampler needs specd's kernels (kernels='gguf' or "
                             "attention='native')")
        if not self.causal and not self.embeddings_input:
            raise ValueError("causal=False is for embeddings graphs (embeddings_input=True)")
        if self.embeddings_input and (self.sampler or self.attention == "fused"):
            raise ValueError("an embeddings graph has no sampler and attends written out or "
                             "with specd's kernel (attention 'exact' or 'native')")
        if self.requant == "q4k" and self.kernels != "gguf":
            raise ValueError("requant 'q4k' makes Q4_K blocks for GgufMatMul: it needs "
                             "kernels='gguf'")

    def key(self) -> str:
        """The options' part of the cached graph's folder name."""
        layers = "-".join(map(str, self.hidden_layers)) or "none"
        rq = f"_r{self.requant}" if self.requant else ""
        at = {"exact": "", "fused": "_gqa", "native": "_natt"}[self.attention]
        kn = "_kgguf" if self.kernels == "gguf" else ""
        kv = "_kv16" if self.kv_dtype == "f16" else ""
        vr = f"_v{self.vocab_rows}" if self.vocab_rows else ""
        sm = "_smp2" if self.sampler else ""
        em = ("_emb" + ("" if self.causal else "nc")) if self.embeddings_input else ""
        return (f"h{layers}_p{self.max_positions}_a{self.accuracy_level}{rq}{at}{kn}{kv}{vr}"
                f"{sm}{em}")

    def logits_width(self, n_vocab: int) -> int:
        """Ids the graph's logits cover."""
        return min(self.vocab_rows, n_vocab) if self.vocab_rows else n_vocab

    def for_vocab(self, n_vocab: int) -> BuildOptions:
        """These options for a model of n_vocab ids: a cut that keeps every row is no cut
        (vocab_rows 0), so it builds and caches the same graph as none."""
        if self.vocab_rows and self.vocab_rows >= n_vocab:
            return replace(self, vocab_rows=0)
        return self

    @property
    def kv_bytes(self) -> int:
        """Bytes of one KV cache element."""
        return 2 if self.kv_dtype == "f16" else 4

    @property
    def uses_native(self) -> bool:
        """Whether the graph holds specd's own ops (sessions must register native_ops)."""
        return self.kernels == "gguf" or self.attention == "native"
