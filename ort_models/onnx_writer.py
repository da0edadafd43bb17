"""A small ONNX graph writer: nodes by call, initializers streamed to one external file.

Weights never sit in the ModelProto (a 1.5B model would pass protobuf's 2 GB limit);
each initializer is appended to `weights.bin` (4 KiB aligned, so ORT can mmap it) and
referenced as external data.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_ALIGN = 4096
MS = "com.microsoft"


class GraphWriter:
    def __init__(self, weights_file: BinaryIO, weights_name: str):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._weights = weights_file
        self._weights_name = weights_name
        self._offset = 0
        self._n = 0
        self._consts: dict[tuple[Any, ...], str] = {}
        self._weight_names: set[str] = set()

    # -- values ---------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def input(self, name: str, elem_type: int, shape: list[Any]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list[Any]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def weight(self, name: str, array: np.ndarray) -> str:
        """An initializer written to the external weights file."""
        array = np.ascontiguousarray(array)
        pad = (-self._offset) % _ALIGN
        if pad:
            self._weights.write(b"\0" * pad)
            self._offset += pad
        data = array.tobytes()
        self._weights.write(data)
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        t.dims.extend(array.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (
            ("location", self._weights_name),
            ("offset", str(self._offset)),
            ("length", str(len(data))),
        ):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self._offset += len(data)
        self.initializers.append(t)
        self._weight_names.add(name)
        return name

    def has(self, name: str) -> bool:
        return name in self._weight_names

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        """A small inline constant (deduplicated)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("const")
            self.initializers.append(numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    # -- nodes ----------------------------------------------------------------------------
    def op(self, op_type: str, inputs: list[str], n_out: int = 1, *, domain: str = "",
           out: list[str] | None = None, **attrs: Any) -> Any:
        outs = out or [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    @contextmanager
    def body(self, name: str, inputs: list[onnx.ValueInfoProto],
             outputs: list[onnx.ValueInfoProto]) -> Iterator[list[onnx.GraphProto]]:
        """Nodes written inside the block form a subgraph (a Loop's body), yielded as a
        one-item list once the block ends. Constants and weights stay in the main graph,
        which the body reads from its outer scope."""
        outer, self.nodes = self.nodes, []
        made: list[onnx.GraphProto] = []
        try:
            yield made
        finally:
            nodes, self.nodes = self.nodes, outer
        made.append(helper.make_graph(nodes, name, inputs, outputs))

    def save(self, path: Path, *, opset: int = 24) -> None:
        graph = helper.make_graph(self.nodes, "specd", self.inputs, self.outputs,
                                  self.initializers)
        domains = sorted(_domains(self.nodes) - {"", MS})
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
            + [helper.make_opsetid(d, 1) for d in domains],
            producer_name="specd",
        )
        model.ir_version = 10
        with open(path, "wb") as f:
            f.write(model.SerializeToString())


def _domains(nodes: list[onnx.NodeProto]) -> set[str]:
    """The op domains of nodes and of the subgraphs in their attributes."""
    out = set()
    for n in nodes:
        out.add(n.domain)
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                out |= _domains(list(sub.node))
    return out
