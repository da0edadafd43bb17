"""Seeded requests against unseeded ones, in one run: decode speed and acceptance length
of the same prompts at a sampling temperature, with the draft model.

A seeded request's drafts are coupled to the target's draws (spec/coupling.py): its text
is target-only decoding's for the seed whatever is drafted. Unseeded requests are verified
by rejection sampling, which accepts more. The third mode, seeded with rejection sampling
(`coupled=False`), is what a seeded request would accept if its draft lengths were fixed
by evidence rather than clocks (route (a)): rejection sampling's acceptance, with the
tokens depending on the lengths chosen. Modes alternate per prompt and repeat.

    python bench/seeded_speed.py [-n 128] [--repeats 2] [-T 0.8]
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
from specd.daemon.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.daemon.models.store import ProgressBar
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.ort_models.runner import default_threads

# (name, seed, coupled)
MODES: tuple[tuple[str, int | None, bool | None], ...] = (
    ("unseeded", None, None), ("seeded, coupled", 1234, None),
    ("seeded, rejection", 1234, False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--prompts", default="code,refactor,prose")
    ap.add_argument("-T", "--temperature", type=float, default=0.8)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results/seeded_speed.json")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    engine = Engine(EngineConfig(target=args.model, draft=args.draft, threads=threads),
                    progress=ProgressBar())
    runner = SpecdRunner(engine)
    cfg = parse_config("draft+ngram adaptive")
    encoded = {k: engine.encode_prompt(PROMPTS[k], chat=True) for k in args.prompts.split(",")}
    runner.run(encoded["code"], cfg, args.temperature, 32, None)  # warm-up, untimed
    runs: dict[tuple[str, str], list[RunResult]] = {}
    for rep in range(args.repeats):
        for pname, ids in encoded.items():
            for mode, seed, coupled in MODES:
                r = runner.run(ids, cfg, args.temperature, args.max_tokens, seed,
                               coupled=coupled)
                runs.setdefault((pname, mode), []).append(r)
                print(f"[{rep + 1}/{args.repeats}] {pname:9s} {mode:18s} "
                      f"{r.decode_tps:6.2f} tok/s  accept-len {r.mean_acceptance_length:.2f}",
                      file=sys.stderr, flush=True)
    cells = {f"{p} | {m}": {
        "decode_tps": round(statistics.median(r.decode_tps for r in rs), 2),
        "acceptance_length": round(statistics.mean(r.mean_acceptance_length for r in rs), 2)}
        for (p, m), rs in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "target": args.model, "draft": args.draft, "when": when, "commit": commit,
        "threads": threads, "temperature": args.temperature, "max_tokens": args.max_tokens,
        "machine": platform.processor() or platform.machine(), "repeats": args.repeats,
        "cells": cells}, indent=1))
    names = [m for m, _, _ in MODES]
    print(f"\n{args.model} + {args.draft}, T {args.temperature:g}, {args.max_tokens} tokens: "
          f"decode tok/s (mean acceptance length), medians of {args.repeats}; {when}, "
          f"commit {commit}")
    print("| prompt | " + " | ".join(names) + " | coupled / unseeded |")
    print("|---" * (len(names) + 2) + "|")
    ratios = []
    for pname in encoded:
        row = [cells[f"{pname} | {m}"] for m in names]
        ratio = row[1]["decode_tps"] / row[0]["decode_tps"]
        ratios.append(ratio)
        print(f"| {pname} | " + " | ".join(
            f"{c['decode_tps']:.1f} ({c['acceptance_length']:.2f})" for c in row)
            + f" | {ratio:.2f}× |")
    print(f"geometric mean coupled / unseeded: {statistics.geometric_mean(ratios):.3f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
