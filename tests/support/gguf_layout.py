"""A GGUF file as gguf's GGUFReader sees it, for comparing two writers' files: typed keys
in order, tensor infos (name, type, shape, offset) in order, the tensor data's bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader


def gguf_layout(path: Path) -> dict[str, Any]:
    """keys: {key: ([GGUF types], value)}, order: the keys in file order, tensors: [(name,
    type, shape, offset)], data: the bytes from the first tensor on, size: the file's."""
    r = GGUFReader(path)
    keys = {}
    for key, field in r.fields.items():
        if not key.startswith("GGUF."):
            keys[key] = ([t.name for t in field.types], field.contents())
    tensors = [(t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset))
               for t in r.tensors]
    data_start = min(int(t.data_offset) for t in r.tensors) + r.data_offset
    return {"keys": keys, "order": list(keys), "tensors": tensors,
            "data": path.read_bytes()[data_start:], "size": path.stat().st_size}
