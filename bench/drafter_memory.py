"""Resident memory of a drafter beside the target, measured: each configuration in a
process of its own loads the target (and the drafter), generates 64 tokens, and reports
its RSS and USS; a drafter's cost is its process's RSS less target-only's.

    python bench/drafter_memory.py [--drafters DRAFT,HEAD] [-c 2048]

`specd fit` plans with file sizes; this is what the pages touched come to (weights mapped
from graph files are resident only where read).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from specd.daemon.models.catalog import DEFAULT_DRAFT, DEFAULT_HEAD, DEFAULT_TARGET

PROMPT = "Write a short story about a lighthouse keeper."


def measure(target: str, draft: str | None, n_ctx: int) -> None:
    import psutil

    from specd.daemon.serving.engine import Engine, EngineConfig
    from specd.daemon.spec.generation import Generation, GenerationParams

    engine = Engine(EngineConfig(target=target, draft=draft, n_ctx=n_ctx, threads=2))
    gen = Generation(engine.target.runner, 0, engine.encode_prompt(PROMPT, chat=True),
                     GenerationParams(max_tokens=64, ignore_eos=True), eog=engine.eog_ids,
                     drafter=engine.drafter)
    gen.prefill()
    while not gen.done:
        gen.step()
    mem = psutil.Process().memory_full_info()
    print(json.dumps({"rss": mem.rss, "uss": mem.uss}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=DEFAULT_TARGET)
    ap.add_argument("--drafters", default=f"{DEFAULT_DRAFT},{DEFAULT_HEAD}")
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's drafter
    args = ap.parse_args()
    if args.one is not None:
        measure(args.model, args.one or None, args.ctx_size)
        return 0
    rows = {}
    for drafter in ["", *args.drafters.split(",")]:
        out = subprocess.run([sys.executable, __file__, "-m", args.model, "-c",
                              str(args.ctx_size), "--one", drafter], capture_output=True,
                             text=True, check=True).stdout
        rows[drafter or "target-only"] = json.loads(out.strip().splitlines()[-1])
    base = rows["target-only"]["rss"]
    for name, r in rows.items():
        extra = "" if name == "target-only" else f", drafter {(r['rss'] - base) / 2**20:.0f} MiB"
        print(f"{name:32s} RSS {r['rss'] / 2**20:6.0f} MiB, USS {r['uss'] / 2**20:6.0f} MiB{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
