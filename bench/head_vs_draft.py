"""A drafter head against the draft model, for one target, in one run: decode speed and mean
acceptance length of target-only decoding, the draft model (`-md DRAFT`: draft+ngram,
adaptive), the head (`-md HEAD`: the head's type with prompt lookup in front, adaptive)
and both (`-md HEAD -md DRAFT`: head+draft, each round drafting with one, adaptive), on
`specd bench`'s code, refactoring and prose prompts at each temperature;
with `--peer`, llama-server at the build specd follows on the same files (target-only and
the draft model tuned; `--peer-head` adds the head, with llama.cpp's defaults and drafting
its whole block: llama.cpp b11434 runs heads on llama and qwen3 targets, and aborts on a
qwen2 one such as Qwen2.5-Coder, whose graph does not output the layers a head reads).

    python bench/head_vs_draft.py [--head qwen2.5-coder-1.5b-dflash] [--repeats 2]
                                  [-n 128] [--peer [--peer-head]] [--write-choice]

Three engines share the process: the target with the draft model, with the head (its
graph also outputs the layers the head reads), and with both. Each repeat runs every
configuration back to back per (prompt, temperature), so each sees the same machine
state. Memory: what `specd fit` plans for the draft model, the head and both beside the
target at the same context (weights as built, KV cache, workspace, host-side metadata).
`--write-choice` writes each drafter's decode speed as a multiple of target-only per
workload into `daemon/models/packaged/speculation.json`, from which specd chooses a
catalog target's drafter when `-md` is left out (`daemon/models/default_drafter.py`).
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

from specd.daemon.benchmark.peer import DRAFT_MODES, HEAD_MODES, LlamaServerPeer
from specd.daemon.benchmark.run import PROMPTS, BenchConfig, RunResult, SpecdRunner, parse_config
from specd.daemon.models.building import fit_models
from specd.daemon.models.catalog import DEFAULT_DRAFT, DEFAULT_HEAD, DEFAULT_TARGET
from specd.daemon.models.default_drafter import CHOICE_FILE
from specd.daemon.models.store import ProgressBar, packaged_dir
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.ort_models.runner import default_threads

PEER_MODES = ("target-only", DRAFT_MODES[1])  # the draft model tuned


def _engines(args: argparse.Namespace, threads: int) -> tuple[Engine, Engine, Engine]:
    def engine(draft: str, also: str | None = None) -> Engine:
        return Engine(EngineConfig(target=args.model, draft=draft, also_draft=also,
                                   n_ctx=args.n_ctx, threads=threads), progress=ProgressBar())
    return engine(args.draft), engine(args.head), engine(args.head, args.draft)


def _configs(with_draft: Engine, with_head: Engine, with_both: Engine
             ) -> dict[str, tuple[Engine, BenchConfig]]:
    """Configuration name → (the engine it runs on, what it runs)."""
    return {
        "target-only": (with_draft, parse_config("target-only")),
        "draft model": (with_draft, parse_config("draft+ngram adaptive")),
        "head": (with_head, parse_config(f"{with_head.spec_type} adaptive")),
        "both": (with_both, parse_config(f"{with_both.spec_type} adaptive")),
    }


def _planned_bytes(args: argparse.Namespace, drafter: str, threads: int,
                   also: str | None = None) -> int:
    """The memory `specd fit` plans for `drafter` (and `also`) beside the target at
    --ctx-size."""
    plan, _ = fit_models(args.model, drafter, also_draft=also, max_ctx=args.n_ctx,
                         min_ctx=args.n_ctx, threads=threads, fetch=False)
    row = next(r for r in plan.as_dict()["models"] if r["role"] == "draft")
    return int(row["total_bytes"])


def _median(runs: list[RunResult], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def _workload(prompt: str, temp: float) -> str:
    return f"{prompt} T {temp:g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--prompts", default="code,refactor,prose")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--peer", action="store_true", help="also run llama-server")
    ap.add_argument("--peer-head", action="store_true",
                    help="also run llama-server with the head (implies --peer)")
    ap.add_argument("--out", default="bench/results/head_vs_draft.json")
    ap.add_argument("--write-choice", action="store_true",
                    help=f"write the speedups to the packaged {CHOICE_FILE}")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    temps = tuple(float(t) for t in args.temperatures.split(","))
    prompts = {k: PROMPTS[k] for k in args.prompts.split(",")}
    with_draft, with_head, with_both = _engines(args, threads)
    configs = _configs(with_draft, with_head, with_both)
    runners = {e: SpecdRunner(e) for e in (with_draft, with_head, with_both)}
    encoded = {k: with_draft.encode_prompt(v, chat=True) for k, v in prompts.items()}
    peer = None
    peer_modes = PEER_MODES + (HEAD_MODES if args.peer_head else ())
    if args.peer or args.peer_head:
        assert with_draft.draft is not None and with_head.head is not None
        peer = LlamaServerPeer(with_draft.target.path, threads, args.n_ctx,
                               draft_path=with_draft.draft.path,
                               head_path=with_head.head.built.head_path)
    names = list(configs) + ([f"llama.cpp {m}" for m in peer_modes] if peer else [])

    def run_one(name: str, ids: list[int], temp: float) -> RunResult:
        if name.startswith("llama.cpp "):
            assert peer is not None
            return peer.run(ids, name.removeprefix("llama.cpp "), temp, args.max_tokens,
                            args.seed)
        engine, cfg = configs[name]
        return runners[engine].run(ids, cfg, temp, args.max_tokens, args.seed)

    runs: dict[tuple[str, str], list[RunResult]] = {}
    try:
        longest = max(encoded.values(), key=len)
        for name in names:  # untimed: first-run allocations, graph warm-up
            run_one(name, longest, temps[0])
        for rep in range(args.repeats):
            for pname, ids in encoded.items():
                for temp in temps:
                    for name in names:
                        r = run_one(name, ids, temp)
                        runs.setdefault((_workload(pname, temp), name), []).append(r)
                        print(f"[{rep + 1}/{args.repeats}] {pname:8s} T={temp:g} {name:40s} "
                              f"{r.decode_tps:6.2f} tok/s  accept-len "
                              f"{r.mean_acceptance_length:.2f}", file=sys.stderr, flush=True)
    finally:
        if peer is not None:
            peer.close()

    workloads = list(dict.fromkeys(w for w, _ in runs))
    table = {w: {n: {"decode_tps": round(_median(runs[w, n], "decode_tps"), 2),
                     "acceptance_length": round(_median(runs[w, n], "mean_acceptance_length"),
                                                2)}
                 for n in names} for w in workloads}
    memory = {"draft model": _planned_bytes(args, args.draft, threads),
              "head": _planned_bytes(args, args.head, threads),
              "both": _planned_bytes(args, args.head, threads, args.draft)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = {"target": args.model, "draft": args.draft, "head": args.head,
              "when": when, "commit": commit, "machine": platform.processor() or
              platform.machine(), "threads": threads, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "cells": table, "resident_bytes": memory}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))

    print(f"\n{args.model}: decode tok/s (mean acceptance length), medians of "
          f"{args.repeats}; {when}, commit {commit}")
    print("| workload | " + " | ".join(names) + " | head / draft model | both / draft model |")
    print("|---" * (len(names) + 3) + "|")
    for w in workloads:
        row = table[w]
        ratios = [row[n]["decode_tps"] / row["draft model"]["decode_tps"]
                  for n in ("head", "both")]
        print(f"| {w} | " + " | ".join(f"{row[n]['decode_tps']:.1f} "
                                        f"({row[n]['acceptance_length']:.2f})" for n in names)
              + "".join(f" | {r:.2f}×" for r in ratios) + " |")
    print(f"resident: draft model {memory['draft model'] / 1e6:.0f} MB, head "
          f"{memory['head'] / 1e6:.0f} MB ({memory['head'] / memory['draft model']:.0%} of "
          f"the draft model's), both {memory['both'] / 1e6:.0f} MB, planned by specd fit "
          f"with KV caches at n_ctx {args.n_ctx}")

    if args.write_choice:
        path = packaged_dir() / CHOICE_FILE
        choices = json.loads(path.read_text()) if path.is_file() else {}
        base = {w: table[w]["target-only"]["decode_tps"] for w in workloads}
        choices[args.model] = {
            "measured": f"bench/head_vs_draft.py, {when}, commit {commit}, {threads} threads",
            "workloads": workloads,
            "speedup": {drafter: {w: round(table[w][name]["decode_tps"] / base[w], 3)
                                  for w in workloads}
                        for drafter, name in ((args.draft, "draft model"),
                                              (args.head, "head"),
                                              (f"{args.head}+{args.draft}", "both"))}}
        path.write_text(json.dumps(choices, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
