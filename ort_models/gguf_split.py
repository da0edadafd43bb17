"""Split GGUF models: the files llama.cpp's llama-gguf-split writes, read as llama.cpp does.

A model split in N parts is N files named `<prefix>-00001-of-0000N.gguf` ... (llama.cpp's
`llama_split_path`). The first holds all the metadata; every part holds `split.no` (its
index from 0), `split.count` (N), `split.tensors.count` (the model's tensors in all
parts) and its share of the tensors. As in llama.cpp's model loader, a model is opened by
its first part, the others found by that naming rule; a part given in its place is
refused with the first part's name.

Each part must be there, be the part its name says, agree with the first on the part
and tensor counts, and hold no tensor another part holds; all together must hold
`split.tensors.count` tensors. A part of another model fails one of these (or, with the
same names and counts, the model's shape checks: `tensor_checks.py`), with a message
naming the file at fault.
"""

from __future__ import annotations

import re
from pathlib import Path

from .gguf_file import GGUFError, GGUFPart, read_part

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_PART_NAME = re.compile(r"-(\d{5,})-of-(\d{5,})\.gguf$")


def split_path(prefix: str, index: int, count: int) -> Path:
    """The file of part `index` (from 0) of a `count`-part model (llama_split_path)."""
    return Path(f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf")


def split_prefix(path: Path, index: int, count: int) -> str | None:
    """The prefix of `path`, named as part `index` of `count` (llama_split_prefix); None
    where its name does not end as that part's does."""
    tail = f"-{index + 1:05d}-of-{count:05d}.gguf"
    text = str(path)
    return text[:-len(tail)] if text.endswith(tail) and len(text) > len(tail) else None


def named_as_part(path: Path) -> bool:
    """Whether `path` is named as a part of a model of two or more parts."""
    m = _PART_NAME.search(path.name)
    return m is not None and int(m.group(2)) > 1


def other_parts(first: GGUFPart) -> list[GGUFPart]:
    """The parts after `first`, a file whose `split.count` is 2 or more, read and checked
    against it (module doc); GGUFError naming the file at fault."""
    meta = first.metadata
    count = int(meta[SPLIT_COUNT])
    for key in (SPLIT_NO, SPLIT_TENSORS):
        if key not in meta:
            raise GGUFError(f"{first.path}: {SPLIT_COUNT} is {count} but the file has no "
                            f"{key} key: not a part written by llama-gguf-split")
    no = int(meta[SPLIT_NO])
    if no != 0:
        prefix = split_prefix(first.path, no, count)
        name = split_path(prefix, 0, count) if prefix else f"*-00001-of-{count:05d}.gguf"
        raise GGUFError(f"{first.path}: this is part {no + 1} of a split model of {count} "
                        f"parts; pass its first part, {name}, which names the others")
    prefix = split_prefix(first.path, 0, count)
    if prefix is None:
        raise GGUFError(f"{first.path}: the first part of a split model of {count} parts "
                        f"must be named <name>-00001-of-{count:05d}.gguf: the other "
                        f"parts' names are made from it")
    n_tensors = int(meta[SPLIT_TENSORS])
    holder = dict.fromkeys(first.tensors, first.path)  # each tensor's file
    parts = []
    for index in range(1, count):
        path = split_path(prefix, index, count)
        if not path.is_file():
            raise GGUFError(f"{first.path}: part {index + 1} of this split model of {count} "
                            f"parts is missing: no file {path}")
        part = read_part(path, index)
        _check_part(part, index, count, n_tensors, first.path)
        for name in part.tensors:
            if name in holder:
                raise GGUFError(f"{path}: tensor {name!r} is also in {holder[name]}: the "
                                "parts are not of one split model")
            holder[name] = path
        parts.append(part)
    if len(holder) != n_tensors:
        raise GGUFError(f"{first.path}: {SPLIT_TENSORS} is {n_tensors:,}, but the {count} "
                        f"parts hold {len(holder):,} tensors")
    return parts


def _check_part(part: GGUFPart, index: int, count: int, n_tensors: int, first: Path) -> None:
    """`part`, read as part `index`, says it is that part of a model like `first`'s."""
    meta = part.metadata
    if SPLIT_NO not in meta:
        raise GGUFError(f"{part.path}: no {SPLIT_NO} key: not a part of a split model")
    if int(meta[SPLIT_NO]) != index:
        raise GGUFError(f"{part.path}: {SPLIT_NO} is {meta[SPLIT_NO]}, but its name makes "
                        f"it part {index + 1} ({SPLIT_NO} {index})")
    for key, want in ((SPLIT_COUNT, count), (SPLIT_TENSORS, n_tensors)):
        if meta.get(key) != want:
            raise GGUFError(f"{part.path}: {key} is {meta.get(key)}, but the first part "
                            f"({first.name}) says {want}: the parts are not of one split "
                            "model")
