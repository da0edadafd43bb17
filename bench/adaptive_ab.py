"""Adaptive draft length against target-only, alternated in one process, with a noise gauge.

    python bench/adaptive_ab.py [--prompt prose] [--temperature 0] [--pairs 5]
                                [--tokens 256] [--n-max 4] [--threads 2]
                                [--spec draft|ngram|draft+ngram]

`specd bench` reports medians per configuration; on a shared 2-core host single runs
of one configuration swing by +-15%, more than the few percent adaptive speculation wins
or loses on prose. This runs the two back to back, `--pairs` times, on one engine (the
same target session), and for each run also prints the mean time of its target-only
rounds (rounds where the draft did not run and one token came out): those do the same
work in both configurations, so when they differ between two runs the machine did,
and the tok/s ratio of that pair says little.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from specd.daemon.benchmark import run as bench
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams


@dataclass
class RunResult:
    decode_tps: float
    plain_ms: float  # mean seconds of a target-only round, in ms
    plain_rounds: int
    drafting_rounds: int


def run_once(engine: Engine, ids: list[int], *, adaptive: bool, temperature: float,
             tokens: int, n_max: int, spec: str = "draft") -> RunResult:
    params = GenerationParams(max_tokens=tokens, ignore_eos=True,
                              sampling=SamplerParams(temperature=temperature, seed=1234),
                              draft=DraftParams(n_max=n_max if adaptive else 0),
                              adaptive=adaptive)
    drafter = bench.SpecdRunner(engine).drafter_for(
        bench.parse_config(f"{spec} adaptive" if adaptive else "target-only"))
    gen = Generation(engine.target.runner, 0, ids, params, eog=engine.eog_ids,
                     drafter=drafter)
    gen.prefill()
    plain: list[float] = []
    drafting = 0
    while not gen.done:
        verify_s, draft_s, n_tokens = gen.stats.verify_s, gen.stats.draft_s, len(gen.tokens)
        gen.step()
        if gen.stats.draft_s == draft_s and len(gen.tokens) - n_tokens == 1:
            plain.append(gen.stats.verify_s - verify_s)
        else:
            drafting += 1
    gen.close()
    return RunResult(gen.stats.decode_tps, statistics.mean(plain) * 1e3 if plain else 0.0,
                     len(plain), drafting)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default="prose", choices=sorted(bench.PROMPTS))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec", default="draft", choices=["draft", "ngram", "draft+ngram"],
                    help="what the adaptive runs draft with")
    args = ap.parse_args()
    engine = Engine(EngineConfig(target="qwen2.5-coder-1.5b-instruct",
                                 draft="qwen2.5-coder-0.5b-instruct", spec_type="draft",
                                 n_ctx=4096, threads=args.threads))
    ids = engine.encode_prompt(bench.PROMPTS[args.prompt], chat=True)
    results: dict[bool, list[RunResult]] = {False: [], True: []}
    for _ in range(args.pairs):
        for adaptive in (False, True):
            r = run_once(engine, ids, adaptive=adaptive, temperature=args.temperature,
                         tokens=args.tokens, n_max=args.n_max, spec=args.spec)
            results[adaptive].append(r)
            print(f"{'adaptive   ' if adaptive else 'target-only'} {r.decode_tps:6.2f} tok/s"
                  f"  target-only rounds {r.plain_ms:5.1f} ms ({r.plain_rounds}),"
                  f" drafting rounds {r.drafting_rounds}", flush=True)
    base = statistics.median(r.decode_tps for r in results[False])
    ada = statistics.median(r.decode_tps for r in results[True])
    ratios = [a.decode_tps / t.decode_tps for t, a in zip(results[False], results[True],
                                                           strict=True)]
    print(f"medians: target-only {base:.2f}, adaptive {ada:.2f} tok/s ({ada / base:.3f}x);"
          f" per pair {min(ratios):.2f}-{max(ratios):.2f}x, median"
          f" {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
