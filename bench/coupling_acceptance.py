"""What coupling a seeded request's drafts costs in acceptance, exactly, on real text.

For each prompt, the target writes `-n` tokens at the temperature (target-only, seeded);
then at every position of that text both models' distributions are computed: p, the
target's under the request's sampler, and q, the draft's under the q chain each route
uses. Per position the probability a single draft is accepted:

- rejection sampling (unseeded requests): sum min(p, q), with q the draft's top-10 at the
  temperature (specd's q for rejection sampling);
- coupled (seeded requests): the chance that one uniform, inverted through the CDFs of p
  and q in ascending id order, lands on the same token: sum over tokens of the overlap of
  their two CDF intervals, with the same top-10 q (specd's) and, for comparison, q under
  the request's own sampler chain.

    python bench/coupling_acceptance.py [-n 128] [-T 0.8] [--top-k 0 --top-p 1 --min-p 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specd.daemon.benchmark.run import PROMPTS
from specd.daemon.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.daemon.models.store import ProgressBar
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import Sampler, SamplerParams
from specd.ort_models.graph_builder import ATTN_BUCKET
from specd.ort_models.runner import Call, ModelRunner

CHUNK = 64  # rows a call: logits of every position, calls within one attention bucket


def all_logits(runner: ModelRunner, tokens: list[int]) -> np.ndarray:
    """The logits after every token [len(tokens), vocab], in calls that stay in a bucket."""
    out = []
    pos = 0
    while pos < len(tokens):
        end = min(pos + CHUNK, len(tokens), pos - pos % ATTN_BUCKET + ATTN_BUCKET)
        call = Call(0, tokens[pos:end], pos, list(range(end - pos)))
        out.append(runner.forward_batch([call])[0].logits)
        pos = end
    return np.concatenate(out)


def coupled_overlap(p: np.ndarray, q: np.ndarray) -> float:
    """P(inverting p's and q's CDFs, ids ascending, at one uniform gives the same token)."""
    hi = np.minimum(np.cumsum(p), np.cumsum(q))
    lo = np.maximum(np.cumsum(p) - p, np.cumsum(q) - q)
    return float(np.clip(hi - lo, 0.0, None).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--prompts", default="code,refactor,prose")
    ap.add_argument("-T", "--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="bench/results/coupling_acceptance.json")
    args = ap.parse_args()
    engine = Engine(EngineConfig(target=args.model, draft=args.draft, spec_type="draft"),
                    progress=ProgressBar())
    assert engine.drafter is not None
    draft_runner = getattr(engine.drafter.model_sources[0], "runner", None)
    assert isinstance(draft_runner, ModelRunner)
    request = SamplerParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed)
    top10 = SamplerParams(temperature=args.temperature, top_k=10)
    rows: dict[str, dict[str, float]] = {}
    for name in args.prompts.split(","):
        prompt = engine.encode_prompt(PROMPTS[name], chat=True)
        gen = Generation(engine.target.runner, 0, prompt, GenerationParams(
            max_tokens=args.max_tokens, ignore_eos=True, sampling=request), eog=set())
        gen.prefill()
        while not gen.done:
            gen.step()
        text = prompt + gen.tokens
        first = len(prompt) - 1  # the row that decided the first generated token
        p_rows = all_logits(engine.target.runner, text)[first:-1]  # [n, vocab]
        q_rows = all_logits(draft_runner, text)[first:-1]  # [n, vocab]
        width = min(p_rows.shape[1], q_rows.shape[1])
        stats: dict[str, list[float]] = {"rejection": [], "coupled": [],
                                         "coupled_request_q": []}
        for i, (pl, ql) in enumerate(zip(p_rows, q_rows, strict=True)):
            history = gen.tokens[:i]
            p = Sampler(request, history=history).probs(pl[:width])
            q_req = Sampler(request, history=history).probs(ql[:width])
            q_10 = Sampler(top10, history=history).probs(ql[:width])
            stats["rejection"].append(float(np.minimum(p, q_10).sum()))
            stats["coupled"].append(coupled_overlap(p, q_10))
            stats["coupled_request_q"].append(coupled_overlap(p, q_req))
        rows[name] = {k: round(statistics.mean(v), 4) for k, v in stats.items()}
        print(f"{name:9s} " + "  ".join(f"{k} {v:.3f}" for k, v in rows[name].items()),
              file=sys.stderr, flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"when": when, "args": vars(args), "rows": rows},
                                         indent=1))
    print(f"\nmean acceptance probability of a draft position, T {args.temperature:g}, "
          f"{args.max_tokens} tokens; {when}")
    print("| prompt | rejection sampling | coupled | coupled, the request's chain as q |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['rejection']:.3f} | {r['coupled']:.3f} | "
              f"{r['coupled_request_q']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
