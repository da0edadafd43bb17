"""Reading GGUF files: metadata, tensors and a content hash, with clear errors.

Everything that opens a GGUF goes through `GGUFFile`, so a corrupt or truncated file
fails in one place with one message naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
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
    data: np.ndarray  # the tensor's raw bytes, uint8, memory-mapped


class _Cursor:
    """Little-endian reads over the memory-mapped file with bounds checks."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.mv, self.pos, self.path = buf.data, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.mv):
            raise GGUFError(f"{self.path}: truncated file (header needs byte {self.pos + n:,}, "
                            f"file has {len(self.mv):,})")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        if n > 1 << 30:
            raise GGUFError(f"{self.path}: corrupt string length {n} at byte {self.pos}")
        return str(self.take(n), "utf-8", "replace")


# GGUF value types -> struct format (8 = string, 9 = array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}


def _strings(cur: _Cursor, count: int) -> list[str]:
    out = []
    mv, pos, size = cur.mv, cur.pos, len(cur.mv)
    for _ in range(count):  # hot loop: 150k+ vocabulary strings
        if pos + 8 > size:
            raise GGUFError(f"{cur.path}: truncated string array")
        (n,) = struct.unpack_from("<Q", mv, pos)
        pos += 8
        if pos + n > size:
            raise GGUFError(f"{cur.path}: truncated string array")
        out.append(str(mv[pos:pos + n], "utf-8", "replace"))
        pos += n
    cur.pos = pos
    return out


MAX_ARRAY_NESTING = 8  # GGUF files use flat arrays; deeper nesting means corruption


def _value(cur: _Cursor, vtype: int, depth: int = 0) -> Any:
    if vtype in _SCALAR:
        return cur.scalar(_SCALAR[vtype])
    if vtype == 8:
        return cur.string()
    if vtype == 9:
        etype, count = cur.scalar("I"), cur.scalar("Q")
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype])
            return np.frombuffer(cur.take(count * dt.itemsize), dtype=dt).tolist()
        if etype == 8:
            return _strings(cur, count)
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFError(f"{cur.path}: metadata arrays nested over {MAX_ARRAY_NESTING} deep"
                            f" at byte {cur.pos}")
        return [_value(cur, etype, depth + 1) for _ in range(count)]
    raise GGUFError(f"{cur.path}: unknown metadata value type {vtype} at byte {cur.pos}")


class GGUFFile:
    """A GGUF file opened read-only (memory-mapped).

    The header is parsed here rather than by gguf's own reader, which builds a numpy view
    per vocabulary string (slow for large vocabularies). The gguf package supplies the
    type tables.
    """

    def __init__(self, path: str | os.PathLike[str]):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: not a readable GGUF file (only {size} bytes)")
        buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(buf, self.path)
        if bytes(cur.take(4)) != b"GGUF":
            raise GGUFError(f"{self.path}: not a readable GGUF file (bad magic bytes)")
        version = cur.scalar("I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise GGUFError(f"{self.path}: not a readable GGUF file (corrupt header counts)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = _value(cur, cur.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            dims = [cur.scalar("Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
        align = self.metadata.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
            raise GGUFError(f"{self.path}: general.alignment must be a positive integer, "
                            f"got {align!r}")
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(ggml_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown GGUF type id "
                                f"{ggml_type}") from None
            n_bytes = math.prod(int(d) for d in dims) // block * type_size  # no wrap-around
            start = data_start + offset
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice")
            if start + n_bytes > size:
                raise GGUFError(
                    f"{self.path}: truncated file: tensor {name!r} needs bytes up to "
                    f"{start + n_bytes:,} but the file has {size:,}")
            self.tensors[name] = TensorInfo(
                name=name, ggml_type=ggml_type, type_name=qtype.name,
                shape=tuple(int(d) for d in reversed(dims)), data=buf[start:start + n_bytes])
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

    def bytes_read_per_token(self) -> int:
        """Tensor bytes a decode step reads as the file lays them out: all but the
        token-embedding table, which is only looked up by rows unless it doubles as the
        (tied) output matrix."""
        tied = not self.has_tensor("output.weight")
        return sum(int(t.data.nbytes) for name, t in self.tensors.items()
                   if tied or name != "token_embd.weight")


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
    tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
    try:  # only a memo: a full or read-only disk costs hashing the file again next time
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(index))
        os.replace(tmp, index_path)
    except OSError:
        tmp.unlink(missing_ok=True)
    return digest
