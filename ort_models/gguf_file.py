"""Reading GGUF files: metadata, tensors and a content hash, with clear errors.

Everything that opens a GGUF goes through `GGUFFile`, so a corrupt or truncated file
fails in one place with one message naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class GGUFError(Exception):
    """A GGUF file that cannot be used; the message is meant for the user as is."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    type_name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) == (ne1, ne0)
    data: np.ndarray  # raw bytes/elements as memory-mapped by gguf.GGUFReader


_ARRAY_STR_LIMIT = 1 << 22


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    if not field.types:
        return None
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        # numeric arrays: one part per element; join them with numpy for speed
        parts = [field.parts[i] for i in field.data]
        if not parts:
            return []
        return np.concatenate(parts).tolist()
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]


class GGUFFile:
    """A GGUF file opened read-only (memory-mapped)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            from gguf import GGUFReader

            self._reader = GGUFReader(str(self.path), "r")
        except Exception as exc:  # the reader raises many kinds on bad input
            raise GGUFError(f"{self.path}: not a readable GGUF file ({_describe(exc)})") from None
        self.metadata: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = _field_value(field)
            except Exception as exc:
                raise GGUFError(f"{self.path}: metadata key {name!r} is corrupt ({exc})") from None
        self.tensors: dict[str, TensorInfo] = {}
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFError(
                    f"{self.path}: truncated file: tensor {t.name!r} needs bytes up to {end:,} "
                    f"but the file has {size:,}"
                )
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(
                name=t.name,
                ggml_type=int(t.tensor_type),
                type_name=t.tensor_type.name,
                shape=shape,
                data=t.data,
            )
        if "general.architecture" not in self.metadata:
            raise GGUFError(f"{self.path}: GGUF file has no general.architecture key")

    @property
    def arch(self) -> str:
        return str(self.metadata["general.architecture"])

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, e.g. arch_key('block_count')."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key {full!r}")
        return self.metadata[full]

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def content_hash(self) -> str:
        return content_hash(self.path)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def content_hash(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, remembered per (path, size, mtime) so big files hash once."""
    from .paths import cache_dir

    p = Path(path).resolve()
    st = p.stat()
    index_path = cache_dir() / "hashes.json"
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    index[key] = digest
    index_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index))
    os.replace(tmp, index_path)
    return digest
