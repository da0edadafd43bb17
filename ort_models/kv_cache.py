"""A model's KV cache: static K and V buffers per sequence slot and layer, on the device.

A sequence's buffer of a layer is [1, n_kv_head, kv_len, head_dim] (kv_len: the context
plus room for filler rows; a sliding-window layer's may be shorter, a ring its attention
indexes by position modulo kv_len). A graph gets them bound as both `past_*` and
`present_*`, so it writes new rows in place. The cache is an object of its own so that
several sessions can bind the same buffers: a drafter's injection graph writes rows that
its block graph then attends to.

On the CPU the slots of a layer are one array [n_seq, n_kv_head, kv_len, head_dim], each
sequence's buffer a view of its row: a graph whose attention takes segments (specd's
CachedAttention) gets the whole array bound and runs the rows of several sequences in one
call (`bind_all`). Adding a slot past the arrays' capacity moves them (`version` counts
the moves: bindings made before must be made again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class KVCache:
    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, kv_len: int,
                 dtype: type[np.floating] | np.dtype, device: str = "cpu", device_id: int = 0,
                 layer_lens: Sequence[int] | None = None, capacity: int = 1):
        """layer_lens: each layer's kv_len where they differ (rings of sliding windows);
        capacity: sequence slots the CPU arrays are made for at first."""
        self.n_layer = n_layer
        self.shape = (1, n_kv_head, kv_len, head_dim)
        lens = list(layer_lens) if layer_lens is not None else [kv_len] * n_layer
        self.layer_shapes = [(1, n_kv_head, n, head_dim) for n in lens]
        self.dtype = np.dtype(dtype)
        self.device, self.device_id = device, device_id
        self.version = 0  # bumped whenever the buffers move
        self._slots: list[list[tuple[Any, Any]]] = []  # per sequence: (K, V) OrtValues per layer
        # CPU: per layer (K, V) arrays [capacity, n_kv_head, kv_len, head_dim], their
        # OrtValues whole, and the slots in use
        self._arrays: list[tuple[np.ndarray, np.ndarray]] = []
        self._whole: list[tuple[Any, Any]] = []
        if self.packed:
            self._allocate(max(capacity, 1))

    @property
    def packed(self) -> bool:
        """Whether the slots of a layer are rows of one array (`bind_all` works)."""
        return self.device == "cpu"

    @property
    def n_seq(self) -> int:
        return len(self._slots)

    @property
    def capacity(self) -> int:
        return len(self._arrays[0][0]) if self._arrays else self.n_seq

    def add_sequence(self) -> int:
        """Allocate the buffers of one more sequence slot (zeros: masked keys must multiply
        to 0, so the contents must be finite); returns its index."""
        if not self.packed:
            self._slots.append([self._device_pair(shape) for shape in self.layer_shapes])
            return len(self._slots) - 1
        if self.n_seq == self.capacity:
            self._allocate(self.n_seq + 1)
        seq = self.n_seq
        for k, v in self._arrays:
            k[seq] = 0
            v[seq] = 0
        self._slots.append(self._views(seq))
        return seq

    def _device_pair(self, shape: tuple[int, ...]) -> tuple[Any, Any]:
        import onnxruntime as ort

        pair = []
        for _ in range(2):
            buf = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, self.dtype, self.device, self.device_id)
            buf.update_inplace(np.zeros(shape, self.dtype))
            pair.append(buf)
        return pair[0], pair[1]

    def _allocate(self, capacity: int) -> None:
        """(Re)make the CPU arrays for `capacity` slots, keeping the slots in use."""
        import onnxruntime as ort

        arrays = []
        for i, (_, h, n, d) in enumerate(self.layer_shapes):
            pair = []
            for j in range(2):
                a = np.zeros((capacity, h, n, d), self.dtype)
                if self._arrays:
                    a[: self.n_seq] = self._arrays[i][j][: self.n_seq]
                pair.append(a)
            arrays.append((pair[0], pair[1]))
        self._arrays = arrays
        self._whole = [(ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v))
                       for k, v in arrays]
        self._slots = [self._views(seq) for seq in range(self.n_seq)]
        self.version += 1

    def _views(self, seq: int) -> list[tuple[Any, Any]]:
        import onnxruntime as ort

        return [(ort.OrtValue.ortvalue_from_numpy(k[seq:seq + 1]),
                 ort.OrtValue.ortvalue_from_numpy(v[seq:seq + 1])) for k, v in self._arrays]

    def bind(self, binding: Any, seq: int) -> None:
        """Bind sequence `seq`'s buffers to an onnxruntime.IOBinding as past and present."""
        _bind_layers(binding, self._slots[seq])

    def bind_all(self, binding: Any) -> None:
        """Bind every slot's buffers ([n_seq+, Hkv, kv_len, hd] per layer) as past and
        present, for a graph whose attention is told each row's slot."""
        if not self.packed:
            raise ValueError(f"a KV cache on {self.device} keeps its slots apart")
        _bind_layers(binding, self._whole)

    def copy_prefix(self, src: int, dst: int, n: int, src_len: int) -> bool:
        """Copy the K/V rows of positions 0..n-1 from slot `src` (holding `src_len`
        positions) to slot `dst`; False, copying nothing, where it cannot: slots kept
        apart (another device), or a ring that may have wrapped past those positions."""
        if not self.packed or src == dst or n > src_len:
            return False
        if any(shape[2] < src_len for shape in self.layer_shapes):
            return False  # a sliding window's ring: row p % len may hold a later position
        for k, v in self._arrays:
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        return True

    @property
    def bytes_per_sequence(self) -> int:
        """K and V bytes of one sequence slot, all layers."""
        return sum(2 * int(np.prod(shape)) * self.dtype.itemsize for shape in self.layer_shapes)

    def layers(self, seq: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Sequence `seq`'s K and V [1, Hkv, kv_len, hd], one pair per layer: views of the
        cache on the CPU (they keep its arrays alive), copies from another device."""
        if self.packed:
            return [(k[seq:seq + 1], v[seq:seq + 1]) for k, v in self._arrays]
        return [(k.numpy(), v.numpy()) for k, v in self._slots[seq]]


def _bind_layers(binding: Any, layers: Sequence[tuple[Any, Any]]) -> None:
    for i, (k, v) in enumerate(layers):
        binding.bind_ortvalue_input(f"past_key_{i}", k)
        binding.bind_ortvalue_output(f"present_key_{i}", k)
        binding.bind_ortvalue_input(f"past_value_{i}", v)
        binding.bind_ortvalue_output(f"present_value_{i}", v)
