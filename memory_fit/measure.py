"""What one model costs in memory under ONNX Runtime, measured, and cached in its graph folder.

* weights: what the session holds after prepacking, the process RSS delta across session
  creation on CPU (the device's used-memory delta on CUDA). A throw-away one-node session
  is created first so that ORT's environment (and on CUDA the context) is not billed to
  the model; on CUDA that one-time cost is recorded as `runtime_bytes`.
  Weights read in place become resident when first read; a mixture of experts counts all
  of them, since the rows measured may not wake every expert and a request's may.
* KV: from the hyper-parameters, layers x kv heads x head dim x 2 (K, V) x 2 or 4 bytes
  (the graph's f16 / f32 cache) per token per sequence; the runner's buffers are
  [1, n_kv, kv_len, head_dim], where kv_len exceeds n_ctx only on CUDA, by the fixed call
  shape's filler rows (CUDA_ROW_BLOCK - 1 positions, too few to plan for).
* host (CPU only): the parsed GGUF header (GGUFFile) and the tokenizer built from it, RSS
  deltas measured last (the tokenizer's freed scratch would otherwise be reused by the
  session and hide part of its workspace); the engine keeps both for the target and the
  header for the draft.
* load overhead: the peak above the settled weights while the session is created.
* workspace: the activations and arena growth of the worst call, a full prefill chunk of
  ATTN_BUCKET tokens that attends over the whole context. It is measured at two context
  sizes A < B (chunks at positions A-256 and B-256, attn_len A and B, on one session) as
  the peak RSS above the settled "weights + KV" level (VmHWM after clear_refs on Linux, a
  sampling thread elsewhere; the device's used memory on CUDA, whose arena keeps its peak),
  and interpolated linearly: workspace(n_ctx) = base + per_ctx * n_ctx.

The measurement runs in a fresh subprocess by default (`isolate=True`): a clean process
has no freed heap to hide allocations in, and gives the memory back when it exits; it
ends with the process that started it (`die_with_parent`), killed or stopped. The
result is stored in `<graph folder>/memory_cost.json` keyed by device, ORT version and
thread count, so the second run reads it instantly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specd.ort_models.graph_builder import ATTN_BUCKET

from .rss import PeakRss, rss_bytes

if TYPE_CHECKING:
    from specd.ort_models.head_runner import BuiltHead
    from specd.ort_models.model_cache import BuiltModel

COST_FILE = "memory_cost.json"
COST_VERSION = 4
DEFAULT_POINTS_CAP = 2048  # largest context measured by default (B)


class MeasureError(RuntimeError):
    """A measurement could not be made (message for the user)."""


@dataclass(frozen=True)
class ModelCost:
    """Bytes one model needs on a device; workspace is linear in the context length."""

    weights_bytes: int
    kv_bytes_per_token: int  # per sequence, all layers, K and V
    workspace_base: int = 0  # workspace at n_ctx = 0 (intercept)
    workspace_per_ctx: float = 0.0  # extra workspace per token of context
    n_ctx_train: int = 0  # the model's trained context; 0 = unknown
    runtime_bytes: int = 0  # once per process on this device (CUDA context), not per model
    load_extra_bytes: int = 0  # transient above weights_bytes while the session is created
    metadata_bytes: int = 0  # host RAM of the parsed GGUF header the engine keeps
    tokenizer_bytes: int = 0  # host RAM of its tokenizer (built for the target only)
    name: str = ""
    points: tuple[tuple[int, int], ...] = ()  # measured (n_ctx, workspace bytes)
    # sliding-window layers whose cache is a ring of this many rows (0: none), and their
    # share of kv_bytes_per_token: they hold min(n_ctx, ring) rows, not n_ctx
    kv_ring_rows: int = 0
    kv_ring_bytes_per_row: int = 0

    def workspace_bytes_at(self, n_ctx: int) -> int:
        return max(0, round(self.workspace_base + self.workspace_per_ctx * n_ctx))

    def kv_bytes(self, n_ctx: int, slots: int) -> int:
        ring = self.kv_ring_bytes_per_row * min(n_ctx, self.kv_ring_rows)
        return ((self.kv_bytes_per_token - self.kv_ring_bytes_per_row) * n_ctx + ring) * slots

    @classmethod
    def from_points(cls, weights_bytes: int, kv_bytes_per_token: int,
                    points: Sequence[tuple[int, int]], **kw: Any) -> ModelCost:
        """Linear workspace through measured (n_ctx, bytes) points (slope >= 0, and never
        below any measured point)."""
        pts = sorted((int(n), int(b)) for n, b in points)
        if not pts:
            raise ValueError("need at least one workspace point")
        (a, wa), (b, wb) = pts[0], pts[-1]
        slope = max(0.0, (wb - wa) / (b - a)) if b > a else 0.0
        base = max(w - slope * n for n, w in pts)
        return cls(weights_bytes, kv_bytes_per_token, round(base), slope,
                   points=tuple(pts), **kw)

    def beside(self, other: ModelCost) -> ModelCost:
        """The cost of this model and `other` loaded together at the same context and
        sequences (a head beside a draft model): bytes add up, one loads after the other,
        the shorter trained context bounds both. At most one may have a ring cache."""
        if self.kv_ring_rows and other.kv_ring_rows:
            raise ValueError(f"{self.name} and {other.name} both have sliding-window "
                             "caches: their sum is not one ring")
        ring = self if self.kv_ring_rows else other
        trained = [c.n_ctx_train for c in (self, other) if c.n_ctx_train]
        return ModelCost(
            self.weights_bytes + other.weights_bytes,
            self.kv_bytes_per_token + other.kv_bytes_per_token,
            self.workspace_base + other.workspace_base,
            self.workspace_per_ctx + other.workspace_per_ctx,
            n_ctx_train=min(trained) if trained else 0,
            runtime_bytes=max(self.runtime_bytes, other.runtime_bytes),
            load_extra_bytes=max(self.load_extra_bytes, other.load_extra_bytes),
            metadata_bytes=self.metadata_bytes + other.metadata_bytes,
            tokenizer_bytes=self.tokenizer_bytes + other.tokenizer_bytes,
            name=f"{self.name} + {other.name}", kv_ring_rows=ring.kv_ring_rows,
            kv_ring_bytes_per_row=ring.kv_ring_bytes_per_row)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["points"] = [list(p) for p in self.points]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelCost:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["points"] = tuple(tuple(p) for p in kw.get("points", ()))
        return cls(**kw)


# --------------------------------------------------------------------------- cache

def _ort_version() -> str:
    from importlib import metadata

    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            return f"{name}-{metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "onnxruntime-unknown"


def cache_key(device: str, threads: int) -> str:
    return f"{device}|{_ort_version()}|t{threads}"


def _read_cache(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / COST_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != COST_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_cache(folder: Path, key: str, cost: ModelCost) -> None:
    entries = _read_cache(folder)
    entries[key] = cost.as_dict()
    tmp = folder / f"{COST_FILE}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"version": COST_VERSION, "entries": entries}, indent=1))
        os.replace(tmp, folder / COST_FILE)
    except OSError:  # a read-only cache only costs a re-measure next time
        tmp.unlink(missing_ok=True)


def cached_cost(folder: Path, device: str, threads: int) -> ModelCost | None:
    entry = _read_cache(folder).get(cache_key(device, threads))
    try:
        return ModelCost.from_dict(entry) if entry else None
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- measuring

def default_points(n_ctx_train: int, cap: int = DEFAULT_POINTS_CAP) -> tuple[int, ...]:
    """Context sizes (multiples of ATTN_BUCKET) to measure at: two, A < B <= trained, or
    one where the trained context holds a single bucket."""
    top = max(ATTN_BUCKET, n_ctx_train // ATTN_BUCKET * ATTN_BUCKET)
    b = min(cap, top)
    if b < 2 * ATTN_BUCKET:
        return (b,)
    a = max(ATTN_BUCKET, b // 4 // ATTN_BUCKET * ATTN_BUCKET)
    return a, b


def measure(built: BuiltModel, device: str = "cpu", *, threads: int | None = None,
            use_cache: bool = True, isolate: bool = True,
            points: tuple[int, ...] | None = None) -> ModelCost:
    """The ModelCost of a BuiltModel on `device` ("cpu" / "cuda:N"), cached per folder."""
    from specd.ort_models.runner import default_threads

    threads = threads or default_threads()
    folder = Path(built.folder)
    key_device = _canonical_device(device)
    if use_cache:
        hit = cached_cost(folder, key_device, threads)
        if hit is not None:  # measured for the same content, maybe under another name
            return dataclasses.replace(hit, name=Path(str(built.gguf_path)).stem)
    pts = points or default_points(built.hparams.n_ctx_train)
    if isolate:
        cost = _measure_subprocess(folder, key_device, threads, pts, Path(built.gguf_path))
    else:
        cost = measure_in_process(built, key_device, threads, pts)
    _write_cache(folder, cache_key(key_device, threads), cost)
    return cost


def _canonical_device(device: str) -> str:
    from .probes import parse_device

    kind, index = parse_device(device)
    return "cpu" if kind == "cpu" else f"cuda:{index}"


MEASURE_TIMEOUT_S = 1800.0  # generous: it stops a hung child, not a slow one


def _measure_subprocess(folder: Path, device: str, threads: int, points: tuple[int, ...],
                        gguf: Path) -> ModelCost:
    cmd = [sys.executable, "-m", "specd.memory_fit.measure", str(folder), "--device", device,
           "--threads", str(threads), "--points", ",".join(map(str, points)),
           "--gguf", str(gguf), "--parent", str(os.getpid())]
    what = f"measuring {gguf.name} ({folder.name}) on {device}"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise MeasureError(f"{what} did not finish within {MEASURE_TIMEOUT_S:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode < 0:  # killed: the out-of-memory killer sends SIGKILL
        sig = -proc.returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        raise MeasureError(f"{what} failed: the measuring process was killed by {name}{hint}")
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MeasureError(f"{what} failed: {err}")
    return ModelCost.from_dict(json.loads(lines[-1]))


def head_cost(built: BuiltHead, target_graph: Path | None = None) -> ModelCost:
    """What a drafter head needs: its graphs' weights as written, less the arrays its
    sessions share with the target graph's (`target_graph`: the engine gives both sessions
    one copy, ort_models/shared_initializers.py), and, per token, its KV cache (float32)
    and for EAGLE-3 the g row the drafter keeps of every position. Its workspace is not
    measured: a pass holds a few rows of activations and their logits."""
    from specd.ort_models.shared_initializers import target_copies

    weights = sum((built.folder / f"{name}.bin").stat().st_size for name in built.graphs)
    if target_graph is not None:
        weights -= sum(c.tensor.length for c in target_copies(
            [(g, built.model_path(g)) for g in built.graphs], target_graph))
    per_token = built.hparams.kv_bytes_per_token(4)
    if built.head.kind == "eagle3":
        per_token += 4 * built.head.n_embd
    return ModelCost(weights_bytes=weights, kv_bytes_per_token=per_token,
                     n_ctx_train=built.target.n_ctx_train, name=built.head_path.name)


def built_from_folder(folder: str | os.PathLike[str]) -> BuiltModel:
    """A BuiltModel from a graph folder's meta.json (no GGUF parsing, no hashing)."""
    from specd.ort_models.arch import HParams
    from specd.ort_models.graph_builder import BuildOptions
    from specd.ort_models.model_cache import META_FILE, BuiltModel

    folder = Path(folder)
    meta = json.loads((folder / META_FILE).read_text())
    opts = dict(meta["options"])
    opts["hidden_layers"] = tuple(opts.get("hidden_layers", ()))
    # a field an earlier specd of this builder version wrote and this one dropped
    known = {f.name for f in dataclasses.fields(HParams)}
    hparams = HParams(**{k: v for k, v in meta["hparams"].items() if k in known})
    return BuiltModel(folder, hparams, BuildOptions(**opts), Path(meta["gguf"]), "")


class _DeviceUsed:
    """Memory in use on a device: process RSS on CPU, NVML used on CUDA."""

    def __init__(self, device: str):
        self.device = device
        self._probe = None
        if device != "cpu":
            from .probes import CudaProbe, parse_device

            self._probe = CudaProbe(parse_device(device)[1])

    def now(self) -> int:
        if self._probe is None:
            return rss_bytes()
        return self._probe.read().used_bytes

    def peak_of(self, fn: Callable[[], object]) -> int:
        """Run fn(); the peak in use during it (CUDA: after it, the arena keeps its peak)."""
        if self._probe is not None:
            fn()
            return self.now()
        with PeakRss() as p:
            fn()
        return p.peak


def _warm_runtime(device: str, threads: int) -> None:
    """Create ORT's environment (and a CUDA context) with a one-node session."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specd.ort_models.providers import session_providers

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])],
                                                "warm", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=session_providers(device))
    sess.run(None, {"x": np.zeros(1, np.float32)})


def measure_in_process(built: BuiltModel, device: str, threads: int,
                       points: tuple[int, ...]) -> ModelCost:
    """Measure in this process (best in a fresh one: see `measure(isolate=True)`)."""
    import gc

    import numpy as np

    from specd.ort_models.providers import choose_runtime
    from specd.ort_models.runner import ModelRunner, ring_rows

    hp = built.hparams
    ctxs = sorted(points)
    if (not 1 <= len(ctxs) <= 2 or len(set(ctxs)) != len(ctxs) or ctxs[0] < ATTN_BUCKET
            or any(c % ATTN_BUCKET for c in ctxs)):
        raise MeasureError(f"bad measuring points {points}: one or two distinct multiples "
                           f"of {ATTN_BUCKET}")
    b = ctxs[-1]
    used = _DeviceUsed(device)
    before_env = used.now()
    _warm_runtime(device, threads)
    gc.collect()
    r0 = used.now()
    runtime = choose_runtime(device)
    box: list[ModelRunner] = []
    load_peak = used.peak_of(lambda: box.append(
        ModelRunner(built, n_ctx=b, n_seq=0, threads=threads, runtime=runtime)))
    runner = box[0]
    gc.collect()
    r1 = used.now()
    runner.add_sequence()  # KV for n_ctx = b
    r2 = used.now()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, hp.n_vocab, ATTN_BUCKET).tolist()  # one full chunk [256]
    # the first chunk a session runs grows its arenas once, whatever the context: run one
    # first, so the points differ by their context alone and the slope does not carry that
    # growth out to the trained context
    used.peak_of(lambda: runner.forward(0, tokens, 0))
    # weights a session maps from weights.bin rather than copies (specd's kernels read
    # their initializers in place) become resident in that first run, not at load: count
    # them as weights, not as workspace (the total is the same either way)
    touched = lazy = 0
    if device == "cpu":
        unread = max(0, built.weights_bytes - (r1 - r0))
        touched = min(unread, max(0, used.now() - r2))
        # a mixture of experts reads an expert only when a row wakes it, and over a
        # request's rows every expert may be: all of them count, woken by this chunk or not
        lazy = unread if hp.moe is not None else touched
    pts = []
    for ctx in ctxs:
        # the chunk at positions ctx-256 .. ctx-1 attends over ctx keys (attn_len = ctx)
        peak = used.peak_of(partial(runner.forward, 0, tokens, ctx - ATTN_BUCKET))
        pts.append((ctx, max(0, peak - r2 - touched)))
    # last, so the session and its runs see a heap without freed blocks to reuse
    host = _HostCost(Path(built.gguf_path)) if device == "cpu" else None  # RAM = the device
    ring = ring_rows(hp, built.options, runner.max_call_rows)
    ring_layers = sum(hp.is_swa(i) for i in range(hp.n_layer)) if ring else 0
    per_token = hp.kv_bytes_per_token(built.options.kv_bytes)
    return ModelCost.from_points(
        max(0, r1 - r0) + lazy, per_token, pts,
        n_ctx_train=hp.n_ctx_train, kv_ring_rows=ring,
        kv_ring_bytes_per_row=per_token // hp.n_layer * ring_layers,
        runtime_bytes=max(0, r0 - before_env) if device != "cpu" else 0,
        load_extra_bytes=max(0, load_peak - r1) if device == "cpu" else 0,
        metadata_bytes=host.metadata_bytes if host else 0,
        tokenizer_bytes=host.tokenizer_bytes if host else 0,
        name=Path(str(built.gguf_path)).stem)


class _HostCost:
    """RSS of what the engine keeps per model besides the session: the parsed GGUF header
    and the tokenizer built from it (kept alive here, so later deltas do not reuse it)."""

    def __init__(self, gguf: Path):
        self.metadata_bytes = self.tokenizer_bytes = 0
        self._keep: list[object] = []
        if not gguf.is_file():  # graph folder built from a file since moved: no host part
            return
        from specd.ort_models.gguf_file import GGUFFile

        r = rss_bytes()
        f = GGUFFile(gguf)
        self._keep.append(f)
        self.metadata_bytes = max(0, rss_bytes() - r)
        try:
            from specd.daemon.text.tokenizer import Tokenizer

            r = rss_bytes()
            self._keep.append(Tokenizer.from_metadata(f.metadata))
            self.tokenizer_bytes = max(0, rss_bytes() - r)
        except Exception:  # no usable tokenizer: nothing to count
            pass


def die_with_parent(parent: int) -> None:
    """End this process when process `parent` (the one that started it) ends, however it
    ends: a measuring child of a killed or stopped `specd serve` would otherwise hold the
    model's memory (1.3 GB for the 1.5B target) until it finished. On Linux the kernel
    sends SIGKILL (PR_SET_PDEATHSIG); elsewhere a thread watches the parent."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # it ended before the request was made
        os._exit(1)
    if not sys.platform.startswith("linux"):
        import threading
        import time

        import psutil

        def watch() -> None:
            while psutil.pid_exists(parent):
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="measure one built graph's memory (JSON out)")
    ap.add_argument("folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--points", default="")
    ap.add_argument("--gguf", default="", help="the GGUF file (default: meta.json's)")
    ap.add_argument("--parent", type=int, default=0,
                    help="end when this process ends (the one measuring)")
    args = ap.parse_args(argv)
    if args.parent:
        die_with_parent(args.parent)
    built = built_from_folder(args.folder)
    if args.gguf:
        built = dataclasses.replace(built, gguf_path=Path(args.gguf))
    pts = (tuple(int(x) for x in args.points.split(",")) if args.points
           else default_points(built.hparams.n_ctx_train))
    from specd.ort_models.runner import default_threads

    cost = measure_in_process(built, args.device, args.threads or default_threads(), pts)
    print(json.dumps(cost.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
