"""One model on ONNX Runtime: the session, its IOBindings and the KV buffers it owns.

Each sequence slot has one static K and one V buffer per layer, [1, n_kv, kv_len, hd]
(kv_len: the context, plus room for filler rows: a fixed-shape call's on CUDA, a single
step's second row where min_rows is 2), bound as
both past and present so the graph writes new rows in place. Rolling back is free: the
next call simply starts at a smaller position and overwrites the old rows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import native_ops
from .graph_builder import ATTN_BUCKET
from .model_cache import BuiltModel
from .providers import (
    RuntimeChoice,
    choose_runtime,
    ort_error_line,
    parse_device,
    session_providers,
)
from .row_invariance import min_call_rows

log = logging.getLogger("specd.runner")


# Rows per call on CUDA (see ModelRunner.row_block): single steps and verify blocks of up
# to this many tokens all run as calls of exactly this many rows.
CUDA_ROW_BLOCK = 8


class ContextFull(Exception):
    """The tokens asked for do not fit in the sequence's context."""


class GraphLoadError(RuntimeError):
    """ONNX Runtime could not load a built graph (its folder is damaged)."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def attn_len_for(end: int, n_ctx: int) -> int:
    """Keys a call ending at position `end` (exclusive) attends over: a bucket boundary."""
    return min(n_ctx, round_up(max(end, 1), ATTN_BUCKET))


def bucket_block_limit(pos: int, n_ctx: int) -> int:
    """Most tokens a call starting at `pos` may hold so its rows share one attention bucket.

    Rows of one call share `attn_len`; a row alone at position q would use
    attn_len_for(q + 1). They agree while the block stays inside one bucket.
    """
    return min(round_up(pos + 1, ATTN_BUCKET), n_ctx) - pos


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))


class ModelRunner:
    def __init__(self, built: BuiltModel, *, n_ctx: int, n_seq: int = 1,
                 threads: int | None = None, runtime: RuntimeChoice | None = None,
                 spinning: bool | str = False, row_block: int | None = None,
                 min_rows: int | None = None):
        """row_block: every call of up to this many tokens runs as exactly this many rows
        (filler rows after the real ones, computed and dropped). Default 1 on the CPU,
        where kernels compute a row the same way whatever the number of rows (but see
        min_rows), and CUDA_ROW_BLOCK on CUDA, where ORT's kernels (cuBLAS, MatMulNBits)
        choose their algorithm by the shape: measured on an H200 (bench/cuda_check.py),
        a block's rows differed from single steps by up to 0.06 in the logits of the tiny
        test models with calls of their natural shape, and equalled them bit for bit with
        one fixed shape. A verified row is then computed exactly as the single step at its
        position, so greedy speculation gives the target's own output on CUDA too.

        min_rows: calls of fewer tokens run this many rows (filler rows again), larger
        ones their own. Default on the CPU: 2 where ORT computes a one-row MatMulNBits
        product differently from the same row in a larger call (MLAS's 4-bit kernels on
        CPUs without VNNI, measured by row_invariance at load), else 1."""
        import onnxruntime as ort

        self.built = built
        self.hp = built.hparams
        # whole buckets, but never past the rotary table (a trained context that is not a
        # multiple of ATTN_BUCKET ends the last bucket early)
        self.n_ctx = min(round_up(n_ctx, ATTN_BUCKET), self._max_positions())
        # specd's kernels are CPU kernels: their graphs run on the CPU EP
        self.runtime = runtime or choose_runtime("cpu" if built.options.uses_native else "auto")
        if built.options.uses_native and self.runtime.device != "cpu":
            raise ValueError(f"{built.folder.name} was built with specd's CPU kernels and "
                             f"cannot run on {self.runtime.device}: build it with ONNX "
                             "Runtime's ops for that device (kernels 'ort', attention not "
                             "'native')")
        self.threads = threads or default_threads()
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        # Spinning pool threads win a little on an idle machine and lose badly when the
        # cores are shared. Qwen 1.5B (+0.5B draft, n=2), 2 threads, this 2-core box:
        # idle 14.5 vs 13.2 tok/s (19.4 vs 17.4 speculative) with/without spinning; one
        # busy process beside it 7.5 vs 10.7 (10.5 vs 14.2). So off by default.
        # spinning=True spins only while a run lasts; "always" keeps spinning. specd's own
        # kernels (most of a step) run on their own workers, which spin 150 us after each
        # task and then sleep (native_ops, kernels/thread_pool.c), whatever this says.
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        if spinning is True:
            so.add_session_config_entry("session.force_spinning_stop", "1")
        if built.options.uses_native:
            native_ops.register(so)
        try:
            self.session = ort.InferenceSession(
                str(built.model_path), so, providers=session_providers(self.runtime.device))
        except Exception as exc:  # ORT's own exception types (Fail, NoSuchFile, ...)
            raise GraphLoadError(f"{built.folder}: ONNX Runtime cannot load this graph "
                                 f"({ort_error_line(exc)}); remove the folder and it is "
                                 "rebuilt") from exc
        self._device, self._dev_id = parse_device(self.runtime.device)
        self.row_block = row_block or (CUDA_ROW_BLOCK if self._device == "cuda" else 1)
        if min_rows is None:
            min_rows = (min_call_rows(built.model_path, self.threads)
                        if self._device == "cpu" and self.row_block == 1 else 1)
        self.min_rows = min_rows
        # KV rows: the context, plus room for the filler rows of a call near its end
        # (never past the rotary table: filler positions must exist)
        self._kv_len = min(self.n_ctx + self._filler_rows - 1, self._max_positions())
        self.hidden_names = [o.name for o in self.session.get_outputs()
                             if o.name.startswith("hidden_")]
        self._kv_dtype = np.float16 if built.options.kv_dtype == "f16" else np.float32
        self._kv: list[list[tuple[object, object]]] = []
        self._bindings: list[object] = []
        for _ in range(n_seq):
            self.add_sequence()

    def _max_positions(self) -> int:
        return self.built.options.max_positions or self.hp.n_ctx_train

    @property
    def n_seq(self) -> int:
        return len(self._kv)

    @property
    def kv_bytes(self) -> int:
        return self.n_seq * self._kv_len * self.hp.kv_bytes_per_token(self.built.options.kv_bytes)

    @property
    def _filler_rows(self) -> int:
        """Rows the shortest call runs (row_block or min_rows)."""
        return max(self.row_block, self.min_rows)

    def call_rows(self, pos: int, n: int) -> int:
        """Rows a call of n tokens at `pos` runs: n, or the fixed shape (or min_rows) with
        filler rows (fewer where the KV buffers end)."""
        shortest = max(self.row_block if n <= self.row_block else 1, self.min_rows)
        return max(n, min(shortest, self._kv_len - pos))

    def invariant_block_limit(self, pos: int) -> int:
        """Most tokens a call starting at `pos` may hold so that each of its rows equals
        the single step at its position bit for bit: one attention bucket and, with a
        row block, at most row_block tokens; with filler rows (row block or min_rows),
        all at positions whose single steps run the full shape (in the last few
        positions of the buffers they run fewer rows, so only single steps are made
        there)."""
        limit = bucket_block_limit(pos, self.n_ctx)
        if self.row_block > 1:
            limit = min(limit, self.row_block)
        if self._filler_rows > 1:
            limit = min(limit, max(1, self._kv_len - self._filler_rows + 1 - pos))
        return limit

    def add_sequence(self) -> int:
        """Allocate the KV buffers of one more sequence slot; returns its index."""
        import onnxruntime as ort

        hp = self.hp
        shape = (1, hp.n_head_kv, self._kv_len, hp.head_dim)
        layers = []
        binding = self.session.io_binding()
        for i in range(hp.n_layer):
            k = ort.OrtValue.ortvalue_from_shape_and_type(shape, self._kv_dtype, self._device,
                                                          self._dev_id)
            v = ort.OrtValue.ortvalue_from_shape_and_type(shape, self._kv_dtype, self._device,
                                                          self._dev_id)
            if self._device == "cpu":  # finite contents: masked keys must multiply to 0
                k.numpy()[...] = 0
                v.numpy()[...] = 0
            else:
                zeros = np.zeros(shape, self._kv_dtype)
                k.update_inplace(zeros)
                v.update_inplace(zeros)
            binding.bind_ortvalue_input(f"past_key_{i}", k)
            binding.bind_ortvalue_output(f"present_key_{i}", k)
            binding.bind_ortvalue_input(f"past_value_{i}", v)
            binding.bind_ortvalue_output(f"present_value_{i}", v)
            layers.append((k, v))
        self._kv.append(layers)
        self._bindings.append(binding)
        return len(self._kv) - 1

    def forward(self, seq: int, tokens: Sequence[int], pos: int,
                rows: Sequence[int] | None = None, *, hidden: bool = False
                ) -> np.ndarray | tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run `tokens` at positions pos.. on sequence `seq`.

        Returns logits [len(rows), vocab] (rows default to the last token); with
        hidden=True also the hidden-state outputs {name: [S, n_embd]}.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if pos < 0 or pos + n > self.n_ctx:
            raise ContextFull(f"positions {pos}..{pos + n - 1} do not fit in the context of "
                              f"{self.n_ctx} tokens")
        rows = [n - 1] if rows is None else list(rows)
        n_rows = len(rows)
        ids = list(tokens)
        m = self.call_rows(pos, n)
        if m > n:  # fixed shape: filler rows
            ids += [ids[-1]] * (m - n)  # positions after the real ones, overwritten later
        # logits rows likewise: as many as the call's rows in a fixed shape, and at least
        # min_rows (the output product of a prefill's last row too)
        width = max(m if m > n else n_rows, self.min_rows)
        rows += [rows[-1] if rows else n - 1] * (width - n_rows)
        b = self._bindings[seq]
        b.bind_cpu_input("input_ids", np.asarray(ids, dtype=np.int64))
        b.bind_cpu_input("position", np.array([pos], dtype=np.int64))
        # keys attended: the real tokens' bucket (filler rows attend over it too: dropped)
        b.bind_cpu_input("attn_len", np.array([attn_len_for(pos + n, self.n_ctx)], np.int64))
        b.bind_cpu_input("logits_rows", np.asarray(rows, dtype=np.int64))
        b.bind_output("logits", "cpu")
        for name in self.hidden_names:
            b.bind_output(name, "cpu")
        self.session.run_with_iobinding(b)
        outs = _bound_outputs(b)
        # outputs come in the order bound: KV first (2 per layer), then logits, hidden
        k0 = 2 * self.hp.n_layer
        logits = outs[k0].numpy()[:n_rows]  # [R, vocab]
        if not hidden:
            return logits
        return logits, {name: outs[k0 + 1 + j].numpy()[:n]
                        for j, name in enumerate(self.hidden_names)}

    def prefill(self, seq: int, tokens: Sequence[int], pos: int = 0,
                chunk: int = ATTN_BUCKET) -> np.ndarray:
        """Evaluate a prompt in chunks; returns the logits of its last token [vocab].

        Chunks end on bucket boundaries, so prefill is the same computation whoever
        calls it (with or without speculation).
        """
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if pos + len(tokens) > self.n_ctx:
            raise ContextFull(f"prompt of {len(tokens)} tokens at position {pos} does not fit "
                              f"in the context of {self.n_ctx} tokens")
        logits = None
        i = 0
        while i < len(tokens):
            p = pos + i
            n = min(len(tokens) - i, chunk - (p % chunk))
            last = i + n == len(tokens)
            logits = self.forward(seq, tokens[i:i + n], p, [n - 1])
            i += n
            if last:
                break
        assert logits is not None
        return logits[0]


def _bound_outputs(b: Any) -> list[Any]:  # an onnxruntime.IOBinding
    """The binding's outputs as ORT's C-level values (each has .numpy()): the public
    `get_outputs` wraps every one in a Python OrtValue, 2 per layer for the KV caches
    that are never read here, ~0.25 ms a call (2% of a 0.5B draft step)."""
    inner = getattr(b, "_iobinding", None)
    return inner.get_outputs() if inner is not None else b.get_outputs()
