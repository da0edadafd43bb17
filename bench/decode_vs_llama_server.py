"""Decode tokens/s of specd's target graph beside llama-server's, one model, side by side.

    python bench/decode_vs_llama_server.py [--model gemma-3-270m] [--tokens 128]
                                           [--repeats 5] [-t 2]

llama-server at the build this project follows (built into the cache first if it is not) runs
the model with the same threads; each repeat times greedy decoding of --tokens tokens after
a fixed prompt on both, alternating which goes first: specd's ModelRunner one token a call
(the CPU graph `specd generate` builds, no speculation), llama-server's own
`timings.predicted_per_second` of a /completion call. Prints the medians and their ratio.
Run it on a quiet machine: llama.cpp's spinning threads collapse when anything else runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from specd.daemon.benchmark import llama_cpp
from specd.daemon.benchmark.llama_server import LlamaServer
from specd.daemon.models.building import build_options
from specd.daemon.models.store import resolve_model
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

PROMPT = "def fibonacci(n):\n"


def specd_decode(runner: ModelRunner, prompt: list[int], n: int) -> float:
    """tokens/s of n greedy steps after the prompt (prefill not timed)."""
    logits = runner.prefill(0, prompt)
    t0 = time.perf_counter()
    for i in range(n):
        logits = runner.forward(0, [int(np.argmax(logits))], len(prompt) + i)[0]
    return n / (time.perf_counter() - t0)


def server_decode(server: LlamaServer, prompt: list[int], n: int) -> float:
    out = server.post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                      "top_k": 1, "cache_prompt": False, "ignore_eos": True})
    return float(out["timings"]["predicted_per_second"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    llama_cpp.build()
    path = resolve_model(args.model, to_run=True)
    prompt = Tokenizer.from_metadata(GGUFFile(path).metadata).encode(PROMPT)
    runner = ModelRunner(load_or_build(path, build_options("target")), n_ctx=1024,
                         threads=args.threads)
    with LlamaServer(path, threads=args.threads, n_ctx=1024, args=["-np", "1"]) as server:
        specd_decode(runner, prompt, 8)  # warm both up
        server_decode(server, prompt, 8)
        ours: list[float] = []
        theirs: list[float] = []
        for i in range(args.repeats):  # alternating which goes first
            runs = [lambda: ours.append(specd_decode(runner, prompt, args.tokens)),
                    lambda: theirs.append(server_decode(server, prompt, args.tokens))]
            for run in runs if i % 2 == 0 else runs[::-1]:
                run()
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(f"{args.model}, {args.tokens} tokens, {args.threads} threads, {args.repeats} repeats")
    print(f"specd      {mo:6.1f} tok/s  (min {min(ours):.1f}, max {max(ours):.1f})")
    print(f"llama.cpp  {mt:6.1f} tok/s  (min {min(theirs):.1f}, max {max(theirs):.1f})")
    print(f"specd / llama.cpp: {mo / mt:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
