"""Concurrent streams through the scheduler in one process, target-only and `-md`
alternating batch by batch: what drafting costs or brings at each concurrency without
HTTP, with both engines loaded side by side so that drift of the machine hits both.

    python bench/scheduler_streams.py [--streams 2 4 8] [--tokens 128] [--repeats 2]

For each N, N requests (parallel_streams.py's prompts, greedy, `ignore_eos`) are
submitted at once to a Scheduler of 8 slots; the rate is every stream's tokens over the
time to the last one's end. Each N runs once per repeat per engine, the engines in turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.scheduler import Request, Scheduler
from specd.daemon.spec.generation import GenerationParams

sys.path.insert(0, str(Path(__file__).parent))
from parallel_streams import ALL_PROMPTS, DRAFT, N_CTX, TARGET


def batch(scheduler: Scheduler, engine: Engine, n: int, tokens: int) -> float:
    """Tokens per second of n streams submitted at once."""
    done = threading.Semaphore(0)
    ends: list[float] = []
    t0 = time.perf_counter()
    for i in range(n):
        prompt = engine.chat_tokens([{"role": "user",
                                      "content": ALL_PROMPTS[i % len(ALL_PROMPTS)]}])
        scheduler.submit(Request(
            prompt=prompt, params=GenerationParams(max_tokens=tokens, ignore_eos=True,
                                                   adaptive=True),
            on_tokens=lambda _: None, identity="bench",
            on_done=lambda _: (ends.append(time.perf_counter() - t0), done.release())))
    for _ in range(n):
        done.acquire()
    return n * tokens / max(ends)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    slots = max(8, *args.streams)
    engines = {"target-only": Engine(EngineConfig(target=TARGET, slots=slots, n_ctx=N_CTX,
                                                  spec_type="none")),
               "-md": Engine(EngineConfig(target=TARGET, draft=DRAFT, slots=slots,
                                          n_ctx=N_CTX))}
    schedulers = {k: Scheduler(e) for k, e in engines.items()}
    try:
        for k in engines:  # warm-up, untimed
            batch(schedulers[k], engines[k], 1, 16)
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for n in args.streams:
                for k in engines:
                    rates.setdefault((k, n), []).append(
                        batch(schedulers[k], engines[k], n, args.tokens))
        for n in args.streams:
            none, md = (statistics.median(rates[k, n]) for k in engines)
            print(f"N={n}: target-only {none:.1f} tok/s, -md {md:.1f} tok/s, "
                  f"{md / none:.2f}x", flush=True)
    finally:
        for s in schedulers.values():
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
