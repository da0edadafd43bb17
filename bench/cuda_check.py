"""What specd's graphs do on ONNX Runtime's CUDA execution provider (run on a GPU machine).

    python bench/cuda_check.py [--layers 4] [--repeats 30]

Prints, for BENCHMARKS.md:
1. the runtime specd chooses and the GPU;
2. where ORT places the target graph's nodes (CUDA or CPU fallback), from its verbose log;
3. whether a verify row equals the single step at its position bit for bit, with calls of
   their natural shape (row_block 1) and with the runner's fixed shape (CUDA_ROW_BLOCK);
4. step times of a random model shaped like Qwen2.5-Coder-1.5B's layers (n_embd 1536,
   n_ff 8960, 12 / 2 heads, Q4_K) with `--layers` layers: 1 token alone, 1 token in the
   fixed shape, and a block of CUDA_ROW_BLOCK tokens.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from specd.daemon.models.building import build_options
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.providers import choose_runtime
from specd.ort_models.runner import CUDA_ROW_BLOCK, ModelRunner

from tiny_gguf import write_tiny_gguf

DEVICE = "cuda:0"
TOKENS = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]
K_DIMS = {"n_embd": 256, "n_ff": 512}


def gpu_name() -> str:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(h)
    return name.decode() if isinstance(name, bytes) else str(name)


def placement(model_path: str) -> None:
    """Create the session with ORT's verbose log in a child; count nodes per provider."""
    code = ("import onnxruntime as ort, sys\n"
            "ort.set_default_logger_severity(0)\n"
            "so = ort.SessionOptions(); so.log_severity_level = 0\n"
            "ort.InferenceSession(sys.argv[1], so, providers=['CUDAExecutionProvider', "
            "'CPUExecutionProvider'])\n")
    proc = subprocess.run([sys.executable, "-c", code, model_path], capture_output=True,
                          text=True)
    log = proc.stdout + proc.stderr
    if os.environ.get("OUT"):  # the device tool's folder of files to bring back
        Path(os.environ["OUT"], "placement.log").write_text(log)
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"Node\(s\) placed on \[(\w+)\]\. Number of nodes: (\d+)", log)}
    print(f"  nodes per provider: {counts or 'not in the log'}")
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "placed on [CPUExecutionProvider]" in line:  # the nodes listed after it
            cpu = []
            for x in lines[i + 1:]:
                if "placed on [" in x:
                    break
                cpu.append(re.sub(r"^.*?\] ", "", x).strip().split(" ")[0])
            print(f"  on the CPU: {dict(Counter(cpu))}")
        elif "not assigned to the preferred" in line or "kernel not found" in line.lower():
            print(f"  log: {line.strip()[:240]}")


def rows_check(tmp: Path) -> None:
    rt = choose_runtime(DEVICE)
    cases = [("llama", "F32", {}), ("llama", "F16", {}), ("qwen2", "Q8_0", {}),
             ("qwen2", "Q4_0", {}), ("qwen2", "Q4_K", K_DIMS), ("llama", "Q6_K", K_DIMS),
             ("llama", "F32", {"n_head_kv": 4})]
    n = CUDA_ROW_BLOCK
    for arch, wt, kw in cases:
        path = write_tiny_gguf(tmp / f"{arch}-{wt}-{len(kw)}.gguf", arch=arch, weight_type=wt,
                               **kw)
        built = load_or_build(path, build_options("target", device=DEVICE))
        res = []
        for rb in (1, n):
            singles_r = ModelRunner(built, n_ctx=512, runtime=rt, row_block=rb)
            singles = np.stack([singles_r.forward(0, [t], i)[0] for i, t in enumerate(TOKENS)])
            block_r = ModelRunner(built, n_ctx=512, runtime=rt, row_block=rb)
            block_r.forward(0, TOKENS[:4], 0)
            block = block_r.forward(0, TOKENS[4:4 + n], 4, list(range(n)))
            diff = float(np.abs(block - singles[4:4 + n]).max())
            res.append(f"row_block {rb}: {'equal' if diff == 0 else f'differ (max {diff:.3g})'}")
        print(f"  {arch} {wt}{' mha' if kw.get('n_head_kv') == 4 else ''}: {'; '.join(res)}")


def timing(tmp: Path, layers: int, repeats: int) -> None:
    rt = choose_runtime(DEVICE)
    path = write_tiny_gguf(tmp / "mid.gguf", arch="qwen2", weight_type="Q4_K", n_layer=layers,
                           n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960, vocab_size=151936,
                           embed_type="Q8_0", output_type="Q6_K", context_length=4096)
    t0 = time.perf_counter()
    built = load_or_build(path, build_options("target", device=DEVICE))
    print(f"  {layers} layers, vocab 151936: graph built in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 300, 300).tolist()
    for label, rb, size in (("1 token, natural shape", 1, 1),
                            (f"1 token in the fixed shape ({CUDA_ROW_BLOCK} rows)",
                             CUDA_ROW_BLOCK, 1),
                            (f"{CUDA_ROW_BLOCK} tokens", CUDA_ROW_BLOCK, CUDA_ROW_BLOCK)):
        r = ModelRunner(built, n_ctx=1024, runtime=rt, row_block=rb)
        r.prefill(0, prompt)
        toks = prompt[:size]
        for _ in range(5):
            r.forward(0, toks, 300, list(range(size)))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            r.forward(0, toks, 300, list(range(size)))
            times.append(time.perf_counter() - t)
        print(f"  {label}: median {statistics.median(times) * 1e3:.2f} ms "
              f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rt = choose_runtime("auto")
    print(f"runtime: {rt.describe()}\nGPU: {gpu_name()}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = write_tiny_gguf(tmp / "place.gguf", arch="qwen2", weight_type="Q4_K", **K_DIMS)
        built = load_or_build(path, build_options("target", device=DEVICE))
        print("node placement (qwen2 Q4_K target graph):")
        placement(str(built.model_path))
        print("verify rows against single steps (block of "
              f"{CUDA_ROW_BLOCK} after 4 tokens):")
        rows_check(tmp)
        print("step times at position 300:")
        timing(tmp, args.layers, args.repeats)


if __name__ == "__main__":
    main()
