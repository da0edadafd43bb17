"""Reading GGUF files: metadata, tensors and a content hash, with clear errors.

Everything that opens a GGUF goes through `GGUFFile`, so a corrupt or truncated file
fails in one place with one message naming the file and the key or tensor at fault. A
model split in parts (llama-gguf-split's `*-00001-of-0000N.gguf`) is opened by its first
part and read whole: `gguf_split.py`.

Each file's header is checked (`read_part`) before anything is allocated by what it
says: every count and length against the bytes left in the file; the alignment a power
of two; each tensor of at most four dimensions, none zero, of a known type whose blocks
divide its rows, its data at an aligned offset, inside the file, overlapping no other
tensor's. The metadata specd reads besides the hyper-parameters (the alignment, the split
and tokenizer keys) must have the types llama.cpp reads, and a BPE vocabulary's merges
must join tokens of the vocabulary into tokens of it. A model's tensors against its
hyper-parameters, and that each tensor's data starts where the one before ends (as
llama.cpp's loader requires), are checked in `tensor_checks.py`: after the shapes, since
a shape that disagrees with the metadata is the clearer message.
"""

from __future__ import annotations

import functools
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
    offset: int = 0  # where its data starts, from the start of the file's data section
    part: int = 0  # the file holding it: its index in GGUFFile.parts (0 unless split)


class _Cursor:
    """Little-endian reads over the memory-mapped file with bounds checks; `what` names
    the part being read (a metadata key, a tensor) for the error messages."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.mv, self.pos, self.path = buf.data, 0, path
        self.what = "the header"

    def left(self) -> int:
        return len(self.mv) - self.pos

    def error(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {self.what}: {problem}")

    def take(self, n: int) -> memoryview:
        if n > self.left():
            raise GGUFError(f"{self.path}: truncated file ({self.what} needs byte "
                            f"{self.pos + n:,}, the file has {len(self.mv):,})")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return str(self.take(self.scalar("Q")), "utf-8", "replace")


# GGUF value types -> struct format (8 = string, 9 = array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_NUMBER_TYPES = _INTEGER_TYPES | {6, 12}
_STRING, _ARRAY = 8, 9
# the fewest bytes an item can take: a string is its 8-byte length, an array its 4-byte
# type and 8-byte count; a metadata entry an 8-byte key length, a 4-byte type and a
# one-byte value; a tensor info an 8-byte name length, the 4-byte dimension count and
# type, and the 8-byte offset
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name has fewer bytes
MAX_ARRAY_NESTING = 8  # GGUF files use flat arrays; deeper nesting means corruption
DEFAULT_ALIGNMENT = 32


def _strings(cur: _Cursor, count: int) -> list[str]:
    out = []
    mv, pos, size = cur.mv, cur.pos, len(cur.mv)
    for _ in range(count):  # hot loop: 150k+ vocabulary strings
        if pos + 8 > size:
            raise GGUFError(f"{cur.path}: truncated file ({cur.what}: string array)")
        (n,) = struct.unpack_from("<Q", mv, pos)
        pos += 8
        if pos + n > size:
            raise GGUFError(f"{cur.path}: truncated file ({cur.what}: string array)")
        out.append(str(mv[pos:pos + n], "utf-8", "replace"))
        pos += n
    cur.pos = pos
    return out


def _value(cur: _Cursor, vtype: int, depth: int = 0) -> Any:
    if vtype in _SCALAR:
        return cur.scalar(_SCALAR[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        etype, count = cur.scalar("I"), cur.scalar("Q")
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype])
            return np.frombuffer(cur.take(count * dt.itemsize), dtype=dt).tolist()
        if etype not in _MIN_ITEM_BYTES:
            raise cur.error(f"array of unknown value type {etype} at byte {cur.pos:,}")
        if count * _MIN_ITEM_BYTES[etype] > cur.left():  # before looping over the count
            raise GGUFError(f"{cur.path}: truncated file ({cur.what}: an array of {count:,} "
                            f"items cannot fit in the {cur.left():,} bytes left)")
        if etype == _STRING:
            return _strings(cur, count)
        if depth >= MAX_ARRAY_NESTING:
            raise cur.error(f"arrays nested over {MAX_ARRAY_NESTING} deep at byte {cur.pos:,}")
        return [_value(cur, etype, depth + 1) for _ in range(count)]
    raise cur.error(f"unknown metadata value type {vtype} at byte {cur.pos:,}")


def _shown(text: str, limit: int = 60) -> str:
    """`text` quoted for a message, cut short: a corrupt length can make a name of
    megabytes."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class GGUFPart:
    """One file's header, checked (module doc): a whole model, or one part of a split
    model (`gguf_split.py`), whose parts after the first hold only their split keys."""

    path: Path
    size: int  # the file's bytes
    metadata: dict[str, Any]
    # each key's GGUF value type, and an array's item type (None for other values)
    value_types: dict[str, tuple[int, int | None]]
    tensors: dict[str, TensorInfo]
    header_size: int  # the header's own bytes
    alignment: int
    data_start: int  # where the data section starts


def read_part(path: Path, index: int = 0) -> GGUFPart:
    """The checked header of the GGUF file at `path` (part `index` of its model), its
    tensors memory-mapped. The header is parsed here rather than by gguf's own reader,
    which builds a numpy view per vocabulary string (slow for large vocabularies); the
    gguf package supplies the type tables."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: not a readable GGUF file (only {size} bytes)")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf, path)
    if bytes(cur.take(4)) != b"GGUF":
        raise GGUFError(f"{path}: not a readable GGUF file (bad magic bytes)")
    version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > cur.left():
        raise GGUFError(f"{path}: not a readable GGUF file (corrupt header counts: "
                        f"{n_tensors:,} tensors and {n_kv:,} metadata keys cannot fit "
                        f"in {size:,} bytes)")
    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[int, int | None]] = {}
    for i in range(n_kv):
        cur.what = f"metadata entry #{i}"
        key = cur.string()
        cur.what = f"metadata key {_shown(key)}"
        if key in metadata:
            raise cur.error("appears twice")
        vtype = cur.scalar("I")
        etype = (struct.unpack_from("<I", cur.mv, cur.pos)[0]
                 if vtype == _ARRAY and cur.left() >= 4 else None)
        metadata[key] = _value(cur, vtype)
        value_types[key] = (vtype, etype)
    infos = []
    for i in range(n_tensors):
        cur.what = f"tensor info #{i}"
        n_name = struct.unpack_from("<Q", cur.mv, cur.pos)[0] if cur.left() >= 8 else 0
        name = cur.string()
        cur.what = f"tensor {_shown(name)}"
        if n_name >= MAX_NAME:
            raise cur.error(f"name of {n_name:,} bytes (GGUF allows {MAX_NAME - 1})")
        n_dims = cur.scalar("I")
        if n_dims > MAX_DIMS:
            raise cur.error(f"has {n_dims} dimensions (GGUF allows {MAX_DIMS})")
        dims = [cur.scalar("Q") for _ in range(n_dims)]
        if any(not 0 < d < 1 << 63 for d in dims):
            raise cur.error(f"has dimensions {dims}; each must be at least 1 (and below "
                            f"2**63)")
        infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    cur.what = "the header"
    _check_key_types(path, value_types)
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if align < 1 or align & (align - 1):
        raise GGUFError(f"{path}: general.alignment must be a power of two, got {align}")
    data_start = _pad(cur.pos, align)
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name!r} has unknown GGUF type id "
                            f"{ggml_type}") from None
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        row = dims[0] if dims else 1
        if row % block:
            raise GGUFError(f"{path}: tensor {name!r} has rows of {row:,} values, "
                            f"not whole {qtype.name} blocks of {block}")
        if offset % align:
            raise GGUFError(f"{path}: tensor {name!r} has data offset {offset:,}, "
                            f"not a multiple of the alignment {align}")
        n_bytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFError(
                f"{path}: truncated file: tensor {name!r} needs bytes up to "
                f"{start + n_bytes:,} but the file has {size:,}")
        tensors[name] = TensorInfo(
            name=name, ggml_type=ggml_type, type_name=qtype.name,
            shape=tuple(int(d) for d in reversed(dims)), data=buf[start:start + n_bytes],
            offset=offset, part=index)
    by_start = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(by_start, by_start[1:], strict=False):
        if b.offset < a.offset + a.data.size:
            raise GGUFError(f"{path}: tensor {b.name!r} (data at offset "
                            f"{b.offset:,}) overlaps the data of tensor {a.name!r} "
                            f"(offset {a.offset:,}, {a.data.size:,} bytes)")
    return GGUFPart(path, size, metadata, value_types, tensors, cur.pos, align, data_start)


def _check_key_types(path: Path, value_types: dict[str, tuple[int, int | None]]) -> None:
    """The keys read outside the hyper-parameters have the types llama.cpp reads."""
    for key, (vtype, etype) in value_types.items():
        want = _expected_type(key)
        if want is None:
            continue
        kind, scalar_types, item_types = want
        ok = (vtype in scalar_types if item_types is None
              else vtype == _ARRAY and etype in item_types)
        if not ok:
            got = (f"an array of {_TYPE_NAMES.get(etype or 0, etype)}" if vtype == _ARRAY
                   else _TYPE_NAMES.get(vtype, str(vtype)))
            raise GGUFError(f"{path}: metadata key {key!r} must be {kind}, got {got}")


class GGUFFile:
    """A GGUF model opened read-only (memory-mapped), its header checked (module doc).

    A split model (`name-00001-of-0000N.gguf`, llama.cpp's llama-gguf-split) is opened
    by its first part, as llama.cpp opens it: the metadata are the first part's, the
    tensors all parts' (`gguf_split.py` finds and checks the others). `path` is the file
    opened, `parts` every file of the model.
    """

    def __init__(self, path: str | os.PathLike[str]):
        from .gguf_split import SPLIT_COUNT, other_parts

        self.path = Path(path)
        first = read_part(self.path)
        self.parts = [first]
        if first.metadata.get(SPLIT_COUNT, 0) > 1:
            self.parts += other_parts(first)
        self.metadata: dict[str, Any] = first.metadata
        self.value_types = first.value_types
        if "general.architecture" not in self.metadata:
            raise GGUFError(f"{self.path}: GGUF file has no general.architecture key")
        # the (first) file's header size, alignment and where its data section starts
        self.header_size, self.alignment = first.header_size, first.alignment
        self.data_start = first.data_start
        self.tensors: dict[str, TensorInfo] = {}
        for part in self.parts:  # gguf_split checked that no name is in two parts
            self.tensors.update(part.tensors)
        layers = self.metadata.get(f"{self.arch}.block_count")
        if isinstance(layers, int) and layers > len(self.tensors):  # each layer has tensors
            raise GGUFError(f"{self.path}: {self.arch}.block_count is {layers:,}, but the "
                            f"file holds only {len(self.tensors)} tensors")
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        """The vocabulary's parallel arrays have its length; a BPE vocabulary's merges
        join two of its tokens into a third (what the tokenizer is built from)."""
        meta = self.metadata
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            return
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if key in meta and len(meta[key]) != len(tokens):
                raise GGUFError(f"{self.path}: {key} has {len(meta[key]):,} entries for "
                                f"{len(tokens):,} tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not merges or meta.get("tokenizer.ggml.model") != "gpt2":
            return
        st = self.path.stat()
        seen = (str(self.path.resolve()), st.st_size, st.st_mtime_ns)
        if seen in _GOOD_MERGES:  # a process opens its models' files several times
            return
        bad = bad_merge(tokens, merges)
        if bad is not None:
            raise GGUFError(f"{self.path}: tokenizer.ggml.merges: {bad}")
        _GOOD_MERGES.add(seen)

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

    @property
    def file_bytes(self) -> int:
        """The bytes of the model's files (all parts of a split model)."""
        return sum(part.size for part in self.parts)

    def part_path(self, t: TensorInfo) -> Path:
        """The file holding tensor `t` (for messages naming it)."""
        return self.parts[t.part].path

    def content_hash(self) -> str:
        """The model's sha256: its file's, or for a split model one over its parts'."""
        if len(self.parts) == 1:
            return _remembered_sha256(self.path)
        digests = " ".join(_remembered_sha256(part.path) for part in self.parts)
        return hashlib.sha256(f"split {digests}".encode()).hexdigest()

    def bytes_read_per_token(self) -> int:
        """Tensor bytes a decode step reads as the file lays them out: all but the
        token-embedding table, which is only looked up by rows unless it doubles as the
        (tied) output matrix."""
        tied = not self.has_tensor("output.weight")
        return sum(int(t.data.nbytes) for name, t in self.tensors.items()
                   if tied or name != "token_embd.weight")


# (path, size, mtime) of files whose merges this process found good (~0.1 s for 150k)
_GOOD_MERGES: set[tuple[str, int, int]] = set()

_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
               6: "float32", 7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64",
               12: "float64"}
_KeyType = tuple[str, frozenset[int], frozenset[int] | None]
_A_STRING: _KeyType = ("a string", frozenset({_STRING}), None)
_AN_INTEGER: _KeyType = ("an integer", _INTEGER_TYPES, None)
_A_FLAG: _KeyType = ("a bool", _INTEGER_TYPES | {7}, None)
_KEY_TYPES: dict[str, _KeyType] = {
    "general.architecture": _A_STRING,
    "general.alignment": _AN_INTEGER,
    "split.no": _AN_INTEGER,
    "split.count": _AN_INTEGER,
    "split.tensors.count": _AN_INTEGER,
    "tokenizer.ggml.model": _A_STRING,
    "tokenizer.ggml.pre": _A_STRING,
    "tokenizer.chat_template": _A_STRING,
    "tokenizer.ggml.tokens": ("an array of strings", frozenset(), frozenset({_STRING})),
    "tokenizer.ggml.merges": ("an array of strings", frozenset(), frozenset({_STRING})),
    "tokenizer.ggml.token_type": ("an array of integers", frozenset(), _INTEGER_TYPES),
    "tokenizer.ggml.scores": ("an array of numbers", frozenset(), _NUMBER_TYPES),
}


def _expected_type(key: str) -> _KeyType | None:
    if key in _KEY_TYPES:
        return _KEY_TYPES[key]
    if key.startswith("tokenizer.ggml."):
        if key.endswith("_token_id"):
            return _AN_INTEGER
        if key.startswith(("tokenizer.ggml.add_", "tokenizer.ggml.remove_")):
            return _A_FLAG
    return None


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table (the inverse of its bytes_to_unicode)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _respelled(piece: str) -> str | None:
    """`piece` read as GPT-2 byte characters, decoded as UTF-8 (None where it is not)."""
    table = _byte_decoder()
    try:
        return bytes(table[c] for c in piece).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return None


def bad_merge(tokens: list[str], merges: list[str]) -> str | None:
    """What is wrong with the first bad BPE merge (None: they are all good). A merge is
    "left right": two tokens, one space between, whose joined text is a token too. Tokens
    stored as text rather than in GPT-2's byte characters count under either spelling."""
    if not merges:
        return None
    known = set(tokens)
    spaces = list(map(str.count, merges, [" "] * len(merges)))
    parts = set(" ".join(merges).split(" ")) | set(map(str.replace, merges, [" "] * len(merges),
                                                        [""] * len(merges)))
    unknown = {p for p in parts - known if _respelled(p) not in known}
    if spaces.count(1) == len(merges) and "" not in parts and not unknown:
        return None
    for i, m in enumerate(merges):
        left, _, right = m.partition(" ")
        if spaces[i] != 1 or not left or not right:
            return f"merge #{i} {m!r} is not two tokens with one space between them"
        for piece in (left, right, left + right):
            if piece in unknown:
                return f"merge #{i} {m!r}: {piece!r} is not a token of the vocabulary"
    return "a merge is malformed"  # not reached: every failed test above names a merge


def content_hash(path: str | os.PathLike[str]) -> str:
    """The sha256 of the model at `path` (GGUFFile.content_hash): a file named as a part
    of a split model is opened to find its other parts; any other file is hashed alone,
    without parsing it."""
    from .gguf_split import named_as_part

    if named_as_part(Path(path)):
        return GGUFFile(path).content_hash()
    return _remembered_sha256(path)


def _remembered_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, remembered per (path, size, mtime) so big files hash once."""
    p = Path(path).resolve()
    key = _hash_key(p)
    index = _read_hash_index()
    if key in index:
        return index[key]
    digest = file_sha256(p)
    _remember(key, digest)
    return digest


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in 16 MiB chunks (no index: see _remembered_sha256)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def remember_hash(path: str | os.PathLike[str], digest: str) -> None:
    """Record `digest` as the sha256 of `path` as it is now (a caller that hashed the file
    while writing it, as a model pull does, saves the first load a pass over it)."""
    _remember(_hash_key(Path(path).resolve()), digest)


def _hash_key(p: Path) -> str:
    st = p.stat()
    return f"{p}|{st.st_size}|{st.st_mtime_ns}"


def _hash_index_path() -> Path:
    from .paths import cache_dir

    return cache_dir() / "hashes.json"


def _read_hash_index() -> dict[str, str]:
    try:
        index = json.loads(_hash_index_path().read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _remember(key: str, digest: str) -> None:
    index_path = _hash_index_path()
    index = _read_hash_index()
    index[key] = digest
    tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
    try:  # only a memo: a full or read-only disk costs hashing the file again next time
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(index))
        os.replace(tmp, index_path)
    except OSError:
        tmp.unlink(missing_ok=True)
