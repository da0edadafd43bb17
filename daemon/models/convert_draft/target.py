"""What a head conversion takes from its target GGUF: the values llama.cpp's converter
reads from `--target-model-dir` (hidden size, depth, vocabulary size, whether the target
uses M-RoPE, whether it is a Gemma) and the tokenizer keys it copies into the head, with
their GGUF value types so they are written back exactly as they are."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .errors import ConvertError

# GGUF value type -> struct format of its scalar
_SCALAR = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class TypedValue:
    """A metadata value as stored: its type, the element type of an array, the value
    (strings as their raw UTF-8 bytes, so they are copied byte for byte)."""

    type: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class TargetInfo:
    """The target model a head drafts for."""

    path: Path
    arch: str
    n_embd: int  # embedding_length: the width of each hidden state a head reads
    n_layer: int  # block_count
    n_vocab: int  # tokens in its vocabulary
    uses_mrope: bool  # writes rope.dimension_sections (Qwen2-VL / Qwen3-VL / Qwen3.5)
    is_gemma: bool  # Gemma scales token embeddings by sqrt(n_embd) in its forward pass
    tokenizer: dict[str, TypedValue]  # every tokenizer.* key, in the file's order


class _Reader:
    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise ConvertError(f"{self.path}: truncated GGUF header")
        (v,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return v

    def raw_string(self) -> bytes:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise ConvertError(f"{self.path}: truncated GGUF header")
        out = self.data[self.pos:self.pos + n]  # a copy: bytes outlive the mapping
        self.pos += n
        return out

    def value(self, vtype: GGUFValueType) -> TypedValue:
        if vtype in _SCALAR:
            return TypedValue(vtype, self.take(_SCALAR[vtype]))
        if vtype == GGUFValueType.STRING:
            return TypedValue(vtype, self.raw_string())
        if vtype != GGUFValueType.ARRAY:
            raise ConvertError(f"{self.path}: unknown metadata value type {vtype}")
        sub, count = GGUFValueType(self.take("I")), self.take("Q")
        if sub == GGUFValueType.STRING:
            items: list[Any] = [self.raw_string() for _ in range(count)]
        elif sub in _SCALAR:
            fmt = _SCALAR[sub]
            size = struct.calcsize(fmt)
            if self.pos + size * count > len(self.data):
                raise ConvertError(f"{self.path}: truncated GGUF header")
            items = list(struct.unpack_from(f"<{count}{fmt}", self.data, self.pos))
            self.pos += size * count
        else:
            raise ConvertError(f"{self.path}: nested metadata arrays are not copied")
        return TypedValue(vtype, items, sub)


def _tokenizer_keys(path: Path) -> dict[str, TypedValue]:
    """Every `tokenizer.*` key of the GGUF at `path`, typed."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        r = _Reader(data, path)
        r.pos = 16  # magic, version, tensor count
        n_kv = r.take("Q")
        out: dict[str, TypedValue] = {}
        for _ in range(n_kv):
            key = r.raw_string().decode("utf-8", "replace")
            try:
                vtype = GGUFValueType(r.take("I"))
            except ValueError:
                raise ConvertError(f"{path}: unknown metadata value type for {key!r}") from None
            value = r.value(vtype)
            if key.startswith("tokenizer."):
                out[key] = value
    return out


def read_target(path: Path) -> TargetInfo:
    """The target GGUF at `path` (ConvertError where it lacks what a head needs)."""
    try:
        f = GGUFFile(path)
    except GGUFError as exc:
        raise ConvertError(str(exc)) from None

    def count(key: str) -> int:
        v = f.arch_key(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConvertError(f"{path}: the target has no usable {f.arch}.{key} ({v!r})")
        return v

    tokens = f.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConvertError(f"{path}: the target has no tokenizer (tokenizer.ggml.tokens); a "
                           "head takes its tokenizer from the target")
    sections = f.arch_key("rope.dimension_sections")
    return TargetInfo(
        path=path, arch=f.arch, n_embd=count("embedding_length"), n_layer=count("block_count"),
        n_vocab=len(tokens), uses_mrope=bool(sections and any(sections)),
        is_gemma=f.arch.startswith("gemma"), tokenizer=_tokenizer_keys(path))
