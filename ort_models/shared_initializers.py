"""Weights a drafter head's graphs share with the target's: loaded once, given to both
sessions, so the head holds no copy of its own.

A head's block and step graphs read the target's token embedding table (the anchor, mask
and drafted tokens' rows); the head builder writes it as `token_embd.weight.exact.*`,
the same arrays the target graph holds as `token_embd.weight.*`. Where the bytes are
equal (checked, not assumed), ONNX Runtime gets one array per name through
`SessionOptions.add_initializer`, and loads neither copy from its graph's file. The
target's graph taking embeddings (an image's rows) shares every weight with the target's
graph the same way, by name (`same_named`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HEAD_COPY_MARK = ".exact."  # a head initializer `X.exact.Y` is the target's `X.Y`


@dataclass(frozen=True)
class ExternalTensor:
    """Where an initializer's bytes lie in its graph's weights file."""

    path: Path
    offset: int
    length: int
    dims: tuple[int, ...]
    dtype: np.dtype

    def map(self) -> np.ndarray:
        """The tensor mapped from its file, read-only: pages are read as rows are used,
        and one mapping serves every session given it."""
        return np.memmap(self.path, self.dtype, "r", self.offset, self.dims)

    def bytes_equal(self, other: ExternalTensor) -> bool:
        if self.length != other.length or self.dims != other.dims or self.dtype != other.dtype:
            return False
        a = np.memmap(self.path, np.uint8, "r", self.offset, self.length)
        b = np.memmap(other.path, np.uint8, "r", other.offset, other.length)
        return bool(np.array_equal(a, b))


def external_tensors(model_path: Path) -> dict[str, ExternalTensor]:
    """The initializers of an ONNX graph whose data lies in an external file."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(model_path), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        if "location" in info:
            out[t.name] = ExternalTensor(model_path.parent / info["location"],
                                         int(info.get("offset", 0)), int(info["length"]),
                                         tuple(t.dims), np.dtype(tensor_dtype_to_np_dtype(
                                             t.data_type)))
    return out


def shares_on(device: str) -> bool:
    """Whether a head's sessions on `device` take the target's arrays: the CPU EP reads a
    mapped array in place; another device's session would copy it there anyway."""
    return device == "cpu"


@dataclass(frozen=True)
class TargetCopy:
    """A head graph's initializer that is byte-for-byte one of the target graph's."""

    graph: str  # the head graph holding it
    name: str  # its name there
    target_name: str
    tensor: ExternalTensor  # the target's


@dataclass
class SharedWeights:
    """The target's arrays by the target graph's names, and each head graph's names for
    them (graph → {head name: target name})."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    head_names: dict[str, dict[str, str]] = field(default_factory=dict)

    def for_graph(self, graph: str) -> dict[str, np.ndarray]:
        """A head graph's initializers to override, by its own names."""
        return {name: self.arrays[target] for name, target in
                self.head_names.get(graph, {}).items()}


def target_copies(head_graphs: Iterable[tuple[str, Path]], target_model: Path
                  ) -> list[TargetCopy]:
    """The head graphs' initializers that are byte-for-byte the target graph's."""
    target = external_tensors(target_model)
    out = []
    for graph, path in head_graphs:
        for name, tensor in external_tensors(path).items():
            base = name.replace(HEAD_COPY_MARK, ".", 1)
            if base != name and base in target and tensor.bytes_equal(target[base]):
                out.append(TargetCopy(graph, name, base, target[base]))
    return out


def share_with_target(head_graphs: Iterable[tuple[str, Path]], target_model: Path
                      ) -> SharedWeights:
    """The copies found, each of the target's arrays mapped once from its graph's file."""
    shared = SharedWeights()
    for c in target_copies(head_graphs, target_model):
        if c.target_name not in shared.arrays:
            shared.arrays[c.target_name] = c.tensor.map()
        shared.head_names.setdefault(c.graph, {})[c.name] = c.target_name
    return shared


def add_initializers(options: object, arrays: Mapping[str, np.ndarray],
                     keep: list[object]) -> None:
    """Give a session's options these arrays in place of its graph's initializers (their
    OrtValues wrap the arrays; `keep` holds them as long as the session lives)."""
    import onnxruntime as ort

    for name, array in arrays.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.append(value)
        options.add_initializer(name, value)  # type: ignore[attr-defined]


def same_named(graph_model: Path, target_model: Path) -> dict[str, np.ndarray]:
    """The initializers of `graph_model` that are byte-for-byte the target graph's of the
    same name (a second graph built from the same file: the one taking embeddings), each
    mapped from the target's weights file, for the second session to take in place."""
    target = external_tensors(target_model)
    return {name: target[name].map() for name, tensor in external_tensors(graph_model).items()
            if name in target and tensor.bytes_equal(target[name])}
