"""Tiny random GGUF models for tests, laid out exactly as llama.cpp writes them.

`write_tiny_gguf` writes a small llama / qwen2 / qwen3 model with random weights, a real
(small) gpt2-style byte-level BPE tokenizer and a ChatML chat template.  Weight types:

* F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0: random float weights, quantized with
  `gguf.quants.quantize` (F32/F16 stored as plain arrays).
* Q4_K, Q5_K, Q6_K: gguf-py cannot quantize these, so RANDOM RAW BLOCKS are generated
  directly in ggml's byte layout (every bit of the packed scales and quants is exercised),
  with block scales chosen so that the dequantized weights have the intended std.

Every tensor draws from its own generator seeded by (seed, crc32(name)), so the same seed
gives the same norms/biases/float weights whatever the weight type (e.g. a Q4_0 file is a
quantized copy of the F16 file with the same seed).  K-quant tensors are not derived from
the float weights, though.  `perturb=r` adds relative noise of size r (a second generator)
to every tensor so that the result is a "draft" that mostly agrees with the unperturbed file.

`write_corrupt_variants` writes files that a loader must reject.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.constants import GGML_QUANT_SIZES, QK_K
from gguf.quants import quantize

ARCHES = ("llama", "qwen2", "qwen3", "gemma3")
FLOAT_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0")
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
WEIGHT_TYPES = FLOAT_QUANT_TYPES + KQUANT_TYPES
NORM_TYPES = ("F32", "F16", "BF16")

_FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}

# Magnitudes: matmul weights have std GAIN / sqrt(in_features) with GAIN = QK_GAIN for
# attn_q/attn_k (sharper attention, so greedy text does not settle into loops), RESIDUAL_GAIN
# for attn_output/ffn_down (block outputs dominate the residual stream, so a tied embedding
# does not just predict its own input token) and 1 otherwise; qwen3's q/k norm weights are
# QK_NORM_SCALE + jitter.  The output matrix (tied or not) has std OUTPUT_GAIN / sqrt(n_embd):
# logits have std ~3 and |max| ~10-20.
QK_GAIN = 2.5
QK_NORM_SCALE = 2.5
RESIDUAL_GAIN = 5.0
OUTPUT_GAIN = 3.0
EMBED_GAIN = 3.0
NORM_JITTER = 0.1
BIAS_STD = 0.2

# ---------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Merges in priority order ("a b" -> token "ab"); each side exists before the merge.
_MERGES = (
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t",
    "Ġ w", "Ġ o", "e n", "Ġ c", "i t", "i s", "a n", "o r", "e s", "Ġ b",
    "e d", "Ġ f", "in g", "Ġ p", "o u", "Ġa n", "a l", "a r", "Ġt o", "Ġ m",
    "Ġo f", "Ġ in", "Ġ d", "Ġ h", "Ġan d", "i c", "a s", "l e", "Ġt h", "i on",
    "o m", "l l", "en t", "Ġ n", "Ġ l", "s t", "Ġ re", "v e", "Ġ e", "r o",
    "l y", "Ġb e", "Ġ g", "Ġ T", "c t", "Ġ S", "i d", "o t", "Ġ I", "u t",
    "e t", "Ġ A", "Ġ is", "Ġ on", "Ċ Ċ", "Ġ Ġ", "ĠĠ ĠĠ", "d e", "de f", "Ġ (",
    "( )", "Ġ =", "Ġre t", "u r", "ur n", "Ġret urn", "Ġd e", "Ġde f", "Ġp r", "in t",
    "Ġpr int", "he ll", "hell o", "Ġw or", "l d", "Ġwor ld", "Ġ x", "Ġ 1", "Ġ +", "Ġ :",
    "Ġ #",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character mapping (insertion order = vocab order)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@dataclass(frozen=True)
class TinyVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    pre: str
    chat_template: str = CHATML_TEMPLATE

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def natural_vocab_size() -> int:
    """Tokens before padding: 256 byte tokens + one per merge + the special tokens."""
    return 256 + len(_MERGES) + len(SPECIAL_TOKENS)


FIM_TOKENS = (
    "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")


def build_vocab(arch: str, vocab_size: int | None = None, fim: bool = False) -> TinyVocab:
    """The tokenizer for `arch`.

    qwen2/qwen3 (like Qwen2.5): bytes, merges, then <|endoftext|> <|im_start|> <|im_end|>;
    bos = pad = <|endoftext|>, eos = <|im_end|>, pre "qwen2".
    llama (like SmolLM2-Instruct): the three specials first (ids 0, 1, 2), then bytes,
    merges; bos = <|im_start|>, eos = pad = <|im_end|>, pre "smollm".
    Padding tokens "[PAD{i}]" (type UNUSED, as convert_hf_to_gguf.py writes them) fill up
    to `vocab_size` (default: the natural size rounded up to a multiple of 32).
    """
    byte_tokens = list(bytes_to_unicode().values())
    merge_tokens: list[str] = []
    known = set(byte_tokens)
    for merge in _MERGES:
        left, right = merge.split(" ")
        assert left in known and right in known, merge
        merged = left + right
        assert merged not in known, merge
        known.add(merged)
        merge_tokens.append(merged)
    normal = byte_tokens + merge_tokens
    specials = list(SPECIAL_TOKENS) + (list(FIM_TOKENS) if fim else [])
    if arch == "llama":
        tokens = specials + normal
        types = [TokenType.CONTROL] * len(specials) + [TokenType.NORMAL] * len(normal)
    else:
        tokens = normal + specials
        types = [TokenType.NORMAL] * len(normal) + [TokenType.CONTROL] * len(specials)
    natural = len(tokens)
    if vocab_size is None:
        vocab_size = -(-natural // 32) * 32
    if vocab_size < natural:
        raise ValueError(f"vocab_size {vocab_size} < {natural} (the tokenizer's own tokens)")
    for i in range(natural, vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(TokenType.UNUSED)
    ids = {t: i for i, t in enumerate(tokens)}
    if arch == "llama":
        bos, eos, pad, pre = ids["<|im_start|>"], ids["<|im_end|>"], ids["<|im_end|>"], "smollm"
    else:
        bos, eos, pad, pre = (
            ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"], "qwen2",
        )
    return TinyVocab(
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=list(_MERGES),
        bos_id=bos,
        eos_id=eos,
        pad_id=pad,
        pre=pre,
    )


# ---------------------------------------------------------------------------------------
# K-quant raw blocks
# ---------------------------------------------------------------------------------------


@dataclass
class KQuantBlocks:
    """Logical content of K-quant blocks for a (rows, cols) matrix, blocks row-major.

    Q4_K/Q5_K: value = d * sc[j] * q - dmin * m[j], j = sub-block of 32 (8 per block).
    Q6_K:      value = d * sc[j] * q,                j = sub-block of 16 (16 per block),
               q in [-32, 31], sc int8.
    """

    qtype: str
    rows: int
    cols: int
    d: np.ndarray  # (nb,) float16
    dmin: np.ndarray | None  # (nb,) float16, Q4_K/Q5_K only
    sc: np.ndarray  # (nb, 8) uint8 0..63  or (nb, 16) int8 for Q6_K
    m: np.ndarray | None  # (nb, 8) uint8 0..63, Q4_K/Q5_K only
    q: np.ndarray  # (nb, 256) int16: 0..15 (Q4_K), 0..31 (Q5_K), -32..31 (Q6_K)

    @property
    def q_range(self) -> tuple[int, int]:
        return {"Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}[self.qtype]

    def dequantize(self) -> np.ndarray:
        """Values as float32 (rows, cols), computed from the logical fields."""
        nb = self.d.shape[0]
        d = self.d.astype(np.float32)[:, None, None]
        if self.qtype == "Q6_K":
            sub = d * self.sc.astype(np.float32)[:, :, None]
            vals = sub * self.q.reshape(nb, 16, 16).astype(np.float32)
        else:
            assert self.dmin is not None and self.m is not None
            dmin = self.dmin.astype(np.float32)[:, None, None]
            scale = d * self.sc.astype(np.float32)[:, :, None]
            offset = dmin * self.m.astype(np.float32)[:, :, None]
            vals = scale * self.q.reshape(nb, 8, 32).astype(np.float32) - offset
        return vals.reshape(self.rows, self.cols).astype(np.float32)

    def pack(self) -> np.ndarray:
        """The raw bytes, uint8 (rows, cols // 256 * type_size), ggml block layout."""
        nb = self.d.shape[0]
        d_bytes = self.d.astype("<f2").view(np.uint8).reshape(nb, 2)
        if self.qtype == "Q6_K":
            u = (self.q + 32).astype(np.uint8)  # 0..63
            lo = (u & 0x0F).reshape(nb, 2, 2, 64)  # [half, shift, k]
            hi = (u >> 4).reshape(nb, 2, 4, 32)  # [half, shift, k]
            ql = (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(nb, 128)
            qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6))
            qh = qh.reshape(nb, 64)
            scales = self.sc.astype(np.int8).view(np.uint8).reshape(nb, 16)
            raw = np.concatenate([ql, qh, scales, d_bytes], axis=1)
        else:
            assert self.dmin is not None and self.m is not None
            dmin_bytes = self.dmin.astype("<f2").view(np.uint8).reshape(nb, 2)
            sc = self.sc.astype(np.uint8)
            m = self.m.astype(np.uint8)
            scales = np.empty((nb, 12), dtype=np.uint8)
            scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
            scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
            scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
            u = self.q.astype(np.uint8)
            lo = (u & 0x0F).reshape(nb, 4, 2, 32)  # [chunk of 64, low/high nibble, k]
            qs = (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(nb, 128)
            parts = [d_bytes, dmin_bytes, scales]
            if self.qtype == "Q5_K":
                hb = ((u >> 4) & 1).reshape(nb, 8, 32)  # [bit j, k]
                qh = np.zeros((nb, 32), dtype=np.uint8)
                for j in range(8):
                    qh |= hb[:, j, :] << j
                parts.append(qh)
            parts.append(qs)
            raw = np.concatenate(parts, axis=1)
        _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[self.qtype]]
        assert raw.shape == (nb, type_size)
        return np.ascontiguousarray(raw).reshape(self.rows, self.cols // QK_K * type_size)

    def perturbed(self, rng: np.random.Generator, rel: float) -> KQuantBlocks:
        """A copy whose quant values are nudged so the relative RMS change is about `rel`."""
        lo, hi = self.q_range
        sigma = rel * (hi - lo + 1) / np.sqrt(12.0)  # in units of quant steps
        if sigma < 1.0:
            flip = rng.random(self.q.shape) < sigma * sigma
            delta = np.where(flip, rng.choice(np.array([-1, 1]), size=self.q.shape), 0)
        else:
            delta = np.rint(rng.normal(0.0, sigma, size=self.q.shape)).astype(np.int64)
        q = np.clip(self.q.astype(np.int64) + delta, lo, hi).astype(np.int16)
        return KQuantBlocks(self.qtype, self.rows, self.cols, self.d, self.dmin, self.sc,
                            self.m, q)


def random_kquant_blocks(
    rng: np.random.Generator, rows: int, cols: int, qtype: str, std: float
) -> KQuantBlocks:
    """Random K-quant blocks whose dequantized values have roughly `std` and mean ~0."""
    if qtype not in KQUANT_TYPES:
        raise ValueError(f"not a K-quant type: {qtype}")
    if cols % QK_K:
        raise ValueError(f"{qtype} needs rows of a multiple of {QK_K} values, got {cols}")
    nb = rows * cols // QK_K
    jitter = rng.uniform(0.7, 1.3, size=nb)
    if qtype == "Q6_K":
        sc = rng.integers(-32, 32, size=(nb, 16)).astype(np.int8)
        q = rng.integers(-32, 32, size=(nb, QK_K)).astype(np.int16)
        # std ~ d * rms(sc) * std(q) = d * 18.5 * 18.5
        d = (std / (18.48 * 18.47) * jitter).astype(np.float16)
        return KQuantBlocks(qtype, rows, cols, d, None, sc, None, q)
    n_levels = 16 if qtype == "Q4_K" else 32
    sc = rng.integers(0, 64, size=(nb, 8)).astype(np.uint8)
    q = rng.integers(0, n_levels, size=(nb, QK_K)).astype(np.int16)
    q_std = np.sqrt((n_levels * n_levels - 1) / 12.0)
    # std ~ d * rms(sc) * std(q); rms of uniform 0..63 is ~36.5
    d = (std / (36.52 * q_std) * jitter).astype(np.float16)
    # dmin * m ~ d * sc * mean(q) keeps each sub-block centred near zero
    ratio = n_levels // 2  # dmin = ratio * d (exact in f16: power of two)
    dmin = (d.astype(np.float32) * ratio).astype(np.float16)
    mean_q = (n_levels - 1) / 2.0
    m_float = sc.astype(np.float64) * mean_q / ratio + rng.integers(-2, 3, size=(nb, 8))
    m = np.clip(np.rint(m_float), 0, 63).astype(np.uint8)
    return KQuantBlocks(qtype, rows, cols, d, dmin, sc, m, q)


@dataclass
class Q4Blocks:
    """Logical content of Q4_0 / Q4_1 blocks of 32 for a (rows, cols) matrix.

    Q4_0: value = d * (q - 8);  Q4_1: value = d * q + m;  q in 0..15, j = block of 32.
    """

    qtype: str
    rows: int
    cols: int
    d: np.ndarray  # (rows, cols // 32) float16
    m: np.ndarray | None  # (rows, cols // 32) float16, Q4_1 only
    q: np.ndarray  # (rows, cols) uint8 0..15

    def pack(self) -> np.ndarray:
        """The raw bytes, uint8 (rows, cols // 32 * type_size), ggml block layout."""
        q = self.q.reshape(self.rows, -1, 32).astype(np.uint8)
        parts = [self.d.astype("<f2").view(np.uint8).reshape(self.rows, -1, 2)]
        if self.m is not None:
            parts.append(self.m.astype("<f2").view(np.uint8).reshape(self.rows, -1, 2))
        parts.append(q[..., :16] | (q[..., 16:] << 4))  # value l < 16 in the low nibble
        return np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(self.rows, -1))


def random_q4_blocks(
    rng: np.random.Generator, rows: int, cols: int, qtype: str, std: float
) -> Q4Blocks:
    """Random Q4_0 / Q4_1 blocks whose values have roughly `std` and mean ~0."""
    if qtype not in ("Q4_0", "Q4_1") or cols % 32:
        raise ValueError(f"Q4_0 / Q4_1 rows of a multiple of 32 values, got {qtype} {cols}")
    shape = (rows, cols // 32)
    q = rng.integers(0, 16, size=(rows, cols)).astype(np.uint8)
    d = (std / 4.61 * rng.uniform(0.7, 1.3, size=shape)).astype(np.float16)  # std(q) 4.61
    m = None
    if qtype == "Q4_1":  # centred near zero: m ~ -7.5 d
        m = (-7.5 * d.astype(np.float32) * rng.uniform(0.8, 1.2, size=shape)).astype(np.float16)
    return Q4Blocks(qtype, rows, cols, d, m, q)


# ---------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, cols) = (out_features, in_features)
    kind: str  # "embed" | "output" | "matmul" | "norm" | "bias"
    qtype: str


def _name_seed(seed: int, name: str, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), stream])


def _check_type(qtype: str, what: str, allowed: Sequence[str]) -> None:
    if qtype not in allowed:
        raise ValueError(f"unsupported {what} {qtype!r}; choose from {', '.join(allowed)}")


def _tensor_specs(
    arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
    n_ff: int, vocab: int, tied: bool, weight_type: str, embed_type: str, output_type: str,
    norm_type: str, value_type: str | None = None, attn_in: int | None = None,
) -> list[_TensorSpec]:
    """Every tensor of the model (attn_in: the width q/k/v read, where not n_embd)."""
    q_dim, kv_dim, n_in = n_head * head_dim, n_head_kv * head_dim, attn_in or n_embd
    # gemma scales its embeddings by sqrt(n_embd): its rows are that much smaller here, so
    # the scaled ones are as large as the other architectures' and the layers still count
    embed_kind = "embed_scaled" if arch == "gemma3" else "embed"
    specs = [_TensorSpec("token_embd.weight", (vocab, n_embd), embed_kind, embed_type)]
    for i in range(n_layer):
        p = f"blk.{i}."
        specs.append(_TensorSpec(p + "attn_norm.weight", (n_embd,), "norm", norm_type))
        specs.append(_TensorSpec(p + "attn_q.weight", (q_dim, n_in), "matmul", weight_type))
        if arch == "qwen2":
            specs.append(_TensorSpec(p + "attn_q.bias", (q_dim,), "bias", "F32"))
        specs.append(_TensorSpec(p + "attn_k.weight", (kv_dim, n_in), "matmul", weight_type))
        if arch == "qwen2":
            specs.append(_TensorSpec(p + "attn_k.bias", (kv_dim,), "bias", "F32"))
        specs.append(_TensorSpec(p + "attn_v.weight", (kv_dim, n_in), "matmul",
                                 value_type or weight_type))
        if arch == "qwen2":
            specs.append(_TensorSpec(p + "attn_v.bias", (kv_dim,), "bias", "F32"))
        if arch in ("qwen3", "gemma3"):
            specs.append(_TensorSpec(p + "attn_q_norm.weight", (head_dim,), "norm", "F32"))
            specs.append(_TensorSpec(p + "attn_k_norm.weight", (head_dim,), "norm", "F32"))
        specs.append(
            _TensorSpec(p + "attn_output.weight", (n_embd, q_dim), "matmul", weight_type)
        )
        if arch == "gemma3":
            specs.append(_TensorSpec(p + "post_attention_norm.weight", (n_embd,), "norm",
                                     norm_type))
        specs.append(_TensorSpec(p + "ffn_norm.weight", (n_embd,), "norm", norm_type))
        specs.append(_TensorSpec(p + "ffn_gate.weight", (n_ff, n_embd), "matmul", weight_type))
        specs.append(_TensorSpec(p + "ffn_up.weight", (n_ff, n_embd), "matmul", weight_type))
        specs.append(_TensorSpec(p + "ffn_down.weight", (n_embd, n_ff), "matmul", weight_type))
        if arch == "gemma3":
            specs.append(_TensorSpec(p + "post_ffw_norm.weight", (n_embd,), "norm", norm_type))
    specs.append(_TensorSpec("output_norm.weight", (n_embd,), "norm", norm_type))
    if not tied:
        specs.append(_TensorSpec("output.weight", (vocab, n_embd), "output", output_type))
    return specs


def _std_for(spec: _TensorSpec, n_embd: int) -> float:
    if spec.kind == "embed":
        return EMBED_GAIN / np.sqrt(n_embd)
    if spec.kind == "embed_scaled":
        return EMBED_GAIN / n_embd
    if spec.kind == "output":
        return OUTPUT_GAIN / np.sqrt(n_embd)
    gain = 1.0
    if spec.name.endswith(("attn_output.weight", "ffn_down.weight")):
        gain = RESIDUAL_GAIN
    elif spec.name.endswith(("attn_q.weight", "attn_k.weight")):
        gain = QK_GAIN
    return gain / np.sqrt(spec.shape[1])


def _float_values(spec: _TensorSpec, seed: int, n_embd: int) -> np.ndarray:
    rng = _name_seed(seed, spec.name, 0)
    z = rng.standard_normal(spec.shape)
    if spec.kind == "norm":
        if spec.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            return QK_NORM_SCALE + NORM_JITTER * z
        return 1.0 + NORM_JITTER * z
    if spec.kind == "bias":
        return BIAS_STD * z
    return _std_for(spec, n_embd) * z


def _encode(values: np.ndarray, qtype: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """(array, raw_dtype) for GGUFWriter.add_tensor."""
    if qtype == "F32":
        return values.astype(np.float32), None
    if qtype == "F16":
        return values.astype(np.float16), None
    gq = GGMLQuantizationType[qtype]
    block, _ = GGML_QUANT_SIZES[gq]
    if values.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block}, got {values.shape}")
    return quantize(values.astype(np.float32), gq), gq


def _tensor_data(
    spec: _TensorSpec, seed: int, n_embd: int, perturb: float | None
) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    if spec.qtype in KQUANT_TYPES:
        rng = _name_seed(seed, spec.name, 0)
        blocks = random_kquant_blocks(
            rng, spec.shape[0], spec.shape[1], spec.qtype, _std_for(spec, n_embd)
        )
        if perturb:
            blocks = blocks.perturbed(_name_seed(seed, spec.name, 1), perturb)
        return blocks.pack(), GGMLQuantizationType[spec.qtype]
    values = _float_values(spec, seed, n_embd)
    if perturb:
        rng2 = _name_seed(seed, spec.name, 1)
        rms = float(np.sqrt(np.mean(values * values)))
        values = values + perturb * rms * rng2.standard_normal(values.shape)
    return _encode(values, spec.qtype)


@dataclass(frozen=True)
class _Config:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab: TinyVocab
    tied: bool
    weight_type: str
    embed_type: str
    output_type: str
    norm_type: str
    context_length: int
    rms_eps: float
    rope_freq_base: float
    rope_dim: int | None = None  # rotated dims per head (None: all of head_dim)
    value_type: str | None = None  # attn_v's type where it differs (Q4_K_M files: Q6_K)
    # gemma3: the sliding window (0: none), its layer pattern (a period or one bool a
    # layer; None: not written), the sliding layers' rope base, final soft-capping
    sliding_window: int = 0
    swa_pattern: int | list[bool] | None = None
    rope_freq_base_swa: float | None = None
    final_softcap: float | None = None


def add_tokenizer(w: GGUFWriter, voc: TinyVocab) -> None:
    """The tokenizer keys, as convert_hf_to_gguf.py writes a gpt2-style BPE vocabulary."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(voc.pre)
    w.add_token_list(voc.tokens)
    w.add_token_types(voc.token_types)
    w.add_token_merges(voc.merges)
    w.add_bos_token_id(voc.bos_id)
    w.add_eos_token_id(voc.eos_id)
    w.add_pad_token_id(voc.pad_id)
    w.add_add_bos_token(False)
    w.add_chat_template(voc.chat_template)


def _write(
    path: Path,
    cfg: _Config,
    *,
    seed: int,
    perturb: float | None,
    arch_name: str | None = None,
    type_overrides: dict[str, str] | None = None,
    drop: Sequence[str] = (),
    extra: Callable[[GGUFWriter], None] | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write `cfg`'s model (arch_name: the architecture key written instead; drop: tensors
    left out; extra: called with the writer after the tensors, to add keys and tensors;
    tensors: given float32 values for tensors of those names)."""
    arch = arch_name or cfg.arch
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{cfg.arch}-{cfg.weight_type}")
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_rope_dimension_count(cfg.rope_dim or cfg.head_dim)
    if cfg.arch in ("qwen3", "gemma3") or cfg.head_dim * cfg.n_head != cfg.n_embd:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if isinstance(cfg.swa_pattern, list):
        w.add_array(f"{arch}.attention.sliding_window_pattern", cfg.swa_pattern)
    elif cfg.swa_pattern is not None:
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", cfg.swa_pattern)
    if cfg.rope_freq_base_swa is not None:
        w.add_float32(f"{arch}.rope.freq_base_swa", cfg.rope_freq_base_swa)
    if cfg.final_softcap is not None:
        w.add_final_logit_softcapping(cfg.final_softcap)
    if cfg.arch == "llama":
        w.add_vocab_size(len(cfg.vocab.tokens))
    w.add_file_type(int(_FILE_TYPES[cfg.weight_type]))
    if cfg.weight_type not in ("F32", "F16", "BF16"):
        w.add_quantization_version(2)
    voc = cfg.vocab
    add_tokenizer(w, voc)

    specs = _tensor_specs(
        cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff,
        len(voc.tokens), cfg.tied, cfg.weight_type, cfg.embed_type, cfg.output_type,
        cfg.norm_type, cfg.value_type,
    )
    overrides = type_overrides or {}
    for spec in specs:
        if spec.name in drop:
            continue
        if tensors is not None and spec.name in tensors:  # given values (float32)
            w.add_tensor(spec.name, np.ascontiguousarray(tensors[spec.name], np.float32))
            continue
        if spec.name in overrides:
            raw = _unsupported_raw(spec, overrides[spec.name], seed)
            w.add_tensor(spec.name, raw, raw_dtype=GGMLQuantizationType[overrides[spec.name]])
            continue
        data, raw_dtype = _tensor_data(spec, seed, cfg.n_embd, perturb)
        w.add_tensor(spec.name, data, raw_dtype=raw_dtype)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _make_config(
    arch: str, weight_type: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
    head_dim: int | None, n_ff: int, vocab_size: int | None, tie_embeddings: bool | None,
    embed_type: str | None, output_type: str | None, norm_type: str, context_length: int,
    rms_eps: float | None, rope_freq_base: float | None, fim: bool = False,
) -> _Config:
    _check_type(arch, "architecture", ARCHES)
    _check_type(weight_type, "weight_type", WEIGHT_TYPES)
    embed_type = embed_type or weight_type
    output_type = output_type or weight_type
    _check_type(embed_type, "embed_type", WEIGHT_TYPES)
    _check_type(output_type, "output_type", WEIGHT_TYPES)
    _check_type(norm_type, "norm_type", NORM_TYPES)
    if n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    if head_dim is None:
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if tie_embeddings is None:  # gemma3's tiny embeddings are too small to be its output
        tie_embeddings = arch not in ("qwen2", "gemma3")
    for qtype, in_dims in (
        (weight_type, {"n_embd": n_embd, "n_ff": n_ff, "n_head*head_dim": n_head * head_dim}),
        (embed_type, {"n_embd": n_embd}),
        (output_type, {"n_embd": n_embd}),
    ):
        block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
        for what, dim in in_dims.items():
            if dim % block:
                raise ValueError(f"{qtype} needs {what} to be a multiple of {block}, got {dim}")
    if rms_eps is None:
        rms_eps = 1e-5 if arch == "llama" else 1e-6
    if rope_freq_base is None:
        rope_freq_base = 10000.0 if arch == "llama" else 1000000.0
    return _Config(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=n_ff, vocab=build_vocab(arch, vocab_size, fim), tied=tie_embeddings,
        weight_type=weight_type, embed_type=embed_type, output_type=output_type,
        norm_type=norm_type, context_length=context_length, rms_eps=rms_eps,
        rope_freq_base=rope_freq_base,
    )


def write_tiny_gguf(
    path: str | Path,
    *,
    arch: str = "llama",
    weight_type: str = "Q8_0",
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_ff: int = 128,
    vocab_size: int | None = None,
    tie_embeddings: bool | None = None,
    embed_type: str | None = None,
    output_type: str | None = None,
    norm_type: str = "F32",
    perturb: float | None = None,
    context_length: int = 512,
    rms_eps: float | None = None,
    rope_freq_base: float | None = None,
    fim: bool = False,
    rope_dim: int | None = None,
    value_type: str | None = None,
    sliding_window: int = 0,
    swa_pattern: int | list[bool] | None = None,
    rope_freq_base_swa: float | None = None,
    final_softcap: float | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write a tiny random model and return its path (fim: add Qwen's FIM specials;
    rope_dim: partial rotary, the first rope_dim dims of each head rotated; value_type:
    attn_v's type, where it differs from the other matrices', as in Q4_K_M files).

    gemma3 (q/k norms, post-attention and post-FFN norms, tied): sliding_window (0: none),
    swa_pattern (a period or one bool a layer, written as given; None: not written, so
    Gemma 3's default applies), rope_freq_base_swa and final_softcap (None: not written).
    tensors: given float32 values for tensors of those names (written as F32).

    `weight_type` is used for every 2-D matmul weight and, unless `embed_type` /
    `output_type` say otherwise, for token_embd.weight / output.weight.  Norm weights use
    `norm_type`; qwen2 biases and qwen3 q/k norms are always F32.  `tie_embeddings`
    defaults to True for llama and qwen3, False for qwen2 and gemma3 (then output.weight is
    written).
    `vocab_size` defaults to the tokenizer's size rounded up to a multiple of 32 (320).
    K-quant types need every matmul input dimension (n_embd, n_ff, n_head*head_dim) to be
    a multiple of 256, the other quant types a multiple of 32; otherwise ValueError.
    """
    cfg = _make_config(
        arch, weight_type, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, vocab_size,
        tie_embeddings, embed_type, output_type, norm_type, context_length, rms_eps,
        rope_freq_base, fim,
    )
    if rope_dim is not None:
        cfg = dataclasses.replace(cfg, rope_dim=rope_dim)
    if value_type is not None:
        _check_type(value_type, "value_type", WEIGHT_TYPES)
        cfg = dataclasses.replace(cfg, value_type=value_type)
    cfg = dataclasses.replace(cfg, sliding_window=sliding_window, swa_pattern=swa_pattern,
                              rope_freq_base_swa=rope_freq_base_swa, final_softcap=final_softcap)
    return _write(Path(path), cfg, seed=seed, perturb=perturb, tensors=tensors)


# ---------------------------------------------------------------------------------------
# corrupt files
# ---------------------------------------------------------------------------------------


def _unsupported_raw(spec: _TensorSpec, qtype: str, seed: int) -> np.ndarray:
    """Random raw blocks of `qtype` with sane (finite, small) f16 scales."""
    gq = GGMLQuantizationType[qtype]
    block, type_size = GGML_QUANT_SIZES[gq]
    rows, cols = spec.shape
    if cols % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block}, got {cols}")
    rng = _name_seed(seed, spec.name, 7)
    nb = rows * cols // block
    raw = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    scale = np.full((nb,), 0.01, dtype="<f2").view(np.uint8).reshape(nb, 2)
    if qtype == "Q2_K":  # scales(16) qs(64) d dmin
        raw[:, -4:-2] = scale
        raw[:, -2:] = scale
    else:  # IQ2_XXS and most i-quants: d first
        raw[:, 0:2] = scale
    return raw.reshape(rows, cols // block * type_size)


def write_corrupt_variants(directory: str | Path) -> dict[str, Path]:
    """Files a loader must reject, by kind:

    * "truncated": a valid llama Q8_0 file cut in the middle of its tensor data.
    * "garbage": 4 KiB of random bytes.  * "empty": a zero-byte file.
    * "unknown_arch": a well-formed file whose general.architecture is "mamba9"
      (keys "mamba9.*", llama tensors).
    * "unsupported_type": llama (n_embd=256, n_ff=512) whose blk.0.attn_q.weight is
      IQ2_XXS raw blocks; "unsupported_q2_k": the same with blk.0.ffn_up.weight as Q2_K.
    * "missing_tensor": a llama Q8_0 file without blk.1.ffn_down.weight.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    base = _make_config(
        "llama", "Q8_0", 2, 64, 4, 2, None, 128, None, None, None, None, "F32", 512, None, None
    )
    big = _make_config(
        "llama", "Q8_0", 1, 256, 4, 2, None, 512, None, None, None, None, "F32", 512, None, None
    )

    good = _write(d / "good_source.gguf", base, seed=3, perturb=None)
    blob = good.read_bytes()
    from gguf import GGUFReader

    reader = GGUFReader(str(good), "r")
    start = min(int(t.data_offset) for t in reader.tensors)
    del reader
    cut = start + (len(blob) - start) // 2
    out["truncated"] = d / "truncated.gguf"
    out["truncated"].write_bytes(blob[:cut])
    good.unlink()

    rng = np.random.default_rng(1234)
    out["garbage"] = d / "garbage.gguf"
    out["garbage"].write_bytes(rng.integers(0, 256, size=4096, dtype=np.uint8).tobytes())
    out["empty"] = d / "empty.gguf"
    out["empty"].write_bytes(b"")

    out["unknown_arch"] = _write(
        d / "unknown_arch.gguf", base, seed=3, perturb=None, arch_name="mamba9"
    )
    out["unsupported_type"] = _write(
        d / "unsupported_iq2_xxs.gguf", big, seed=3, perturb=None,
        type_overrides={"blk.0.attn_q.weight": "IQ2_XXS"},
    )
    out["unsupported_q2_k"] = _write(
        d / "unsupported_q2_k.gguf", big, seed=3, perturb=None,
        type_overrides={"blk.0.ffn_up.weight": "Q2_K"},
    )
    out["missing_tensor"] = _write(
        d / "missing_tensor.gguf", base, seed=3, perturb=None, drop=("blk.1.ffn_down.weight",)
    )
    return out


def write_tiny_qwen2vl(path: str | Path, *, sections: Sequence[int] = (2, 3, 3, 0),
                       seed: int = 0, weight_type: str = "F32", n_head: int = 4,
                       n_embd: int = 64, context_length: int = 512) -> Path:
    """A tiny `qwen2vl` model (Qwen2-VL's text model): qwen2's tensors and tokenizer, and
    M-RoPE's `rope.dimension_sections` (pairs per position section t, h, w, e)."""
    cfg = _make_config("qwen2", weight_type, 2, n_embd, n_head, 2, None, 128, None, None,
                       None, None, "F32", context_length, None, None)
    return _write(Path(path), cfg, seed=seed, perturb=None, arch_name="qwen2vl",
                  extra=lambda w: w.add_array("qwen2vl.rope.dimension_sections",
                                              list(sections)))
