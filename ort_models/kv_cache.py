"""A model's KV cache: static K and V buffers per sequence slot and layer, on the device.

Each buffer is [1, n_kv_head, kv_len, head_dim] (kv_len: the context plus room for filler
rows; a sliding-window layer's may be shorter, a ring its attention indexes by position
modulo kv_len). A graph gets them bound as both `past_*` and `present_*`, so it writes new
rows in place. The cache is an object of its own so that several sessions can bind the same
buffers: a drafter's injection graph writes rows that its block graph then attends to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class KVCache:
    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, kv_len: int,
                 dtype: type[np.floating] | np.dtype, device: str = "cpu", device_id: int = 0,
                 layer_lens: Sequence[int] | None = None):
        """layer_lens: each layer's kv_len where they differ (rings of sliding windows)."""
        self.n_layer = n_layer
        self.shape = (1, n_kv_head, kv_len, head_dim)
        lens = list(layer_lens) if layer_lens is not None else [kv_len] * n_layer
        self.layer_shapes = [(1, n_kv_head, n, head_dim) for n in lens]
        self.dtype = np.dtype(dtype)
        self.device, self.device_id = device, device_id
        self._slots: list[list[tuple[Any, Any]]] = []  # per sequence: (K, V) OrtValues per layer

    @property
    def n_seq(self) -> int:
        return len(self._slots)

    def add_sequence(self) -> int:
        """Allocate the buffers of one more sequence slot (zeros: masked keys must multiply
        to 0, so the contents must be finite); returns its index."""
        import onnxruntime as ort

        layers = []
        for shape in self.layer_shapes:
            pair = []
            for _ in range(2):
                buf = ort.OrtValue.ortvalue_from_shape_and_type(
                    shape, self.dtype, self.device, self.device_id)
                if self.device == "cpu":
                    buf.numpy()[...] = 0
                else:
                    buf.update_inplace(np.zeros(shape, self.dtype))
                pair.append(buf)
            layers.append((pair[0], pair[1]))
        self._slots.append(layers)
        return len(self._slots) - 1

    def bind(self, binding: Any, seq: int) -> None:
        """Bind sequence `seq`'s buffers to an onnxruntime.IOBinding as past and present."""
        for i, (k, v) in enumerate(self._slots[seq]):
            binding.bind_ortvalue_input(f"past_key_{i}", k)
            binding.bind_ortvalue_output(f"present_key_{i}", k)
            binding.bind_ortvalue_input(f"past_value_{i}", v)
            binding.bind_ortvalue_output(f"present_value_{i}", v)

    @property
    def bytes_per_sequence(self) -> int:
        """K and V bytes of one sequence slot, all layers."""
        return sum(2 * int(np.prod(shape)) * self.dtype.itemsize for shape in self.layer_shapes)

    def layers(self, seq: int) -> list[tuple[Any, Any]]:
        """Sequence `seq`'s (K, V) OrtValues, one pair per layer."""
        return self._slots[seq]
