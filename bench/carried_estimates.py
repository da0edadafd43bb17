"""Requests that start from the last one's draft-policy estimates, against fresh ones, in
one run: decode speed of short and long requests, as an editor's completions and a chat's
replies are, for the draft model and for the head beside it.

A fresh adaptive policy spends a request's first rounds measuring: a plain step, then
probes of each model source for its costs, then probes while its acceptance is thin. An
engine's requests start from the last finished one's estimates instead
(`PolicyMemory`, `AdaptiveDraftLength.carry_from`); `specd generate`'s one request starts
fresh. Each (prompt, length, temperature) runs both ways back to back, fresh first, and
the carried run's memory holds the request before it (the previous workload's, as a
daemon's would).

    python bench/carried_estimates.py [-n 32,128] [--repeats 3] [--no-head]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specd.daemon.benchmark.run import PROMPTS, RunResult, SpecdRunner, parse_config
from specd.daemon.models.catalog import DEFAULT_DRAFT, DEFAULT_HEAD, DEFAULT_TARGET
from specd.daemon.models.store import ProgressBar
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.policy import PolicyMemory
from specd.ort_models.runner import default_threads

MODES = ("fresh", "carried")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--no-head", action="store_true", help="the draft model only")
    ap.add_argument("--prompts", default="code,refactor,prose")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("-n", "--max-tokens", default="32,128",
                    help="request lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="bench/results/carried_estimates.json")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    temps = [float(t) for t in args.temperatures.split(",")]
    lengths = [int(n) for n in args.max_tokens.split(",")]
    engines = {"draft model": Engine(EngineConfig(target=args.model, draft=args.draft,
                                                  threads=threads), progress=ProgressBar())}
    if not args.no_head:
        engines["head+draft"] = Engine(EngineConfig(
            target=args.model, draft=args.head, also_draft=args.draft, threads=threads),
            progress=ProgressBar())
    encoded = {k: engines["draft model"].encode_prompt(PROMPTS[k], chat=True)
               for k in args.prompts.split(",")}
    runs: dict[tuple[str, str, str], list[RunResult]] = {}
    for name, engine in engines.items():
        runner = SpecdRunner(engine)
        cfg = parse_config(f"{engine.spec_type} adaptive" if engine.head is not None
                           else "draft+ngram adaptive")
        memory = PolicyMemory()
        runner.run(encoded["code"], cfg, 0.0, 32, args.seed, memory)  # warm-up, untimed
        for rep in range(args.repeats):
            for pname, ids in encoded.items():
                for n in lengths:
                    for temp in temps:
                        work = f"{pname} n={n} T {temp:g}"
                        for mode in MODES:
                            r = runner.run(ids, cfg, temp, n, args.seed,
                                           memory if mode == "carried" else None)
                            runs.setdefault((name, work, mode), []).append(r)
                            print(f"[{rep + 1}/{args.repeats}] {name:11s} {work:22s} "
                                  f"{mode:7s} {r.decode_tps:6.2f} tok/s  accept-len "
                                  f"{r.mean_acceptance_length:.2f}", file=sys.stderr,
                                  flush=True)
    cells = {f"{name} | {work}": {mode: {
        "decode_tps": round(statistics.median(r.decode_tps for r in runs[name, work, mode]), 2),
        "acceptance_length": round(statistics.median(
            r.mean_acceptance_length for r in runs[name, work, mode]), 2)} for mode in MODES}
        for name, work, _ in runs}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "target": args.model, "when": when, "commit": commit, "threads": threads,
        "machine": platform.processor() or platform.machine(), "repeats": args.repeats,
        "cells": cells}, indent=1))
    print(f"\n{args.model}: decode tok/s (mean acceptance length), medians of {args.repeats};"
          f" {when}, commit {commit}")
    print("| drafter | workload | fresh | carried | carried / fresh |")
    print("|---|---|---|---|---|")
    ratios = []
    for key, row in cells.items():
        name, work = key.split(" | ")
        ratio = row["carried"]["decode_tps"] / row["fresh"]["decode_tps"]
        ratios.append(ratio)
        print(f"| {name} | {work} | " + " | ".join(
            f"{row[m]['decode_tps']:.1f} ({row[m]['acceptance_length']:.2f})" for m in MODES)
            + f" | {ratio:.2f}× |")
    print(f"geometric mean carried / fresh: {statistics.geometric_mean(ratios):.3f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
