"""One model on ONNX Runtime: the session, its IOBindings, and calls that run tokens.

The KV cache (`kv_cache.KVCache`) is bound as both past and present, so the graph writes
new rows in place; rolling back is free: the next call starts at a smaller position and
overwrites the old rows.

`forward_batch` runs the calls of several sequences: as one pass where the graph packs
sequences (specd's CachedAttention takes `segments` [B, 3], slot, first position and rows,
and attends each row over its own slot's keys only), else one call after another (ORT's
own attention, CUDA).

A call's `pos` is where its rows go in the KV cache, and their rotary position too, except
on an M-RoPE model (qwen2vl): there every row has four rotary positions, the call's own
(`Call.rope_positions`: an image's grid, the text after it) or (p, p, p, 0) at KV position
p, bound as the graph input `rope_positions` for all the pass's rows.

Greedy speculation is exact only if every row of a verify call equals, bit for bit, the
single-token step at its position. The graph computes each row alone, and a block within
one attention bucket sees the numbers a single step sees (graph_builder's docstring); what
a call's shape decides is the runner's. `invariant_block_limit(pos)` caps every block a
round verifies. Filler rows (computed, their logits dropped, their KV rows past the real
positions overwritten later) give short calls a shape whose rows agree: `min_rows` runs
single steps as two rows where a one-row MatMulNBits product differs (row_invariance.py),
and on CUDA, where cuBLAS and MatMulNBits pick algorithms by shape, `row_block` runs every
call of up to CUDA_ROW_BLOCK tokens as that many rows. Longer calls keep their shape, so
on CUDA a prompt's KV may depend on how it was chunked; speculation stays exact against
target-only decoding.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from . import native_ops, sampling_op
from .arch import HParams
from .graph_builder import ATTN_BUCKET, EXPERT_IDS, ROPE_POSITIONS, BuildOptions
from .kv_cache import KVCache
from .model_cache import BuiltModel
from .providers import (
    RuntimeChoice,
    choose_runtime,
    ort_error_line,
    parse_device,
    session_providers,
)
from .row_invariance import min_call_rows
from .sampling_op import SampledBlock, SampleSpec
from .shared_initializers import add_initializers

log = logging.getLogger("specd.runner")


# Rows per call on CUDA (see ModelRunner.row_block): single steps and verify blocks of up
# to this many tokens all run as calls of exactly this many rows.
CUDA_ROW_BLOCK = 8
# most tokens of one call on a model with sliding-window rings: a prefill chunk
RING_CALL_ROWS = ATTN_BUCKET


@dataclass(frozen=True)
class Call:
    """One sequence's part of a pass: `tokens` at positions pos.. on slot `seq`; wanted
    back, the logits of `rows` (default: the last token) and the hidden states of
    `layers` (of the graph's feature layers). With `sample` (a graph with a sampler) the
    rows' tokens are decided in the graph, and their logits leave it only where the spec
    asks for them."""

    seq: int
    tokens: Sequence[int]
    pos: int
    rows: Sequence[int] | None = None
    layers: tuple[int, ...] = ()
    sample: SampleSpec | None = None
    # [len(tokens), n_embd]: the rows' embeddings in place of the tokens' (an image's
    # projected tokens; `tokens` then only counts them), run by the runner's embeddings
    # graph (`attach_embeddings`)
    embeds: np.ndarray | None = None
    # [4, len(tokens)] int64: the rows' M-RoPE positions (t, h, w, e) on a model with
    # them; None: a text row's at its KV position p, (p, p, p, 0). A sequence after an
    # image gives its text rows' too, shifted from their KV positions (spec/media.py)
    rope_positions: np.ndarray | None = None


@dataclass
class CallOutput:
    # [len(rows), vocab]; [len(rows), 0] where the graph decided the rows and the logits
    # were not asked for
    logits: np.ndarray
    features: dict[int, np.ndarray]  # {layer: [len(tokens), n_embd]}
    # the call's share of its pass's seconds, in proportion to its rows (all of them for
    # a call alone): what the call cost, not what waiting for the others' rows did
    seconds: float = 0.0
    sampled: SampledBlock | None = None  # what the graph decided (calls with a spec)
    # a mixture-of-experts target: the distinct (layer, expert) pairs the call's rows
    # (filler rows too: they ran) woke in its pass, what its expert reads cost; 0: dense
    experts_woken: int = 0
    # the call's share, in proportion to its rows, of the distinct pairs its whole pass
    # woke: summed over the calls of a step, the expert reads its passes made; 0: dense
    pass_experts_share: float = 0.0


class ContextFull(Exception):
    """The tokens asked for do not fit in the sequence's context."""


class GraphLoadError(RuntimeError):
    """ONNX Runtime could not load a built graph (its folder is damaged)."""


def text_rope_positions(pos: int, n: int, shift: int = 0) -> np.ndarray:
    """M-RoPE positions [4, n] of n text rows at KV positions pos.. whose rope positions
    are those plus `shift`: (p, p, p, 0) each, as llama.cpp expands a token's position."""
    p = np.arange(pos + shift, pos + shift + n, dtype=np.int64)
    return np.stack([p, p, p, np.zeros_like(p)])


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


def ring_rows(hp: HParams, options: BuildOptions, call_rows: int = RING_CALL_ROWS) -> int:
    """Rows of a sliding-window layer's ring: its window and call_rows - 1 more (a call then
    writes its rows over no key an earlier row of it reads), where the graph's attention
    indexes one (specd's kernel); 0 where it keeps the whole context."""
    if options.attention != "native" or not hp.sliding_window:
        return 0
    return round_up(hp.sliding_window + call_rows - 1, 8)


def check_call(pos: int, n: int, n_ctx: int) -> None:
    """A call of n tokens at positions pos.. must hold one token and fit the context."""
    if n == 0:
        raise ValueError("a forward call needs at least one token")
    if pos < 0 or pos + n > n_ctx:
        raise ContextFull(f"positions {pos}..{pos + n - 1} do not fit in the context of "
                          f"{n_ctx} tokens")


def session_options(threads: int, *, spinning: bool | str = False,
                    native: bool = False) -> Any:  # an onnxruntime.SessionOptions
    """Options of a session run by one caller at a time: `threads` intra-op threads, all
    graph optimizations, specd's ops registered where the graph uses them (native)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # spinning=True spins only while a run lasts; "always" keeps spinning (specd's own
    # kernels run on their own workers, which spin briefly after each task whatever
    # this says)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning is True:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if native:
        native_ops.register(so)
    return so


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))


class ModelRunner:
    def __init__(self, built: BuiltModel, *, n_ctx: int, n_seq: int = 1,
                 threads: int | None = None, runtime: RuntimeChoice | None = None,
                 spinning: bool | str = False, row_block: int | None = None,
                 min_rows: int | None = None, kv: KVCache | None = None,
                 initializers: Mapping[str, np.ndarray] | None = None):
        """row_block: every call of up to this many tokens runs as exactly this many rows
        (filler rows after the real ones, computed and dropped). Default 1 on the CPU,
        where kernels compute a row the same way whatever the number of rows (but see
        min_rows), and CUDA_ROW_BLOCK on CUDA, where ORT's kernels (cuBLAS, MatMulNBits)
        choose their algorithm by the shape: with one fixed shape a verified row is
        computed exactly as the single step at its position (bench/cuda_check.py), so
        greedy speculation gives the target's own output on CUDA too.

        min_rows: calls of fewer tokens run this many rows (filler rows again), larger
        ones their own. Default on the CPU: 2 where ORT computes a one-row MatMulNBits
        product differently from the same row in a larger call (MLAS's 4-bit kernels on
        CPUs without VNNI, measured by row_invariance at load), else 1.

        kv: a KV cache to share with another runner of a graph with the same layers (a
        drafter's graphs over one draft cache); default: the runner's own.

        initializers: arrays to use in place of the graph's initializers of those names
        (weights shared with a drafter head's sessions: shared_initializers.py)."""
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
        so = session_options(self.threads, spinning=spinning, native=built.options.uses_native)
        self._shared: list[object] = []  # the OrtValues behind `initializers`
        add_initializers(so, initializers or {}, self._shared)
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
        # hidden-state outputs, in the order the graph lists them: (name, layer)
        self._hidden = [(o.name, int(o.name.removeprefix("hidden_")))
                        for o in self.session.get_outputs() if o.name.startswith("hidden_")]
        # a MoE graph outputs its routers' choices (graph_builder.moe.EXPERT_IDS)
        self._expert_ids = any(o.name == EXPERT_IDS for o in self.session.get_outputs())
        kv_dtype = np.float16 if built.options.kv_dtype == "f16" else np.float32
        # sliding-window layers on specd's attention keep a ring of their window and one
        # call's rows, where that is shorter than the context
        self.ring = self._ring_len()
        lens = [self.ring if self.ring and self.hp.is_swa(i) else self._kv_len
                for i in range(self.hp.n_layer)]
        if kv is None:
            kv = KVCache(self.hp.n_layer, self.hp.n_head_kv, self.hp.head_dim, self._kv_len,
                         kv_dtype, self._device, self._dev_id, layer_lens=lens,
                         capacity=n_seq)
        elif kv.layer_shapes != [(1, self.hp.n_head_kv, n, self.hp.head_dim) for n in lens] or (
                kv.n_layer != self.hp.n_layer or kv.dtype != kv_dtype):
            raise ValueError(f"a shared KV cache of {kv.n_layer} layers {kv.shape} {kv.dtype} "
                             f"does not fit {built.folder.name}")
        self.kv = kv
        # a graph whose attention takes segments runs the rows of several sequences in one
        # call, over every slot's buffers bound at once (one binding); others get a
        # binding per sequence slot, bound to its buffers
        inputs = {i.name for i in self.session.get_inputs()}
        self.packs_sequences = "segments" in inputs
        # the graph's rows are embeddings (graph_builder's embeddings_input), not ids
        self.takes_embeddings = "input_embeds" in inputs
        # the graph that runs calls carrying embeddings, over this runner's KV cache
        self.embeddings_runner: ModelRunner | None = None
        # the graph decides tokens itself for calls that carry a SampleSpec
        self.samples = "sample_plan" in inputs
        # every row's four M-RoPE positions come in beside it (qwen2vl)
        self.takes_rope_positions = ROPE_POSITIONS in inputs
        # per binding, the arrays last bound as the sampler's inputs (kept alive with it)
        self._sampler_inputs: dict[int, dict[str, np.ndarray]] = {}
        self._all = self.session.io_binding() if self.packs_sequences else None
        self._bindings: list[Any] = []  # an onnxruntime.IOBinding per slot (not packing)
        self._n_seq = 0
        self._kv_version = -1  # the cache's buffers as last bound
        while self._n_seq < max(n_seq, kv.n_seq):
            self.add_sequence()

    def _max_positions(self) -> int:
        return self.built.options.max_positions or self.hp.n_ctx_train

    def _ring_len(self) -> int | None:
        """Rows of a sliding-window layer's ring where it is shorter than the context."""
        ring = ring_rows(self.hp, self.built.options, self.max_call_rows)
        return ring if 0 < ring < self._kv_len else None

    @property
    def max_call_rows(self) -> int:
        """Most rows (filler rows included) one call may run."""
        return max(RING_CALL_ROWS, self._filler_rows)

    @property
    def n_seq(self) -> int:
        return self._n_seq

    @property
    def logits_width(self) -> int:
        """Ids a logits row covers."""
        return self.built.options.logits_width(self.hp.n_vocab)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The layers whose hidden states (the residual stream after the layer) the graph
        outputs, for `forward_with_features`."""
        return tuple(layer for _, layer in self._hidden)

    @property
    def kv_bytes(self) -> int:
        return self.kv.n_seq * self.kv.bytes_per_sequence

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
        """Bind one more sequence slot (allocating its KV buffers unless a runner sharing
        the cache did); returns its index."""
        seq = self._n_seq
        if seq == self.kv.n_seq:
            self.kv.add_sequence()
        if not self.packs_sequences:
            self._bindings.append(self.session.io_binding())
        self._n_seq += 1
        self._kv_version = -1  # bound at the next call
        if self.embeddings_runner is not None:
            self.embeddings_runner.add_sequence()
        return seq

    def attach_embeddings(self, built: BuiltModel,
                          initializers: Mapping[str, np.ndarray] | None = None
                          ) -> ModelRunner:
        """Open `built`, this model's graph taking embeddings as its rows
        (BuildOptions.embeddings_input), over this runner's KV cache: calls that carry
        embeddings (an image's) run there, the others here. initializers: this graph's
        weights to share (shared_initializers.same_named)."""
        if not built.options.embeddings_input or built.hparams != self.hp:
            raise ValueError(f"{built.folder.name} is not {self.built.folder.name}'s model "
                             "taking embeddings")
        self.embeddings_runner = ModelRunner(
            built, n_ctx=self.n_ctx, n_seq=self.n_seq, threads=self.threads,
            runtime=self.runtime, row_block=1, min_rows=1, kv=self.kv,
            initializers=initializers)
        return self.embeddings_runner

    def copy_prefix(self, src: int, dst: int, n: int, src_len: int) -> bool:
        """Give sequence `dst` the KV of positions 0..n-1 of sequence `src` (which holds
        `src_len` positions) by copying its rows: a prompt's shared prefix evaluated once
        for several slots. False where the cache cannot (KVCache.copy_prefix)."""
        return self.kv.copy_prefix(src, dst, n, src_len)

    def _binding(self, seq: int) -> Any:  # an onnxruntime.IOBinding
        """The binding a call on `seq` runs with, its cache buffers bound as they are now
        (they move when a runner sharing the cache adds a slot past its capacity)."""
        if self._kv_version != self.kv.version:
            if self._all is not None:
                self.kv.bind_all(self._all)
            for s, b in enumerate(self._bindings):
                self.kv.bind(b, s)
            self._kv_version = self.kv.version
        return self._all if self._all is not None else self._bindings[seq]

    def forward(self, seq: int, tokens: Sequence[int], pos: int,
                rows: Sequence[int] | None = None) -> np.ndarray:
        """Run `tokens` at positions pos.. on sequence `seq`; the logits of `rows` (default:
        the last token) [len(rows), vocab]."""
        return self._pass([Call(seq, tokens, pos, rows)])[0].logits

    def forward_with_features(self, seq: int, tokens: Sequence[int], pos: int,
                              rows: Sequence[int] | None = None,
                              layers: Sequence[int] | None = None
                              ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`forward`, and the hidden states of `layers` (default: all the graph outputs)
        for every token: {layer: [len(tokens), n_embd]}."""
        out = self._pass([Call(seq, tokens, pos, rows, self._check_layers(layers))])[0]
        return out.logits, out.features

    def forward_batch(self, calls: Sequence[Call]) -> list[CallOutput]:
        """Run the calls of several sequences (one each): where the graph packs sequences,
        as one pass that reads every weight once for all their rows, each row computed
        exactly as in its call alone; else one call after another."""
        if len({c.seq for c in calls}) < len(calls):
            raise ValueError("a batch holds one call per sequence")
        if any(c.embeds is not None for c in calls) and not self.takes_embeddings:
            return self._with_embeddings(calls)
        for c in calls:
            self._check_layers(c.layers)
            if c.sample is not None:
                self._check_sample(c)
            self._check_embeds(c)
            self._check_rope_positions(c)
        if self.packs_sequences and len(calls) > 1:
            return self._pass(calls)
        return [self._pass([c])[0] for c in calls]

    def _with_embeddings(self, calls: Sequence[Call]) -> list[CallOutput]:
        """The calls carrying embeddings on the embeddings graph, each alone, the others
        here together; their outputs in the calls' order."""
        emb = self.embeddings_runner
        if emb is None:
            raise ValueError(f"{self.built.folder.name} takes no embeddings: no graph "
                             "taking them is attached (attach_embeddings)")
        text = [c for c in calls if c.embeds is None]
        done = iter(self.forward_batch(text) if text else [])
        return [emb.forward_batch([c])[0] if c.embeds is not None else next(done)
                for c in calls]

    def _check_embeds(self, call: Call) -> None:
        if not self.takes_embeddings:
            return
        e = call.embeds
        if e is None or e.shape != (len(call.tokens), self.hp.n_embd):
            raise ValueError(f"{self.built.folder.name} takes embeddings [{len(call.tokens)}, "
                             f"{self.hp.n_embd}] for a call of {len(call.tokens)} rows, got "
                             f"{None if e is None else list(e.shape)}")

    def _check_rope_positions(self, call: Call) -> None:
        r = call.rope_positions
        if r is None:
            return
        if not self.takes_rope_positions:
            raise ValueError(f"{self.built.folder.name} has one rope position per row: a call "
                             "gives no M-RoPE positions")
        if np.shape(r) != (4, len(call.tokens)):
            raise ValueError(f"a call of {len(call.tokens)} rows takes M-RoPE positions "
                             f"[4, {len(call.tokens)}], got {list(np.shape(r))}")

    def _check_sample(self, call: Call) -> None:
        assert call.sample is not None
        if not self.samples:
            raise ValueError(f"{self.built.folder.name} has no sampler: its calls' tokens "
                             "are decided on the host")
        rows = 1 if call.rows is None else len(call.rows)
        if rows != call.sample.rows:
            raise ValueError(f"a sample spec of {len(call.sample.drafts)} drafts decides "
                             f"{call.sample.rows} rows, the call returns {rows}")

    def _check_layers(self, layers: Sequence[int] | None) -> tuple[int, ...]:
        if layers is None:
            return self.feature_layers
        missing = sorted(set(layers) - set(self.feature_layers))
        if missing:
            raise ValueError(f"{self.built.folder.name} outputs the hidden states of layers "
                             f"{list(self.feature_layers)}, not {missing}")
        return tuple(layers)

    def _pass(self, calls: Sequence[Call]) -> list[CallOutput]:
        """One session run over the calls' rows, one after another (several calls only
        where the graph packs sequences). A call alone runs `call_rows` rows: filler rows
        after its own where the shape asks for them."""
        ids: list[int] = []
        logits_rows: list[int] = []
        segments: list[tuple[int, int, int]] = []  # (slot, pos, rows) per call
        for call in calls:
            n = len(call.tokens)
            check_call(call.pos, n, self.n_ctx)
            m = self.call_rows(call.pos, n) if len(calls) == 1 else n
            if self.ring and m > self.max_call_rows:
                raise ValueError(f"a call of {m} rows exceeds the {self.max_call_rows} rows a "
                                 "sliding window's ring allows; run prompts through prefill")
            start = len(ids)
            # filler rows: positions after the real ones, overwritten later
            ids += [*call.tokens, *[call.tokens[-1]] * (m - n)]
            rows = [n - 1] if call.rows is None else list(call.rows)
            logits_rows += [start + r for r in rows]
            segments.append((call.seq, call.pos, m))
        n_logits = len(logits_rows)
        # logits rows likewise: as many as a fixed shape's rows (a call alone with filler
        # rows), and at least min_rows (the output product of a prefill's last row too)
        filled = len(calls) == 1 and len(ids) > len(calls[0].tokens)
        width = max(len(ids) if filled else n_logits, self.min_rows)
        logits_rows += [logits_rows[-1] if logits_rows else len(ids) - 1] * (width - n_logits)
        b = self._binding(calls[0].seq)
        if self.takes_embeddings:  # [rows, n_embd], filler rows repeat the last
            embeds = [np.asarray(c.embeds, dtype=np.float32) for c in calls]
            rows_e = np.concatenate(embeds) if len(embeds) > 1 else embeds[0]
            if len(rows_e) < len(ids):
                rows_e = np.concatenate([rows_e, np.repeat(rows_e[-1:], len(ids) - len(rows_e),
                                                           axis=0)])
            b.bind_cpu_input("input_embeds", np.ascontiguousarray(rows_e))
        else:
            b.bind_cpu_input("input_ids", np.asarray(ids, dtype=np.int64))
        if self.packs_sequences:
            b.bind_cpu_input("segments", np.asarray(segments, dtype=np.int64))
        else:
            (_, pos, _), n = segments[0], len(calls[0].tokens)
            b.bind_cpu_input("position", np.array([pos], dtype=np.int64))
            # keys attended: the real tokens' bucket (filler rows attend over it too: dropped)
            b.bind_cpu_input("attn_len", np.array([attn_len_for(pos + n, self.n_ctx)],
                                                  np.int64))
        b.bind_cpu_input("logits_rows", np.asarray(logits_rows, dtype=np.int64))
        if self.takes_rope_positions:
            b.bind_cpu_input(ROPE_POSITIONS, rope_rows(calls, segments))
        b.bind_output("logits", "cpu")
        for name, _ in self._hidden:
            b.bind_output(name, "cpu")
        specs = [c.sample for c in calls]
        first_rows = [0, *accumulate(1 if c.rows is None else len(c.rows) for c in calls)]
        if self.samples:
            sampling_op.bind(b, specs, first_rows[:-1], self.logits_width,
                             self._sampler_inputs.setdefault(id(b), {}))
        if self._expert_ids:  # bound last: read as the last output
            b.bind_output(EXPERT_IDS, "cpu")
        t0 = time.perf_counter()
        self.session.run_with_iobinding(b)
        per_row = (time.perf_counter() - t0) / len(ids)
        outs = bound_outputs(b)
        # outputs come in the order bound: KV first (2 per layer), then logits, hidden
        k0 = 2 * self.hp.n_layer
        # the logits leave the session only where a call's rows were not decided in it
        wanted = [s is None or s.want_logits for s in specs]
        logits = outs[k0].numpy() if any(wanted) else None  # [width, vocab]
        hidden = {layer: outs[k0 + 1 + j].numpy()  # [rows, n_embd]
                  for j, (_, layer) in enumerate(self._hidden)}
        k1 = k0 + 1 + len(self._hidden)
        sampled = (sampling_op.read(outs, k1, specs, first_rows[:-1])
                   if any(s is not None for s in specs) else [None] * len(calls))
        expert_ids = (outs[len(outs) - 1].numpy()  # [rows, L * top_k]
                      if self._expert_ids else None)
        per_row_experts = (0.0 if expert_ids is None
                           else self.experts_woken(expert_ids) / len(expert_ids))
        results, start = [], 0
        for call, (_, _, m), first, end, block, want in zip(
                calls, segments, first_rows, first_rows[1:], sampled, wanted, strict=False):
            n = len(call.tokens)
            results.append(CallOutput(
                logits[first:end] if want and logits is not None  # [r, vocab]
                else np.empty((end - first, 0), dtype=np.float32),
                {layer: hidden[layer][start:start + n] for layer in call.layers},
                per_row * m, block,
                0 if expert_ids is None else self.experts_woken(expert_ids[start:start + m]),
                per_row_experts * m))
            start += m
        return results

    def experts_woken(self, expert_ids: np.ndarray) -> int:
        """The distinct (layer, expert) pairs in rows of the graph's EXPERT_IDS output
        ([rows, n_layer * top_k]): the experts whose matrices those rows' pass read."""
        moe = self.hp.moe
        assert moe is not None
        rows = expert_ids.reshape(len(expert_ids), -1, moe.n_used)  # [rows, L, top_k]
        layer = np.arange(rows.shape[1], dtype=np.int64)[None, :, None] * moe.n_expert
        return int(np.unique(rows + layer).size)

    def prefill(self, seq: int, tokens: Sequence[int], pos: int = 0,
                chunk: int = ATTN_BUCKET, rope_positions: np.ndarray | None = None
                ) -> np.ndarray:
        """Evaluate a prompt in chunks; returns the logits of its last token [vocab].
        rope_positions [4, len(tokens)]: its rows' M-RoPE positions (Call.rope_positions).

        Chunks end on bucket boundaries, so prefill is the same computation whoever
        calls it (with or without speculation).
        """
        return self._prefill(seq, tokens, pos, chunk, (), rope_positions)[0]

    def prefill_with_features(self, seq: int, tokens: Sequence[int], pos: int = 0,
                              layers: Sequence[int] | None = None, chunk: int = ATTN_BUCKET
                              ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`prefill`, and the hidden states of `layers` (default: all the graph outputs)
        for every prompt token: {layer: [len(tokens), n_embd]}."""
        return self._prefill(seq, tokens, pos, chunk, self._check_layers(layers))

    def _prefill(self, seq: int, tokens: Sequence[int], pos: int, chunk: int,
                 layers: tuple[int, ...], rope_positions: np.ndarray | None = None
                 ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if pos + len(tokens) > self.n_ctx:
            raise ContextFull(f"prompt of {len(tokens)} tokens at position {pos} does not fit "
                              f"in the context of {self.n_ctx} tokens")
        logits = None
        parts: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
        i = 0
        while i < len(tokens):
            p = pos + i
            n = min(len(tokens) - i, chunk - (p % chunk))
            rope = None if rope_positions is None else rope_positions[:, i:i + n]
            call = Call(seq, tokens[i:i + n], p, [n - 1], layers, rope_positions=rope)
            self._check_rope_positions(call)
            out = self._pass([call])[0]
            logits = out.logits
            for layer, rows in out.features.items():
                parts[layer].append(rows)
            i += n
        assert logits is not None
        return logits[0], {layer: np.concatenate(rows) for layer, rows in parts.items()}


def rope_rows(calls: Sequence[Call], segments: Sequence[tuple[int, int, int]]
              ) -> np.ndarray:
    """The M-RoPE positions [4, rows] of a pass's rows, call after call: a call's own, or
    its text rows' (text_rope_positions); filler rows continue as text rows after its
    last KV position (their results are dropped)."""
    parts = []
    for call, (_, pos, m) in zip(calls, segments, strict=True):
        n = len(call.tokens)
        own = (text_rope_positions(pos, n) if call.rope_positions is None
               else np.asarray(call.rope_positions, dtype=np.int64))
        parts.append(own)
        if m > n:
            parts.append(text_rope_positions(pos + n, m - n))
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def bound_outputs(b: Any) -> list[Any]:  # an onnxruntime.IOBinding
    """The binding's outputs as ORT's C-level values (each has .numpy()): the public
    `get_outputs` would wrap every one in a Python OrtValue, 2 per layer for the KV caches
    that are never read here, a cost per call that shows in a draft step."""
    inner = getattr(b, "_iobinding", None)
    return inner.get_outputs() if inner is not None else b.get_outputs()
