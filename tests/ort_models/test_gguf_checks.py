"""GGUF validation before anything is allocated (issue 40, item 5): each defect the fuzzer
found, on a real tiny GGUF file written by tiny_gguf.py (or SmolLM2's header), gives one
GGUFError line naming the file and the key or tensor, fast, and nothing is built."""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.model_cache import load_or_build, validate_gguf
from specd.ort_models.paths import cache_dir

from tiny_gguf import write_tiny_gguf

SMOLLM2 = "smollm2-135m-instruct"


def rewrite(src: Path, dst: Path, *, tensors: Mapping[str, tuple[np.ndarray, str]] = (
        {}), metadata: Mapping[str, tuple[Any, int, int | None]] = {},
        drop: Sequence[str] = ()) -> Path:
    """A copy of GGUF `src` written by gguf's own writer (so laid out as llama.cpp lays a
    file out), with tensors replaced ({name: (array, type)}), metadata set ({key: (value,
    GGUF value type, array item type)}) or dropped."""
    f = GGUFFile(src)
    w = GGUFWriter(str(dst), f.arch)
    values = {k: (v, *f.value_types[k]) for k, v in f.metadata.items()} | dict(metadata)
    for key, (value, vtype, etype) in values.items():
        if key != "general.architecture" and key not in drop:
            w.add_key_value(key, value, GGUFValueType(vtype),
                            None if etype is None else GGUFValueType(etype))
    for name in [*f.tensors, *(n for n in tensors if n not in f.tensors)]:
        if name in drop:
            continue
        if name in tensors:  # replaced, or added after the file's own
            array, qtype = tensors[name]
            raw, shape = np.ascontiguousarray(array).view(np.uint8), array.shape
        else:
            t = f.tensors[name]
            raw, shape, qtype = np.asarray(t.data), t.shape, t.type_name
        w.add_tensor(name, raw.reshape(*shape[:-1], -1),
                     raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _entry(blob: bytes, name: str) -> int:
    """Where the bytes after the length-prefixed string `name` start in `blob`."""
    raw = name.encode()
    at = blob.find(struct.pack("<Q", len(raw)) + raw)
    assert at >= 0, name
    return at + 8 + len(raw)


def patched(src: Path, dst: Path, edits: Sequence[tuple[str, int, str, Any]]) -> Path:
    """A copy of `src` with struct values written at (string, offset after it, format,
    value): a metadata value or a tensor info field, the file's size unchanged."""
    blob = bytearray(src.read_bytes())
    for name, delta, fmt, value in edits:
        struct.pack_into("<" + fmt, blob, _entry(bytes(blob), name) + delta, value)
    dst.write_bytes(bytes(blob))
    return dst


def _tensor_field(blob: bytes, name: str, field: str) -> int:
    """Offset (after the name) of a tensor info's `dims` / `type` / `offset` field."""
    n_dims = struct.unpack_from("<I", blob, _entry(blob, name))[0]
    return {"dims": 4, "type": 4 + 8 * n_dims, "offset": 8 + 8 * n_dims}[field]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache dir of the test's own: `_fails` checks that nothing was built there."""
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", weight_type="Q8_0")


def _fails(path: Path, message: str, seconds: float = 5.0) -> str:
    """load_or_build(path) raises one GGUFError line naming the file and matching
    `message`, within `seconds`, having built nothing."""
    graphs = set((cache_dir() / "graphs").glob("*"))
    t0 = time.monotonic()
    with pytest.raises(GGUFError, match=message) as info:
        load_or_build(path)
    assert time.monotonic() - t0 < seconds
    text = str(info.value)
    assert "\n" not in text and path.name in text, text
    assert set((cache_dir() / "graphs").glob("*")) == graphs  # nothing built
    return text


# --- counts and lengths against the file's size


@pytest.mark.parametrize("key, value, message", [
    ("llama.block_count", 2**31 - 1, r"block_count is 2,147,483,647, but the file holds "
                                     r"only 20 tensors"),
    ("llama.context_length", 2**31, r"context_length 2,147,483,648 is not credible"),
    ("llama.context_length", 2**32 - 1, r"rotary tables alone would take"),
])
def test_huge_hyper_parameters_fail_at_once(tiny, tmp_path, key, value, message) -> None:
    """Before: a huge block_count looped and allocated per layer, a huge context_length
    allocated its rotary tables (over 2 GB, growing) before any check."""
    bad = patched(tiny, tmp_path / "bad.gguf", [(key, 4, "I", value)])
    _fails(bad, message)


def test_huge_array_and_string_lengths_fail_at_once(tiny, tmp_path) -> None:
    blob = tiny.read_bytes()
    count_at = 4 + 4  # after the key: value type 9, item type, then the count
    bad = patched(tiny, tmp_path / "bad.gguf", [("tokenizer.ggml.tokens", count_at, "Q", 2**60)])
    _fails(bad, r"metadata key 'tokenizer.ggml.tokens'.*an array of 1,152,921,504,606,846,976 "
                r"items cannot fit")
    at = _entry(blob, "general.name")  # a string value: its type, then its length
    cut = bytearray(blob)
    struct.pack_into("<Q", cut, at + 4, 2**62)
    (tmp_path / "long.gguf").write_bytes(bytes(cut))
    _fails(tmp_path / "long.gguf", r"truncated file \(metadata key 'general.name' needs byte")
    counts = bytearray(blob)
    struct.pack_into("<Q", counts, 8, 2**40)  # n_tensors
    (tmp_path / "counts.gguf").write_bytes(bytes(counts))
    _fails(tmp_path / "counts.gguf", r"corrupt header counts: 1,099,511,627,776 tensors")


# --- offsets, alignment, blocks


def test_misaligned_overlapping_and_shifted_tensor_data_is_refused(tiny, tmp_path) -> None:
    """Before, each of these was accepted and gave NaN logits."""
    blob = tiny.read_bytes()
    name = "blk.0.ffn_norm.weight"
    off = _tensor_field(blob, name, "offset")
    orig = struct.unpack_from("<Q", blob, _entry(blob, name) + off)[0]
    bad = patched(tiny, tmp_path / "misaligned.gguf", [(name, off, "Q", orig + 4)])
    _fails(bad, r"tensor 'blk.0.ffn_norm.weight' has data offset [\d,]+, not a multiple of "
                r"the alignment 32")
    q_off = struct.unpack_from("<Q", blob, _entry(blob, "blk.0.attn_q.weight")
                               + _tensor_field(blob, "blk.0.attn_q.weight", "offset"))[0]
    bad = patched(tiny, tmp_path / "overlap.gguf", [(name, off, "Q", q_off)])
    _fails(bad, r"tensor 'blk.0.ffn_norm.weight' \(data at offset [\d,]+\) overlaps the data "
                r"of tensor 'blk.0.attn_q.weight'")
    # the last tensor's type shrunk (F32 -> F16): its data no longer ends the file
    last = list(GGUFFile(tiny).tensors)[-1]
    bad = patched(tiny, tmp_path / "shrunk.gguf",
                  [(last, _tensor_field(blob, last, "type"), "I", 1)])
    _fails(bad, r"goes on [\d,]+ bytes past the end of its last tensor's data "
                r"\('output_norm.weight'\)")


@pytest.mark.parametrize("value, vtype, message", [
    (48, GGUFValueType.UINT32, r"general.alignment must be a power of two, got 48"),
    (0, GGUFValueType.UINT32, r"general.alignment must be a power of two, got 0"),
    (32.0, GGUFValueType.FLOAT32, r"metadata key 'general.alignment' must be an integer, "
                                  r"got float32"),
])
def test_a_bad_alignment_is_refused(tiny, tmp_path, value, vtype, message) -> None:
    bad = rewrite(tiny, tmp_path / "bad.gguf", metadata={
        "general.alignment": (value, vtype, None)})
    _fails(bad, message)


def test_an_alignment_that_moves_the_data_is_refused(tiny, tmp_path) -> None:
    """A header claiming 16 where the data was laid out at 32: the offsets still line up,
    but the data section would start 16 bytes early (before: accepted, NaN logits)."""
    for k in range(32):  # a name of the length that puts the header's end where 16 moves it
        src = rewrite(tiny, tmp_path / "with32.gguf", metadata={
            "general.name": ("n" * k, GGUFValueType.STRING, None),
            "general.alignment": (32, GGUFValueType.UINT32, None)})
        if 0 < GGUFFile(src).header_size % 32 <= 16:
            break
    else:
        pytest.fail("no header length found")
    bad = patched(src, tmp_path / "bad.gguf", [("general.alignment", 4, "I", 16)])
    _fails(bad, r"goes on 16 bytes past the end of its last tensor's data")


def test_a_type_whose_blocks_do_not_divide_the_rows_is_named(tiny, tmp_path) -> None:
    """Before: a raw numpy reshape error."""
    blob = tiny.read_bytes()
    name = "blk.1.attn_v.weight"
    bad = patched(tiny, tmp_path / "bad.gguf",
                  [(name, _tensor_field(blob, name, "type"), "I", 12)])  # Q4_K: 256 a block
    _fails(bad, r"tensor 'blk.1.attn_v.weight' has rows of 64 values, not whole Q4_K blocks "
                r"of 256")


def test_dimensions_beyond_ggml_are_refused(tiny, tmp_path) -> None:
    blob = tiny.read_bytes()
    name = "blk.0.attn_q.weight"
    bad = patched(tiny, tmp_path / "zero.gguf", [(name, 4, "Q", 0)])
    _fails(bad, r"tensor 'blk.0.attn_q.weight': has dimensions \[0, 64\]")
    dims = patched(tiny, tmp_path / "dims.gguf", [(name, 0, "I", 5)])
    _fails(dims, r"tensor 'blk.0.attn_q.weight': has 5 dimensions \(GGUF allows 4\)")
    assert _tensor_field(blob, name, "type") == 20  # two dimensions


# --- tensors against the hyper-parameters


@pytest.mark.parametrize("name, length", [("blk.0.attn_norm.weight", 32),
                                          ("blk.1.ffn_norm.weight", 128),
                                          ("output_norm.weight", 16)])
def test_a_norm_of_the_wrong_length_is_named(tiny, tmp_path, name, length) -> None:
    """Before: accepted, and every request failed at the first token inside ONNX Runtime."""
    bad = rewrite(tiny, tmp_path / "bad.gguf",
                  tensors={name: (np.ones(length, np.float32), "F32")})
    _fails(bad, rf"tensor {name} is \[{length}\], but the metadata \(embedding_length 64.*"
                rf"implies \[64\]")


def test_per_head_norms_and_biases_are_checked(tmp_path) -> None:
    qwen3 = write_tiny_gguf(tmp_path / "q3.gguf", arch="qwen3", weight_type="F16")
    bad = rewrite(qwen3, tmp_path / "q3bad.gguf",
                  tensors={"blk.1.attn_k_norm.weight": (np.ones(32, np.float32), "F32")})
    _fails(bad, r"tensor blk.1.attn_k_norm.weight is \[32\].*implies \[16\]")
    qwen2 = write_tiny_gguf(tmp_path / "q2.gguf", arch="qwen2", weight_type="Q8_0")
    bad = rewrite(qwen2, tmp_path / "q2bad.gguf",
                  tensors={"blk.0.attn_v.bias": (np.zeros(64, np.float32), "F32")})
    _fails(bad, r"tensor blk.0.attn_v.bias is \[64\].*implies \[32\]")
    missing = rewrite(qwen2, tmp_path / "q2missing.gguf", drop=("blk.1.attn_q.bias",))
    _fails(missing, r"missing tensor 'blk.1.attn_q.bias'")
    quantized = rewrite(qwen2, tmp_path / "q2quant.gguf", tensors={
        "blk.0.attn_norm.weight": (np.zeros(68, np.uint8), "Q8_0")})  # 64 values
    _fails(quantized, r"tensor blk.0.attn_norm.weight is stored as Q8_0; specd reads "
                      r"vectors \(norms, biases\) as F32, F16, BF16")


def test_extra_norms_of_an_architecture_are_tolerated(tiny, tmp_path) -> None:
    """Norms llama.cpp's other architectures add (gemma's post-norms, q/k norms read whole)
    pass where they have n_embd or head_dim values, and are named otherwise."""
    extra = rewrite(tiny, tmp_path / "extra.gguf", tensors={
        "blk.0.post_attention_norm.weight": (np.ones(64, np.float32), "F32"),
        "blk.0.attn_q_norm.weight": (np.ones(64, np.float32), "F32"),
        "blk.1.attn_k_norm.weight": (np.ones(16, np.float32), "F32")})
    f = GGUFFile(extra)
    assert validate_gguf(f).n_layer == 2
    bad = rewrite(tiny, tmp_path / "bad.gguf", tensors={
        "blk.0.post_ffw_norm.weight": (np.ones(16, np.float32), "F32")})
    _fails(bad, r"tensor blk.0.post_ffw_norm.weight is \[16\].*implies \[64\]")


def test_embeddings_with_fewer_rows_than_the_vocabulary_are_named(tiny, tmp_path) -> None:
    """Before: accepted, and the first token past the table crashed the request."""
    embd = GGUFFile(tiny).tensor("token_embd.weight")
    rows = np.asarray(embd.data).reshape(embd.shape[0], -1)[:256]
    bad = rewrite(tiny, tmp_path / "bad.gguf",
                  tensors={"token_embd.weight": (rows, "Q8_0")},
                  metadata={"llama.vocab_size": (256, GGUFValueType.UINT32, None)})
    _fails(bad, r"tensor token_embd.weight has 256 rows, fewer than the vocabulary's 352 "
                r"tokens")


def test_an_output_matrix_of_other_rows_is_named(tmp_path) -> None:
    qwen2 = write_tiny_gguf(tmp_path / "q2.gguf", arch="qwen2", weight_type="F32")
    out = GGUFFile(qwen2).tensor("output.weight")
    rows = np.asarray(out.data).view(np.float32).reshape(out.shape)[:320]
    bad = rewrite(qwen2, tmp_path / "bad.gguf", tensors={"output.weight": (rows, "F32")})
    _fails(bad, r"tensor output.weight is \[320, 64\], but token_embd.weight implies "
                r"\[352, 64\]")


def test_nan_weights_are_refused_before_a_build(tiny, tmp_path) -> None:
    norm = np.ones(64, np.float32)
    norm[7] = np.nan
    bad = rewrite(tiny, tmp_path / "nan.gguf",
                  tensors={"blk.1.attn_norm.weight": (norm, "F32")})
    _fails(bad, r"tensor blk.1.attn_norm.weight holds NaN or infinite values")
    blob = bytearray(tiny.read_bytes())
    f = GGUFFile(tiny)
    q = f.tensor("blk.0.ffn_up.weight")  # Q8_0: a float16 scale leads each 34-byte block
    at = f.data_start + q.offset + 34 * 5
    blob[at:at + 2] = np.float16(np.inf).tobytes()
    (tmp_path / "inf.gguf").write_bytes(bytes(blob))
    _fails(tmp_path / "inf.gguf", r"tensor blk.0.ffn_up.weight holds NaN or infinite values")


# --- the tokenizer's keys


def test_corrupt_merges_are_named(tiny, tmp_path) -> None:
    """Before: a traceback from the tokenizers library (a bare Exception)."""
    merges = list(GGUFFile(tiny).metadata["tokenizer.ggml.merges"])
    for i, bad_merge, message in [
            (3, "h\x01 e", r"merge #3 'h\\x01 e': 'h\\x01' is not a token"),
            (5, "on", r"merge #5 'on' is not two tokens with one space between them"),
            (7, "e r s", r"merge #7 'e r s' is not two tokens")]:
        changed = [*merges[:i], bad_merge, *merges[i + 1:]]
        bad = rewrite(tiny, tmp_path / f"bad{i}.gguf", metadata={
            "tokenizer.ggml.merges": (changed, GGUFValueType.ARRAY, GGUFValueType.STRING)})
        with pytest.raises(GGUFError, match=message) as info:
            GGUFFile(bad)  # before the tokenizer is built from it
        assert "tokenizer.ggml.merges" in str(info.value) and bad.name in str(info.value)
    tokens = list(GGUFFile(tiny).metadata["tokenizer.ggml.tokens"])
    tokens[tokens.index("Ġthe")] = "Ġth e"  # a token a merge makes, respelled
    bad = rewrite(tiny, tmp_path / "tokens.gguf", metadata={
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)})
    with pytest.raises(GGUFError, match=r"merge #6 'Ġt he': 'Ġthe' is not a token"):
        GGUFFile(bad)


def test_tokenizer_keys_of_the_wrong_type_or_length_are_named(tiny, tmp_path) -> None:
    f = GGUFFile(tiny)
    cases: list[tuple[dict[str, tuple[Any, int, int | None]], str]] = [
        ({"tokenizer.ggml.bos_token_id": ("1", GGUFValueType.STRING, None)},
         r"metadata key 'tokenizer.ggml.bos_token_id' must be an integer, got string"),
        ({"tokenizer.ggml.token_type": (f.metadata["tokenizer.ggml.token_type"][:-1],
                                        GGUFValueType.ARRAY, GGUFValueType.INT32)},
         r"tokenizer.ggml.token_type has 351 entries for 352 tokens"),
        ({"tokenizer.ggml.merges": ([1, 2], GGUFValueType.ARRAY, GGUFValueType.INT32)},
         r"metadata key 'tokenizer.ggml.merges' must be an array of strings, got an array "
         r"of int32"),
    ]
    for i, (metadata, message) in enumerate(cases):
        bad = rewrite(tiny, tmp_path / f"bad{i}.gguf", metadata=metadata)
        with pytest.raises(GGUFError, match=message):
            GGUFFile(bad)


def test_duplicate_keys_and_long_names_are_refused(tiny, tmp_path) -> None:
    blob = tiny.read_bytes()
    key = b"general.name"
    at = blob.find(struct.pack("<Q", len(key)) + key)
    end = _entry(blob, "general.name") + 4
    end += 8 + struct.unpack_from("<Q", blob, end)[0]
    entry = blob[at:end]
    dup = bytearray(blob[:end] + entry + blob[end:])
    struct.pack_into("<Q", dup, 16, struct.unpack_from("<Q", blob, 16)[0] + 1)
    (tmp_path / "dup.gguf").write_bytes(bytes(dup))
    with pytest.raises(GGUFError, match=r"metadata key 'general.name': appears twice"):
        GGUFFile(tmp_path / "dup.gguf")
    name = "blk.0.attn_q.weight"
    long = patched(tiny, tmp_path / "long.gguf", [])
    raw = bytearray(long.read_bytes())
    struct.pack_into("<Q", raw, _entry(bytes(raw), name) - len(name) - 8, 5000)
    long.write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.attn_q\.weight.*'\.\.\.: name of "
                                        r"5,000 bytes \(GGUF allows 63\)"):
        GGUFFile(long)


# --- real files still load


@pytest.mark.real
def test_the_catalog_models_on_disk_pass_every_check() -> None:
    """The catalog's real files in the store (SmolLM2 fetched if it is not there yet): their
    headers, shapes and layout."""
    from conftest import fetched_model

    from specd.daemon.models.catalog import CATALOG
    from specd.daemon.models.store import model_path
    from specd.ort_models.arch import READERS
    from specd.ort_models.tensor_checks import check_model

    smol = fetched_model("smollm2-135m-instruct")
    found = {smol, *(model_path(n) for n in CATALOG if model_path(n).is_file())}
    for path in sorted(found):
        f = GGUFFile(path)
        if f.arch in READERS:
            from specd.ort_models.arch import read_hparams

            check_model(f, read_hparams(f))
