"""A reader of Hugging Face safetensors checkpoints, numpy only (no torch).

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian data. A sharded
checkpoint lists its files in `model.safetensors.index.json`. Tensors are memory-mapped
and read when asked for; BF16 (which numpy lacks) reads as float32, exactly (a bf16 value
is the high half of the float32 with the same value).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConvertError

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # a header past 100 MB is a corrupt length, not a checkpoint

# safetensors dtype -> numpy dtype of the stored bytes (BF16 is read as raw uint16)
_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?",
}


@dataclass(frozen=True)
class SafeTensor:
    """One tensor of a checkpoint: where its bytes are, and how to read them."""

    name: str
    dtype: str  # the safetensors dtype: "F32", "BF16", "I64", ...
    shape: tuple[int, ...]
    file: Path
    start: int  # byte offset of the data in `file`
    nbytes: int

    def read(self) -> np.ndarray:
        """The values: float16 / float32 / integer / bool as stored, BF16 and F64 as
        float32 (what a converter computes with)."""
        raw = np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.start,
                        shape=(self.nbytes,)) if self.nbytes else np.zeros(0, np.uint8)
        data = raw.view(_DTYPES[self.dtype]).reshape(self.shape)
        if self.dtype == "BF16":
            # [shape] bf16 bits -> the float32 whose high 16 bits they are
            return (data.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == "F64":
            return data.astype(np.float32)
        return np.array(data)  # a copy: the checkpoint file is not held open


def _read_header(path: Path) -> dict[str, SafeTensor]:
    """The tensors of one safetensors file, in its header's order."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConvertError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ConvertError(f"{path}: not a safetensors file (header length {n} past the "
                               f"file's {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConvertError(f"{path}: not a safetensors file (header: {exc})") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: not a safetensors file (the header is not an object)")
    data_start = 8 + n
    out: dict[str, SafeTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: tensor {name!r} has a malformed header entry "
                               f"{info!r}") from None
        if dtype not in _DTYPES:
            raise ConvertError(f"{path}: tensor {name!r} is {dtype}; supported dtypes are "
                               f"{', '.join(_DTYPES)} (quantized checkpoints, FP8 included, "
                               "are not)")
        itemsize = np.dtype(_DTYPES[dtype]).itemsize
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise ConvertError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has "
                               f"{end - begin} bytes of data")
        if data_start + end > size:
            raise ConvertError(f"{path}: truncated: tensor {name!r} ends at byte "
                               f"{data_start + end}, the file has {size}")
        out[name] = SafeTensor(name, dtype, shape, path, data_start + begin, end - begin)
    return out


def read_checkpoint_tensors(directory: Path) -> dict[str, SafeTensor]:
    """Every tensor of the checkpoint in `directory`, in the order llama.cpp's converter
    visits them: the files named by the index (or `model*.safetensors`) sorted by name,
    each file's tensors in its header's order."""
    index = directory / INDEX_FILE
    weight_map: dict[str, str] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{index}: no 'weight_map' object") from None
        parts = sorted(set(weight_map.values()))
    else:
        parts = sorted(p.name for p in directory.iterdir()
                       if p.name.startswith("model") and p.name.endswith(".safetensors"))
    if not parts:
        hint = (" (PyTorch .bin checkpoints need torch: save them as safetensors first)"
                if any(directory.glob("pytorch_model*.bin")) else "")
        raise ConvertError(f"{directory}: no model*.safetensors files{hint}")
    tensors: dict[str, SafeTensor] = {}
    for part in parts:
        path = directory / part
        if not path.is_file():
            raise ConvertError(f"{directory}: {INDEX_FILE} names {part}, which is missing")
        for name, t in _read_header(path).items():
            if name in tensors:
                raise ConvertError(f"{directory}: tensor {name!r} appears in two files")
            tensors[name] = t
    if weight_map and set(weight_map) != set(tensors):
        missing = sorted(set(weight_map) - set(tensors))
        extra = sorted(set(tensors) - set(weight_map))
        raise ConvertError(f"{directory}: {INDEX_FILE} and the files disagree: missing "
                           f"{missing[:5]}, not in the index {extra[:5]}")
    return tensors
