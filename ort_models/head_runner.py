"""A drafter head on ONNX Runtime: its graphs, built once per (head, target) pair into the
graph cache, and a session each over one draft KV cache.

The DFlash family (DFlash, DSpark, DFlash2): `inject` writes the K/V rows of verified
target tokens from their features; `block` runs [last, MASK...] over them and returns the
logits of the rows asked for (and a DSpark head's confidences; a DFlash2 head's candidate
lattice instead of logits). A block's own K/V rows land after the
injected ones and are overwritten by the next injection or block, so rolling back is
free, as in the target's cache.

EAGLE-3: `encode` turns target features into the head's g rows (no cache); `pair` writes
the K/V rows of verified (token, g) pairs; `step` runs pairs through its layer, writing
their K/V rows at their positions, and returns the logits and pre-norm hidden states of
the rows asked for. Rows past the verified
context are overwritten by the next step likewise.

A DFlash block graph or an EAGLE-3 step graph on specd's attention (`packs_sequences`)
runs the calls of several sequences in one pass (`forward_batch`), each row over its own
slot's cache, so a row's bits are the same whatever shares its pass; elsewhere
`forward_batch` runs them one after another. DFlash injections beside it likewise
(`deferred_injections`). A DFlash-family head of an M-RoPE target
(`takes_rope_positions`) rotates its injected rows and its block at the rope positions
given (`inject`'s `rope_positions`, `BlockCall.rope_pos`), apart from the cache rows they
are written at.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from . import native_ops, sampling_op
from .arch import HParams, read_hparams
from .gguf_file import GGUFFile
from .graph_builder import BUILDER_VERSION, Progress
from .graph_builder.dflash import (
    build_block_graph,
    build_injection_graph,
    head_hparams,
    head_options,
    packs_sequences,
    unsupported,
)
from .graph_builder.eagle3 import build_encode_graph, build_pair_graph, build_step_graph
from .graph_builder.mrope import ROPE_POSITIONS
from .graph_builder.options import ACCURACY_LEVEL, BuildOptions
from .heads import HeadParams, read_head
from .kv_cache import KVCache
from .model_cache import META_FILE, build_folder, is_complete
from .onnx_writer import GraphWriter
from .paths import cache_dir, exclusive_lock
from .providers import RuntimeChoice, choose_runtime, parse_device, session_providers
from .runner import (
    bound_outputs,
    check_call,
    default_threads,
    session_options,
    text_rope_positions,
)
from .sampling_op import SampledBlock, SampleSpec
from .shared_initializers import SharedWeights, add_initializers

# bumped when a head's graphs change (what they compute, or which graphs a kind has), so
# cached ones are rebuilt; BUILDER_VERSION covers the blocks they share with targets
HEAD_GRAPHS_VERSION = 12

# graph name -> its builder, per head kind: (head file, head, target file, target, writer,
# options, progress) -> None
_Builder = Callable[[GGUFFile, HeadParams, GGUFFile, HParams, GraphWriter, BuildOptions,
                     Progress | None], None]
_DFLASH_GRAPHS: dict[str, _Builder] = {
    "inject": lambda hf, h, tf, t, g, o, p: build_injection_graph(hf, h, t, g, o, p),
    "block": build_block_graph,
}
GRAPHS: dict[str, dict[str, _Builder]] = {
    "dflash": _DFLASH_GRAPHS,
    "dspark": _DFLASH_GRAPHS,
    "dflash2": _DFLASH_GRAPHS,
    "eagle3": {
        "encode": lambda hf, h, tf, t, g, o, p: build_encode_graph(hf, h, t, g, o, p),
        "pair": build_pair_graph,
        "step": build_step_graph,
    },
}


@dataclass(frozen=True)
class BlockOutput:
    logits: np.ndarray  # [R, vocab] the rows asked for ([R, 0] for DFlash2: not output)
    confidence: np.ndarray | None = None  # [R] DSpark's confidence head
    candidates: np.ndarray | None = None  # [R, k] DFlash2's top-k token ids per row
    scores: np.ndarray | None = None  # [R, k, k] DFlash2's (predecessor, successor) scores
    sampled: list[SampledBlock | None] | None = None  # per row, where the graph chose them
    # the block's share of its pass's seconds, in proportion to its rows (all of them for
    # a block alone)
    seconds: float = 0.0


@dataclass(frozen=True)
class BlockCall:
    """One sequence's block in a pass: `HeadRunner.block`'s arguments."""

    seq: int
    tokens: Sequence[int]
    pos: int
    rows: Sequence[int]
    specs: Sequence[SampleSpec] | None = None
    # the rope position of the block's first row, its rows at rope_pos.. (a head whose
    # graph takes them, `takes_rope_positions`; None: pos, where the block is written)
    rope_pos: int | None = None


@dataclass(frozen=True)
class StepOutput:
    logits: np.ndarray  # [R, vocab] the rows asked for ([1, 0] where the graph chose)
    hidden: np.ndarray  # [R, E] their pre-norm hidden states (the next step's g)
    sampled: SampledBlock | None = None  # what the graph chose (a step with a spec)
    seconds: float = 0.0  # the step's share of its pass's seconds, by rows


@dataclass(frozen=True)
class StepCall:
    """One sequence's EAGLE-3 step in a pass: `HeadRunner.step`'s arguments."""

    seq: int
    tokens: Sequence[int]
    g: np.ndarray  # [n, E]
    pos: int
    rows: Sequence[int]
    spec: SampleSpec | None = None


@dataclass(frozen=True)
class BuiltHead:
    folder: Path
    head: HeadParams
    hparams: HParams  # the head's decoder (over the target's vocabulary)
    target: HParams
    head_path: Path
    uses_native: bool = False  # specd's ops are in its graphs: sessions must register them

    @property
    def graphs(self) -> tuple[str, ...]:
        """The names of its graphs."""
        return tuple(GRAPHS[self.head.kind])

    def model_path(self, graph: str) -> Path:
        return self.folder / f"{graph}.onnx"


def load_or_build_head(head_path: str | Path, target_path: str | Path,
                       progress: Progress | None = None, *, device: str = "cpu",
                       accuracy_level: int = ACCURACY_LEVEL, kernels: str | None = None,
                       requant: str | None = None) -> BuiltHead:
    """The head's graphs for this target on `device`, built (under the folder's lock) unless
    cached. kernels and requant (as in BuildOptions): default "gguf" with every matrix
    re-quantized to Q4_K where specd's kernels run (the CPU, compiled), as a draft model's
    are; else "ort" and the GGUF's own blocks. accuracy_level: MatMulNBits'."""
    head_file, target_file = GGUFFile(head_path), GGUFFile(target_path)
    head, target = read_head(head_file), read_hparams(target_file)
    missing = unsupported(head)
    if missing:
        raise ValueError(f"{Path(head_path).name}: specd does not run this head: "
                         + "; ".join(missing))
    if kernels is None:
        kernels = native_ops.kernels_for(device)
    if requant is None:
        requant = "q4k" if kernels == "gguf" else ""
    options = head_options(target, accuracy_level, kernels, requant, sampler=kernels == "gguf",
                           packed=packs_sequences(head, kernels))
    folder = (cache_dir() / "heads" / f"{head_file.content_hash()[:16]}-"
              f"{target_file.content_hash()[:16]}-b{BUILDER_VERSION}.{HEAD_GRAPHS_VERSION}-"
              f"{options.key()}")
    if not is_complete(folder):
        with exclusive_lock(folder.with_name(f"{folder.name}.lock")):
            if not is_complete(folder):
                def write(tmp: Path) -> list[str]:
                    files = []
                    for name, build in GRAPHS[head.kind].items():
                        with open(tmp / f"{name}.bin", "wb") as wf:
                            g = GraphWriter(wf, f"{name}.bin")
                            build(head_file, head, target_file, target, g, options, progress)
                        g.save(tmp / f"{name}.onnx")
                        files += [f"{name}.onnx", f"{name}.bin"]
                    return files

                meta = {"builder_version": BUILDER_VERSION, "head": str(head_path),
                        "target": str(target_path), "head_params": dataclasses.asdict(head)}
                build_folder(folder, write, meta, Path(head_path).name)
    assert (folder / META_FILE).is_file()
    return BuiltHead(folder, head, head_hparams(head, target), target, Path(head_path),
                     options.uses_native)


class HeadRunner:
    """The sessions of a built head, those with a cache bound to one KVCache; a binding per
    sequence slot and session."""

    def __init__(self, built: BuiltHead, *, n_ctx: int, n_seq: int = 1,
                 threads: int | None = None, runtime: RuntimeChoice | None = None,
                 shared: SharedWeights | None = None):
        """shared: the target's weights the head's graphs use in place of their copies
        (`share_with_target`, the same arrays the target's runner was given)."""
        import onnxruntime as ort

        self.built, self.hp = built, built.hparams
        self.n_ctx = min(n_ctx, built.target.n_ctx_train)
        self.runtime = runtime or choose_runtime("auto")
        device, device_id = parse_device(self.runtime.device)
        self._shared: list[object] = []  # the OrtValues behind `shared`

        def options(graph: str) -> Any:
            so = session_options(threads or default_threads(), native=built.uses_native)
            if shared is not None:
                add_initializers(so, shared.for_graph(graph), self._shared)
            return so

        self.sessions = {name: ort.InferenceSession(
            str(built.model_path(name)), options(name),
            providers=session_providers(self.runtime.device)) for name in built.graphs}
        # graphs taking `segments` (a block, a step): the calls of several sequences in
        # one pass, every slot's buffers bound at once (one binding each)
        packing = [name for name, sess in self.sessions.items()
                   if any(i.name == "segments" for i in sess.get_inputs())]
        self.packs_blocks, self.packs_steps = "block" in packing, "step" in packing
        block_inputs = ({i.name for i in self.sessions["block"].get_inputs()}
                        if self.packs_blocks else set())
        self._row_anchors = "row_anchors" in block_inputs
        # a DFlash-family head of an M-RoPE target: its rows rotate at positions given
        # apart from where they are written (graph_builder/dflash.py head_hparams)
        self.takes_rope_positions = "block" in self.sessions and any(
            i.name == ROPE_POSITIONS for i in self.sessions["block"].get_inputs())
        self._block_rows = "block_rows" in block_inputs
        self._cached = [name for name, sess in self.sessions.items()
                        if any(i.name == "past_key_0" for i in sess.get_inputs())
                        and name not in packing]
        # graphs returning K/V rows instead of writing them (DFlash's injection, EAGLE-3's
        # pairs, beside a packing graph): the rows of several sequences in one pass,
        # written into their slots here; they may wait in `_pending` while
        # `deferred_injections` is open
        self._row_graphs = {name for name, sess in self.sessions.items()
                            if any(i.name == "positions" for i in sess.get_inputs())}
        self.packs_injections = "inject" in self._row_graphs
        self.packs_pairs = "pair" in self._row_graphs
        # (graph, seq, its inputs of n rows, pos, the rows' rope positions [n]) per call
        # waiting
        self._pending: list[tuple[str, int, dict[str, np.ndarray], int, np.ndarray]] = []
        self._deferring = 0
        self.injections = 0  # inject() and pair() calls
        self.inject_passes = 0  # their session runs (a pass may hold several calls')
        self._all = {name: self.sessions[name].io_binding() for name in packing}
        self._all_version = dict.fromkeys(packing, -1)  # the cache's buffers as last bound
        self.block_passes = 0  # block session runs (a pass may hold several sequences')
        self.step_passes = 0  # step session runs (likewise)
        # the block and step graphs choose their rows' proposals where asked (a SampleSpec
        # per row)
        self.block_samples, self.step_samples = (
            name in self.sessions and any(i.name == "sample_plan"
                                          for i in self.sessions[name].get_inputs())
            for name in ("block", "step"))
        # per binding, the arrays last bound as the sampler's inputs
        self._sampler_inputs: dict[int, dict[str, np.ndarray]] = {}
        self.kv = KVCache(self.hp.n_layer, self.hp.n_head_kv, self.hp.head_dim, self.n_ctx,
                          np.float32, device, device_id, capacity=n_seq)
        self._bindings: list[dict[str, Any]] = []
        for _ in range(n_seq):
            self.add_sequence()

    @property
    def n_seq(self) -> int:
        return len(self._bindings)

    @property
    def feature_width(self) -> int:
        return len(self.built.head.target_layers) * self.built.head.target_hidden_size

    def add_sequence(self) -> int:
        version = self.kv.version
        seq = self.kv.add_sequence()
        self._bindings.append({name: self.sessions[name].io_binding() for name in self._cached})
        # where the cache's buffers moved, every sequence's bindings follow them
        for s in range(self.n_seq) if self.kv.version != version else [seq]:
            for b in self._bindings[s].values():
                self.kv.bind(b, s)
        return seq

    def inject(self, seq: int, features: np.ndarray, pos: int,
               rope_positions: np.ndarray | None = None) -> None:
        """Write the K/V rows of target tokens at positions pos.. from their features
        [n, L*E_t] (the target layers' hidden states, concatenated in the head's order),
        rotated at `rope_positions` [n] where given (a head whose injection returns its
        rows; default: pos..)."""
        check_call(pos, features.shape[0], self.n_ctx)
        if rope_positions is not None and not self.packs_injections:
            raise ValueError("this head's injection writes its rows at their rope positions")
        self.injections += 1
        if self.packs_injections:
            self._write_rows("inject", seq, {"features": features}, pos, rope_positions)
            return
        b = self._bindings[seq]["inject"]
        b.bind_cpu_input("features", np.ascontiguousarray(features, dtype=np.float32))
        b.bind_cpu_input("position", np.array([pos], dtype=np.int64))
        self.sessions["inject"].run_with_iobinding(b)
        self.inject_passes += 1

    def _write_rows(self, graph: str, seq: int, inputs: dict[str, np.ndarray], pos: int,
                    rope_positions: np.ndarray | None = None) -> None:
        """A call of a graph returning K/V rows, rotated at `rope_positions` [n] (None:
        pos..): waiting while `deferred_injections` is open (its inputs copied: the caller
        may reuse them), else run at once."""
        waits = self._deferring > 0
        copy = np.array if waits else np.asarray
        n = len(next(iter(inputs.values())))
        rope = (np.arange(pos, pos + n, dtype=np.int64) if rope_positions is None
                else np.array(rope_positions, dtype=np.int64))
        if rope.shape != (n,):
            raise ValueError(f"{n} rows take {n} rope positions, got {list(rope.shape)}")
        self._pending.append((graph, seq, {
            name: copy(a, dtype=np.int64 if name == "input_ids" else np.float32)
            for name, a in inputs.items()}, pos, rope))
        if not waits:
            self.flush_injections()

    @contextmanager
    def deferred_injections(self) -> Iterator[None]:
        """While open, injections and EAGLE-3 pairs (of any sequences) wait, and run in one
        pass per graph when it closes (or before a block or step reads them), where their
        graphs pack them."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring:
                self.flush_injections()

    def flush_injections(self) -> None:
        """Run the waiting injections and pairs, one pass per graph: each call's K/V rows
        written into its sequence's slot at their positions."""
        pending, self._pending = self._pending, []
        for graph in dict.fromkeys(name for name, *_ in pending):
            calls = [(seq, inputs, pos) for name, seq, inputs, pos, _ in pending
                     if name == graph]
            feed = {name: np.concatenate([inputs[name] for _, inputs, _ in calls])
                    for name in calls[0][1]}  # [S, ...]
            lengths = [len(next(iter(inputs.values()))) for _, inputs, _ in calls]
            feed["positions"] = np.concatenate([rope for name, *_, rope in pending
                                                if name == graph])  # [S]
            names = [f"{kind}_{i}" for i in range(self.hp.n_layer) for kind in ("key", "value")]
            outs = self.sessions[graph].run(names, feed)
            self.inject_passes += 1
            hkv, hd = self.hp.n_head_kv, self.hp.head_dim
            start = 0
            for (seq, _, pos), n in zip(calls, lengths, strict=True):
                # the caches [1, Hkv, kv_len, hd] of each layer, its rows [S, Hkv*hd]
                for (k, v), k_rows, v_rows in zip(self.kv.layers(seq), outs[0::2], outs[1::2],
                                                  strict=True):
                    for cache, rows in ((k, k_rows), (v, v_rows)):
                        cache[0, :, pos:pos + n] = (rows[start:start + n].reshape(n, hkv, hd)
                                                    .transpose(1, 0, 2))
                start += n

    def block(self, seq: int, tokens: Sequence[int], pos: int, rows: Sequence[int],
              specs: Sequence[SampleSpec] | None = None, rope_pos: int | None = None
              ) -> BlockOutput:
        """Run the block `tokens` at positions pos.. over the injected context (rotated at
        rope_pos.. where given); the logits of `rows` (a DSpark head's Markov chain runs
        over them in the order given), or with `specs` (one per row, a graph with a
        sampler) the proposal chosen at each row."""
        return self._block_pass([BlockCall(seq, tokens, pos, rows, specs, rope_pos)])[0]

    def forward_batch(self, calls: Sequence[Any]) -> list[Any]:
        """The blocks (BlockCall -> BlockOutput) or EAGLE-3 steps (StepCall -> StepOutput)
        of several sequences, one each: where the graph packs them, in one pass that reads
        every weight once for all their rows, each row computed exactly as in its call
        alone; else one call after another."""
        if len({c.seq for c in calls}) < len(calls):
            raise ValueError("a batch holds one call per sequence")
        steps = [c for c in calls if isinstance(c, StepCall)]
        if steps and len(steps) < len(calls):
            raise ValueError("a batch holds blocks or steps, not both")
        run = self._step_pass if steps else self._block_pass
        if (self.packs_steps if steps else self.packs_blocks) and len(calls) > 1:
            return list(run(calls))
        return [run([c])[0] for c in calls]

    def _binding(self, name: str, seq: int) -> Any:  # an onnxruntime.IOBinding
        """The binding a call of graph `name` on `seq` runs with, the cache's buffers bound
        as they are now (they move when a sequence is added past the cache's capacity)."""
        b = self._all.get(name)
        if b is None:
            return self._bindings[seq][name]
        if self._all_version[name] != self.kv.version:
            self.kv.bind_all(b)
            self._all_version[name] = self.kv.version
        return b

    def _block_pass(self, calls: Sequence[BlockCall]) -> list[BlockOutput]:
        """One session run over the calls' blocks, one after another (several only where
        the graph packs them)."""
        for c in calls:
            if c.specs is not None and (not self.block_samples or len(c.specs) != len(c.rows)):
                raise ValueError(f"{len(c.specs)} sample specs for {len(c.rows)} rows of a "
                                 "block " + ("" if self.block_samples
                                             else "whose graph has no sampler"))
        b, ids = self._bind_rows("block", calls, self.packs_blocks)
        if self.takes_rope_positions:  # [4, S]: the rows' rope positions, one each
            b.bind_cpu_input(ROPE_POSITIONS, np.ascontiguousarray(np.concatenate(
                [text_rope_positions(c.pos if c.rope_pos is None else c.rope_pos,
                                     len(c.tokens)) for c in calls], axis=1)))
        elif any(c.rope_pos is not None for c in calls):
            raise ValueError("this head's blocks rotate their rows where they are written")
        if self._block_rows:  # DFlash2's convolutions start at each block's first row
            b.bind_cpu_input("block_rows", np.concatenate(
                [np.arange(len(c.tokens), dtype=np.int64) for c in calls]))  # [S]
        if self._row_anchors:  # DSpark's chain, DFlash2's lattice: from each block's anchor
            b.bind_cpu_input("row_anchors", np.asarray(
                [a for c in calls for a in [c.tokens[0], *[-1] * len(c.rows)][:len(c.rows)]],
                dtype=np.int64))  # [R]
        head = self.built.head
        names = (["candidates", "scores"] if head.kind == "dflash2" else
                 ["logits", "confidence"] if head.has_confidence_head else ["logits"])
        for name in names:
            b.bind_output(name, "cpu")
        # the sampler's rows: one spec per row (None: the row is picked on the host)
        row_specs: list[SampleSpec | None] = [
            s for c in calls for s in (c.specs if c.specs is not None else [None] * len(c.rows))]
        if self.block_samples:
            self._bind_sampler(b, row_specs if row_specs else [None])
        t0 = time.perf_counter()
        self.sessions["block"].run_with_iobinding(b)
        per_row = (time.perf_counter() - t0) / len(ids)
        self.block_passes += 1
        out = bound_outputs(b)
        first = 2 * self.hp.n_layer  # after the caches, in the order bound
        # the logits leave the session only where the graph did not choose a block's rows
        got = {name: out[first + i].numpy() for i, name in enumerate(names)
               if name != "logits" or any(c.specs is None for c in calls)}
        sampled = (sampling_op.read(out, first + len(names), row_specs, range(len(row_specs)))
                   if any(c.specs is not None for c in calls) else None)
        results = []
        bounds = [0, *accumulate(len(c.rows) for c in calls)]  # each block's logits rows
        for c, lo, hi in zip(calls, bounds[:-1], bounds[1:], strict=True):
            mine: dict[str, Any] = {name: a[lo:hi] for name, a in got.items()}
            if c.specs is not None or "logits" not in mine:  # none left the session
                mine["logits"] = np.zeros((len(c.rows), 0), np.float32)
            if c.specs is not None:
                assert sampled is not None
                mine["sampled"] = sampled[lo:hi]
            results.append(BlockOutput(**mine, seconds=per_row * len(c.tokens)))
        return results

    def _bind_sampler(self, b: Any, specs: Sequence[SampleSpec | None] | None) -> None:
        """The sampler's inputs for one spec per row (None: the rows are skipped) and its
        outputs, on a graph that has it."""
        calls = specs if specs is not None else [None]
        sampling_op.bind(b, calls, range(len(calls)), self.hp.n_vocab,
                         self._sampler_inputs.setdefault(id(b), {}))

    def encode(self, features: np.ndarray) -> np.ndarray:
        """EAGLE-3: the g rows [n, E] of target features [n, L*E_t]."""
        (g,) = self.sessions["encode"].run(
            ["g"], {"features": np.ascontiguousarray(features, dtype=np.float32)})
        return g

    def pair(self, seq: int, tokens: Sequence[int], g: np.ndarray, pos: int) -> None:
        """EAGLE-3: write the K/V rows of the pairs (tokens[i], g[i]) [n], [n, E] at
        positions pos.. (what `step` writes for them, without computing anything else)."""
        check_call(pos, len(tokens), self.n_ctx)
        self.injections += 1
        if self.packs_pairs:
            self._write_rows("pair", seq, {"input_ids": np.asarray(tokens), "g": g}, pos)
            return
        b = self._bindings[seq]["pair"]
        b.bind_cpu_input("input_ids", np.asarray(tokens, dtype=np.int64))
        b.bind_cpu_input("g", np.ascontiguousarray(g, dtype=np.float32))
        b.bind_cpu_input("position", np.array([pos], dtype=np.int64))
        self.sessions["pair"].run_with_iobinding(b)
        self.inject_passes += 1

    def step(self, seq: int, tokens: Sequence[int], g: np.ndarray, pos: int,
             rows: Sequence[int], spec: SampleSpec | None = None) -> StepOutput:
        """EAGLE-3: run the pairs (tokens[i], g[i]) [n], [n, E] at positions pos.., writing
        their K/V rows; the logits and pre-norm hidden states of `rows` (may be empty), or
        with `spec` (one row, a graph with a sampler) the proposal chosen there instead of
        its logits."""
        return self._step_pass([StepCall(seq, tokens, g, pos, rows, spec)])[0]

    def _bind_rows(self, graph: str, calls: Sequence[BlockCall] | Sequence[StepCall],
                   packs: bool) -> tuple[Any, list[int]]:
        """Check the calls' slots and positions, run the injections they read, and bind
        their tokens one call after another, with the calls' segments where the graph
        packs them (else the lone call's position), and the rows they ask for: the
        binding and the token ids."""
        for c in calls:
            check_call(c.pos, len(c.tokens), self.n_ctx)
            if c.seq >= self.n_seq:
                raise ValueError(f"no sequence slot {c.seq} (the head has {self.n_seq})")
        self.flush_injections()
        ids: list[int] = []
        logits_rows: list[int] = []
        segments: list[tuple[int, int, int]] = []  # (slot, pos, rows) per call
        for c in calls:
            logits_rows += [len(ids) + r for r in c.rows]
            ids += c.tokens
            segments.append((c.seq, c.pos, len(c.tokens)))
        b = self._binding(graph, calls[0].seq)
        b.bind_cpu_input("input_ids", np.asarray(ids, dtype=np.int64))
        if packs:
            b.bind_cpu_input("segments", np.asarray(segments, dtype=np.int64))
        else:
            (_, pos, n), = segments
            b.bind_cpu_input("position", np.array([pos], dtype=np.int64))
            b.bind_cpu_input("attn_len", np.array([pos + n], dtype=np.int64))
        b.bind_cpu_input("logits_rows", np.asarray(logits_rows, dtype=np.int64))
        return b, ids

    def _step_pass(self, calls: Sequence[StepCall]) -> list[StepOutput]:
        """One session run over the calls' steps, one after another (several only where
        the graph packs them)."""
        for c in calls:
            if c.spec is not None and (not self.step_samples or len(c.rows) != 1):
                raise ValueError("a sample spec needs one row of a step graph with a sampler")
        b, ids = self._bind_rows("step", calls, self.packs_steps)
        g = np.concatenate([np.asarray(c.g, dtype=np.float32) for c in calls])  # [S, E]
        b.bind_cpu_input("g", np.ascontiguousarray(g))
        b.bind_output("logits", "cpu")
        b.bind_output("hidden", "cpu")
        specs = [c.spec for c in calls]
        bounds = [0, *accumulate(len(c.rows) for c in calls)]  # each step's logits rows
        if self.step_samples:
            sampling_op.bind(b, specs, bounds[:-1], self.hp.n_vocab,
                             self._sampler_inputs.setdefault(id(b), {}))
        t0 = time.perf_counter()
        self.sessions["step"].run_with_iobinding(b)
        per_row = (time.perf_counter() - t0) / len(ids)
        self.step_passes += 1
        out = bound_outputs(b)
        first = 2 * self.hp.n_layer  # after the caches, in the order bound
        # the logits leave the session only where the graph did not choose a step's row
        logits = out[first].numpy() if any(s is None for s in specs) else None  # [R, vocab]
        hidden = out[first + 1].numpy()  # [R, E]
        sampled = (sampling_op.read(out, first + 2, specs, bounds[:-1])
                   if any(s is not None for s in specs) else [None] * len(calls))
        return [StepOutput(logits[lo:hi] if c.spec is None and logits is not None
                           else np.zeros((1, 0), np.float32),
                           hidden[lo:hi], chosen, per_row * len(c.tokens))
                for c, lo, hi, chosen in zip(calls, bounds[:-1], bounds[1:], sampled,
                                             strict=True)]
