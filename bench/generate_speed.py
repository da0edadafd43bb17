"""Prefill and decode tokens/s of `specd generate` per model, beside the bandwidth bound.

    python bench/generate_speed.py [--models a,b] [--tokens 256] [--repeats 3]

Runs the real CLI (`specd generate --json`) for each model, interleaved over repeats,
and prints a markdown table with medians; the bound is measured read bandwidth over the
weight bytes read per token (everything but the token-embedding table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from specd.daemon.benchmark.run import measure_bandwidth
from specd.daemon.models.store import resolve_model
from specd.ort_models.gguf_file import GGUFFile

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def run_once(model: str, tokens: int, threads: int | None) -> dict:
    cmd = [sys.executable, "-m", "specd.daemon.cli", "generate", "-m", model, "--chat", PROMPT,
           "-n", str(tokens), "--ignore-eos", "--json"]
    if threads:
        cmd += ["-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stderr.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,"
                                        "qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    models = args.models.split(",")
    bw = measure_bandwidth()
    runs: dict[str, list[dict]] = {m: [] for m in models}
    for m in models:  # build graphs / warm up outside the timed runs
        run_once(m, 8, args.threads)
    for _ in range(args.repeats):
        for m in models:
            runs[m].append(run_once(m, args.tokens, args.threads))
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s\n")
    print("| model | prefill tok/s | decode tok/s (min–max) | weight MB/token | bound tok/s "
          "| fraction of bound |")
    print("|---|---|---|---|---|---|")
    for m in models:
        dec = [r["decode_tps"] for r in runs[m]]
        pre = statistics.median(r["prefill_tps"] for r in runs[m])
        wb = GGUFFile(resolve_model(m)).bytes_read_per_token()
        bound = bw / wb
        med = statistics.median(dec)
        print(f"| {m} | {pre:.1f} | {med:.1f} ({min(dec):.1f}–{max(dec):.1f}) | "
              f"{wb / 1e6:.0f} | {bound:.1f} | {med / bound:.2f} |")


if __name__ == "__main__":
    main()
