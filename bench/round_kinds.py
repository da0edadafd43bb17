"""Where a generation's rounds go: plain target steps, draft-model rounds, lookup rounds.

    python bench/round_kinds.py [--prompt prose] [--temperature 0.7] [--seeds 1234,1235]
                                [--spec "draft+ngram adaptive"] [--tokens 256] [--threads 2]

For each seed, target-only and then the configuration run back to back on one engine;
each round of the configuration is classified by what drafted it (nothing, the draft
model, prompt lookup) with its count, tokens, wall time and draft time. A plain round's
time per token, next to the other kinds', says what drafting cost or saved; the
target-only run beside it says whether the machine changed speed in between.
"""

from __future__ import annotations

import argparse
import time

from specd.daemon.benchmark import run as bench
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams


def run(engine: Engine, ids: list[int], spec: str, temperature: float, seed: int,
        tokens: int) -> tuple[float, dict[str, list[float]]]:
    """(decode tok/s, per kind [rounds, tokens, seconds, draft seconds])."""
    cfg = bench.parse_config(spec)
    params = GenerationParams(max_tokens=tokens, ignore_eos=True,
                              sampling=SamplerParams(temperature=temperature, seed=seed),
                              draft=DraftParams(n_max=cfg.n_max, p_min=cfg.p_min),
                              adaptive=cfg.adaptive)
    gen = Generation(engine.target.runner, 0, ids, params, eog=engine.eog_ids,
                     drafter=bench.SpecdRunner(engine).drafter_for(cfg))
    gen.prefill()
    kinds: dict[str, list[float]] = {}
    while not gen.done:
        draft_s, n, lookups = gen.stats.draft_s, len(gen.tokens), gen.stats.lookup_rounds
        t0 = time.perf_counter()
        gen.step()
        dt = time.perf_counter() - t0
        kind = ("lookup" if gen.stats.lookup_rounds != lookups
                else "model" if gen.stats.draft_s != draft_s else "plain")
        k = kinds.setdefault(kind, [0, 0, 0.0, 0.0])
        k[0] += 1
        k[1] += len(gen.tokens) - n
        k[2] += dt
        k[3] += gen.stats.draft_s - draft_s
    gen.close()
    return gen.stats.decode_tps, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default="prose", choices=sorted(bench.PROMPTS))
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seeds", default="1234")
    ap.add_argument("--spec", default="draft+ngram adaptive")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig(target="qwen2.5-coder-1.5b-instruct",
                                 draft="qwen2.5-coder-0.5b-instruct", spec_type="draft",
                                 n_ctx=4096, threads=args.threads))
    ids = engine.encode_prompt(bench.PROMPTS[args.prompt], chat=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        for spec in ("target-only", args.spec):
            tps, kinds = run(engine, ids, spec, args.temperature, seed, args.tokens)
            parts = ", ".join(
                f"{kind} {int(r)} rounds / {int(t)} tokens / {s * 1e3:.0f} ms"
                f" ({s * 1e3 / max(t, 1):.1f} ms a token; draft {d * 1e3:.0f} ms)"
                for kind, (r, t, s, d) in sorted(kinds.items()))
            print(f"seed {seed} {spec}: {tps:.2f} tok/s; {parts}", flush=True)


if __name__ == "__main__":
    main()
