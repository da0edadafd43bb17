"""How well a draft build predicts the target, teacher-forced over the target's own replies.

    python bench/draft_quality.py [--drafts exact,auto] [--vocabs 98304]
                                  [--coverage 32768,49152,98304] [--replies FILE]

Speed decides nothing here: each draft build (`--drafts`: `--draft-quant` values, each with
every `--vocabs` cut of its output rows, 0 for all) reads the target's replies to the
bench's prompts and to eight held-out ones, one pass each, and at every reply position
its argmax is compared with the target's (greedy acceptance) and its distribution at
temperature 0.7 with the target's, sum(min(p, q)) over the target's 256 likeliest ids
(the chance a sampled draft is accepted there). A single generation's acceptance swings
with where rounds happen to begin; these means over ~3,000 positions do not, so a
change of half a percent in draft quality shows. The replies (the 1.5B's, 256 tokens
at T 0 and T 0.7 for the bench prompts, 200 at T 0.7 for the others) are generated
once and kept in `--replies`.

`--coverage` says which share of the replies' tokens a draft limited to the first K ids
could propose at all, and with the ids of the prompt and of the reply so far added
(what a per-request vocabulary would hold).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specd.daemon.benchmark import run as bench
from specd.daemon.models.building import build_options
from specd.daemon.models.store import resolve_model
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams, softmax
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
HELD_OUT = {
    "tcp": "Explain how TCP congestion control works, for a student.",
    "js": "Write a JavaScript debounce function with JSDoc comments and an example of its use "
          "in a web page.",
    "rust": "Write a Rust function that parses a CSV line with quoted fields, with unit tests.",
    "poem": "Write a poem of four stanzas about an autumn evening in a small town.",
    "history": "Summarize the causes of the French Revolution in a few paragraphs.",
    "sql": "Write SQL to find the top 5 customers by total order value in the last 30 days, "
           "and explain it.",
    "email": "Write a polite email to my landlord asking to fix a leaking kitchen tap.",
    "cpp": "Implement a thread-safe queue in C++17 with a condition variable.",
}
TOP = 256  # target ids kept per position for sum(min(p, q))
TEMPERATURE = 0.7
CHUNK = 64  # reply tokens per teacher-forced pass
REPLIES = Path(__file__).resolve().parent / "results" / "draft-quality-replies.json"


def make_replies(engine: Engine) -> dict[str, dict]:
    """{name: {"prompt": ids, "reply": ids}} from the target, greedy and sampled."""
    jobs = [(f"{k}-t0", v, 0.0, 256) for k, v in bench.PROMPTS.items()]
    jobs += [(f"{k}-t0.7", v, 0.7, 256) for k, v in bench.PROMPTS.items()]
    jobs += [(k, v, 0.7, 200) for k, v in HELD_OUT.items()]
    out = {}
    for name, text, temp, n in jobs:
        ids = engine.encode_prompt(text, chat=True)
        gen = Generation(engine.target.runner, 0, ids, GenerationParams(
            max_tokens=n, sampling=SamplerParams(temperature=temp, seed=7)), eog=engine.eog_ids)
        gen.prefill()
        while not gen.done:
            gen.step()
        gen.close()
        out[name] = {"prompt": ids, "reply": [int(t) for t in gen.tokens]}
        print(f"reply {name}: {len(gen.tokens)} tokens", flush=True)
    return out


def teacher_forced(runner: ModelRunner, prompt: list[int], reply: list[int]) -> np.ndarray:
    """Logits [len(reply), vocab]: row i predicts reply[i] from the prompt and reply[:i]."""
    runner.prefill(0, prompt[:-1], 0)
    seq = [prompt[-1], *reply[:-1]]
    rows = []
    for i in range(0, len(seq), CHUNK):
        part = seq[i:i + CHUNK]
        rows.append(runner.forward(0, part, len(prompt) - 1 + i, list(range(len(part)))))
    return np.concatenate(rows)


def tempered(logits: np.ndarray) -> np.ndarray:
    """The distributions [n, vocab] sampling at temperature 0.7 draws from (no filters)."""
    return softmax(np.asarray(logits, np.float64) / TEMPERATURE)


def target_stats(engine: Engine, replies: dict[str, dict]) -> dict[str, tuple]:
    """Per reply: (argmax [n], top ids [n, TOP], their probabilities at T 0.7 [n, TOP])."""
    out = {}
    for name, r in replies.items():
        logits = teacher_forced(engine.target.runner, r["prompt"], r["reply"])
        p = tempered(logits)
        top = np.argsort(-p, axis=-1)[:, :TOP]
        out[name] = (logits.argmax(-1), top, np.take_along_axis(p, top, -1))
    return out


def draft_quality(runner: ModelRunner, replies: dict[str, dict],
                  stats: dict[str, tuple]) -> dict[str, tuple[float, float]]:
    """Per reply: (argmax agreement, mean sum(min(p, q)) at T 0.7)."""
    out = {}
    for name, r in replies.items():
        logits = teacher_forced(runner, r["prompt"], r["reply"])  # [n, draft width]
        arg, top, p_top = stats[name]
        width = logits.shape[1]
        q = tempered(logits)
        q_top = np.where(top < width, np.take_along_axis(q, np.minimum(top, width - 1), -1), 0)
        out[name] = (float((logits.argmax(-1) == arg).mean()),
                     float(np.minimum(p_top, q_top).sum(-1).mean()))
    return out


def coverage(replies: dict[str, dict], cut: int) -> tuple[float, float]:
    """(share of reply tokens below `cut`, the same with the prompt's and the reply's
    earlier ids added), the worst reply's."""
    plain, with_context = [], []
    for r in replies.values():
        seen = set(r["prompt"])
        hits = 0
        for t in r["reply"]:
            hits += t < cut or t in seen
            seen.add(t)
        plain.append(float(np.mean(np.asarray(r["reply"]) < cut)))
        with_context.append(hits / len(r["reply"]))
    return min(plain), min(with_context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafts", default="exact,auto", help="--draft-quant values")
    ap.add_argument("--vocabs", default="98304", help="draft vocabulary cuts (0: all)")
    ap.add_argument("--coverage", default="", help="id cuts to report the coverage of")
    ap.add_argument("--replies", type=Path, default=REPLIES)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig(target=TARGET, n_ctx=4096, threads=args.threads))
    if args.replies.exists():
        replies = json.loads(args.replies.read_text())
    else:
        replies = make_replies(engine)
        args.replies.parent.mkdir(parents=True, exist_ok=True)
        args.replies.write_text(json.dumps(replies))
    n_tokens = sum(len(r["reply"]) for r in replies.values())
    for cut in (int(c) for c in args.coverage.split(",") if c):
        plain, ctx = coverage(replies, cut)
        print(f"ids < {cut}: worst reply covered {plain:.3f}; with its context's ids {ctx:.3f}")
    stats = target_stats(engine, replies)
    print(f"| draft | vocab | argmax agreement | sum(min(p, q)) at T 0.7 | worst reply |"
          f"\n|---|---|---|---|---|  ({len(replies)} replies, {n_tokens} positions)")
    for quant in args.drafts.split(","):
        for vocab in (int(v) for v in args.vocabs.split(",")):
            built = load_or_build(resolve_model(DRAFT), build_options("draft", quant, "cpu", vocab))
            runner = ModelRunner(built, n_ctx=4096, threads=args.threads)
            per = draft_quality(runner, replies, stats)
            worst = min(per, key=lambda k: per[k][1])
            print(f"| {quant} | {vocab or 'all'} | {np.mean([a for a, _ in per.values()]):.4f} | "
                  f"{np.mean([s for _, s in per.values()]):.4f} | {worst} "
                  f"{per[worst][0]:.3f} / {per[worst][1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
