"""Copies of a GGUF file with keys set or dropped and tensors dropped or replaced (gguf-py's
reader and writer): the bad variants of a good file that error-message tests need."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def rewrite(src: Path, dst: Path, *, keys: dict[str, Any] | None = None,
            drop_keys: tuple[str, ...] = (), drop_tensors: tuple[str, ...] = (),
            tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the GGUF `src` with string/int/list keys set or dropped, tensors dropped
    or replaced (float32)."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    keys = dict(keys or {})
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys:
            continue
        if name in keys:
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, value in keys.items():
        if isinstance(value, list):
            w.add_array(name, value)
            continue
        vtype = GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.UINT32
        w.add_key_value(name, value, vtype)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        if tensors and t.name in tensors:
            w.add_tensor(t.name, tensors[t.name].astype(np.float32))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
