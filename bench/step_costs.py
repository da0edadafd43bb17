"""Cost of one forward pass by tokens in the call, per model: what speculation trades.

    python bench/step_costs.py [--models a,b:q4,b:q4:fused] [--sizes 1,2,3,5,9] [--repeats 15]
                               [--pos 300] [--spinning] [--profile [SIZE]]

A model is name[:requant[:attention[:kernels[:kv]]]]: `name:q4` re-quantized as drafts
are without specd's kernels, `name:q4:fused` with GroupQueryAttention,
`name::native:gguf:f16` with specd's GgufMatMul and CausalAttention over an f16 KV cache
(as the engine builds targets where they compile), `name:q4k:native:gguf:f16` as it
builds drafts there. Each is run at cache
position `--pos` (default 300, past the first 256-token bucket) and timed per call size,
interleaved across models and sizes so all see the same machine state. Prints medians in
ms and each size as a multiple of the model's single-token step. `--profile [SIZE]` adds
the kernel time per op type (ms per call, ORT's profiler) for calls of SIZE tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from specd.daemon.models.store import resolve_model
from specd.ort_models import native_ops
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

POS = 300


def op_shares(built, threads: int | None, spinning: bool, pos: int = POS,
              size: int = 1) -> dict[str, float]:
    """ms per call of each op type (ORT's profiler, kernel time) for calls of `size` tokens."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or 2
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "prof")
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if built.options.uses_native:
        native_ops.register(so)
    runner = ModelRunner(built, n_ctx=pos + 512, threads=threads, spinning=spinning)
    runner.session = ort.InferenceSession(str(built.model_path), so,
                                          providers=["CPUExecutionProvider"])
    runner._bindings = []  # rebind the cache to the profiled session
    runner.add_sequence()
    calls = 20
    for i in range(calls):
        runner.forward(0, [100 + i + t for t in range(size)], pos + i * size)
    prof = runner.session.end_profiling()
    per_op: dict[str, float] = defaultdict(float)
    for ev in json.loads(Path(prof).read_text()):
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            per_op[ev["args"]["op_name"]] += ev["dur"]
    return {k: v / calls / 1e3 for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct,"
                                        "qwen2.5-coder-0.5b-instruct:q4")
    ap.add_argument("--sizes", default="1,2,3,5,9")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--pos", type=int, default=POS, help="cache position of the timed calls")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--spinning", action="store_true")
    ap.add_argument("--profile", type=int, nargs="?", const=1, default=0, metavar="SIZE",
                    help="also print ms per op type (ORT's profiler) for calls of SIZE tokens")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runners = {}
    for m in args.models.split(","):
        name, requant, attention, kernels, kv = (m.split(":") + ["", "", "", ""])[:5]
        built = load_or_build(resolve_model(name, fetch=True),
                              BuildOptions(requant=requant, attention=attention or "exact",
                                           kernels=kernels or "ort", kv_dtype=kv or "f32"))
        runners[m] = ModelRunner(built, n_ctx=args.pos + 512, threads=args.threads,
                                 spinning=args.spinning)
        runners[m].prefill(0, [100 + i % 1000 for i in range(args.pos)])
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in range(args.repeats + 2):
        for m, runner in runners.items():
            for s in sizes:
                t0 = time.perf_counter()
                runner.forward(0, list(range(200, 200 + s)), args.pos, list(range(s)))
                if r >= 2:  # two warm-up rounds
                    times[m, s].append(time.perf_counter() - t0)
    print(f"| model | {' | '.join(f'S={s}' for s in sizes)} |")
    print(f"|---|{'---|' * len(sizes)}")
    for m in runners:
        one = statistics.median(times[m, 1]) if 1 in sizes else None
        cells = []
        for s in sizes:
            med = statistics.median(times[m, s])
            rel = f" ({med / one:.2f}×)" if one else ""
            cells.append(f"{med * 1e3:.1f} ms{rel}")
        print(f"| {m} | {' | '.join(cells)} |")
    if args.profile:
        for m, runner in runners.items():
            per_op = op_shares(runner.built, args.threads, args.spinning, args.pos, args.profile)
            print(f"{m}, S={args.profile}: {sum(per_op.values()):.1f} ms in kernels: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in list(per_op.items())[:16]))


if __name__ == "__main__":
    main()
