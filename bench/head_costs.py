"""What a drafter head's calls cost beside the target's step, for random heads shaped like
those Qwen2.5-Coder-1.5B would get (n_embd 1536, 12 heads, 2 KV heads of 128, FFN 8960,
three target layers read), side by side in one process.

    python bench/head_costs.py [--kinds dflash,dspark,eagle3] [--layers 1,2,5]
                               [--blocks 4,8,16] [--weight-type Q8_0]

Per DFlash head shape (depth; the target's full LM head shared, or a 32k draft vocabulary
through d2t) and per one-layer DSpark head (Markov rank 256, confidence head, anchor-first
block of n rows): one injection of one and of four committed tokens, and one block pass
drafting n (n + 1 rows for DFlash, logits for n), each as a share of one target step at
position 300 (specd's kernels). Per one-layer EAGLE-3 head: one drafting step, and the
encoding and pairing of one and of four committed tokens. Also the target's verify
passes and a 0.5B draft model's step.
From those, the acceptance length at which a head round would draft as fast as the 0.5B
draft model's round at its operating point (--draft-n, --draft-tau: drafts per round and
tokens per round, from BENCHMARKS.md), counting a verify pass of n + 1 rows and the
injection (pairing) of the tokens a round commits; EAGLE-3 drafting n costs n steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from specd.daemon.models.building import build_options
from specd.daemon.models.store import resolve_model
from specd.ort_models.head_runner import HeadRunner, load_or_build_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from tiny_heads import write_tiny_head

POS = 300  # context tokens before each timed call
QWEN_VOCAB = 151_936
QWEN_MASK = 151_669


def median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # the first call of a shape runs slower
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--kinds", default="dflash,dspark,eagle3")
    ap.add_argument("--layers", default="1,2,5", help="DFlash head depths")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--vocabs", default="0,32768", help="draft vocabularies (0: the target's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--weight-type", default="Q8_0", help="the heads' matrices (Q8_0, Q4_0, F16)")
    ap.add_argument("--draft-n", type=int, default=3)
    ap.add_argument("--draft-tau", type=float, default=3.58)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    target_path = resolve_model(args.target, to_run=True)
    draft_path = resolve_model(args.draft, to_run=True)
    r = args.repeats
    ctx = list(np.random.default_rng(0).integers(100, 20000, POS))

    target = ModelRunner(load_or_build(target_path, build_options("target")), n_ctx=1024,
                         threads=args.threads)
    target.prefill(0, ctx, 0)
    step = median_ms(lambda: target.forward(0, [11], POS), r)
    verify = {n: median_ms(lambda n=n: target.forward(0, [11] * (n + 1), POS,
                                                      list(range(n + 1))), r)
              for n in sorted({args.draft_n, *map(int, args.blocks.split(","))})}
    draft = ModelRunner(load_or_build(draft_path, build_options("draft")), n_ctx=1024,
                        threads=args.threads, row_block=1, min_rows=1)
    draft.prefill(0, ctx, 0)
    draft_step = median_ms(lambda: draft.forward(0, [11], POS), r)
    print(f"target step {step:.1f} ms; verify " + ", ".join(
        f"{n + 1} rows {v / step:.2f}" for n, v in verify.items())
        + f"; 0.5B draft step {draft_step / step:.3f} of a target step", flush=True)
    # the 0.5B draft model's round at its operating point, in target steps
    model_round = (args.draft_n * draft_step + verify[args.draft_n]) / step
    model_rate = args.draft_tau / model_round  # tokens per target step
    print(f"0.5B draft round (n={args.draft_n}, tau={args.draft_tau}): {model_round:.2f} "
          f"target steps, {model_rate:.2f} tokens per target step\n")

    blocks = [int(b) for b in args.blocks.split(",")]
    kinds = args.kinds.split(",")
    vocabs = list(map(int, args.vocabs.split(",")))

    def match(round_cost: float, per_token: float) -> float:
        """tau at which tau / (round_cost + per_token * tau) == model_rate."""
        denom = 1.0 - model_rate * per_token
        return model_rate * round_cost / denom if denom > 0 else float("inf")

    def shape(layers: int, vocab: int, kind: str) -> dict[str, object]:
        return {"kind": kind, "n_layer": layers, "n_embd": 1536, "n_head": 12,
                "n_head_kv": 2, "head_dim": 128, "n_ff": 8960, "target_layers": (2, 14, 27),
                "target_hidden_size": 1536, "block_size": max(blocks) + 1,
                "vocab_size": QWEN_VOCAB, "mask_token_id": QWEN_MASK,
                "weight_type": args.weight_type, "draft_vocab": vocab or None,
                "target_arch": "qwen2", "markov_rank": 256}

    def name(kind: str, layers: int, vocab: int) -> str:
        return (f"{kind}, {layers} layer{'s' if layers > 1 else ''}, "
                + (f"{vocab // 1024}k vocab (d2t)" if vocab else "full vocab"))

    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        block_heads = [("dflash", layers, vocab) for layers in map(int, args.layers.split(","))
                       for vocab in vocabs if "dflash" in kinds]
        block_heads += [("dspark", 1, vocab) for vocab in vocabs if "dspark" in kinds]
        if block_heads:
            print("| head | inject 1 token | inject 4 | " + " | ".join(
                f"block n={n}" for n in blocks) + " | " + " | ".join(
                f"tau to match 0.5B, n={n}" for n in blocks) + " |")
            print("|---|---|---|" + "---|" * (2 * len(blocks)))
        for kind, layers, vocab in block_heads:
            head_path = write_tiny_head(Path(tmp) / f"{kind}-{layers}-{vocab}.gguf",
                                        **shape(layers, vocab, kind))  # type: ignore[arg-type]
            head = HeadRunner(load_or_build_head(head_path, target_path), n_ctx=1024,
                              threads=args.threads)
            width = head.feature_width
            head.inject(0, rng.standard_normal((POS, width), np.float32), 0)
            one = rng.standard_normal((1, width), np.float32)
            four = rng.standard_normal((4, width), np.float32)
            inj1 = median_ms(lambda h=head, one=one: h.inject(0, one, POS), r) / step
            inj4 = median_ms(lambda h=head, four=four: h.inject(0, four, POS), r) / step
            first = 0 if kind == "dspark" else 1  # the anchor-first block reads row 0
            cost = [median_ms(lambda h=head, n=n, f=first: h.block(
                0, [11] + [QWEN_MASK] * (n + f - 1), POS, list(range(f, f + n))),
                r) / step for n in blocks]
            taus = [match(c + verify[n] / step, inj1) for c, n in zip(cost, blocks, strict=True)]
            print(f"| {name(kind, layers, vocab)} | {inj1:.3f} | {inj4:.3f} | " + " | ".join(
                f"{c:.3f}" for c in cost) + " | " + " | ".join(
                f"{m:.2f}" + ("" if m <= n + 1 else " (never)")
                for m, n in zip(taus, blocks, strict=True)) + " |", flush=True)
        if "eagle3" in kinds:
            print("\n| head | step | encode + pair 1 token | 4 | " + " | ".join(
                f"tau to match 0.5B, n={n}" for n in blocks) + " |")
            print("|---|---|---|---|" + "---|" * len(blocks))
        for vocab in vocabs if "eagle3" in kinds else []:
            head_path = write_tiny_head(Path(tmp) / f"eagle3-{vocab}.gguf",
                                        **shape(1, vocab, "eagle3"))  # type: ignore[arg-type]
            head = HeadRunner(load_or_build_head(head_path, target_path), n_ctx=1024,
                              threads=args.threads)
            width = head.feature_width
            g = head.encode(rng.standard_normal((POS, width), np.float32))
            head.pair(0, [11] * POS, g, 0)
            hidden = g[-1:]
            s1 = median_ms(lambda h=head, x=hidden: h.step(0, [11], x, POS, [0]), r) / step

            def pair(n: int, h: HeadRunner = head, width: int = width) -> None:
                feats = rng.standard_normal((n, width), np.float32)
                h.pair(0, [11] * n, h.encode(feats), POS)

            p1 = median_ms(lambda: pair(1), r) / step
            p4 = median_ms(lambda: pair(4), r) / step
            taus = [match(n * s1 + verify[n] / step, p1) for n in blocks]
            print(f"| {name('eagle3', 1, vocab)} | {s1:.3f} | {p1:.3f} | {p4:.3f} | "
                  + " | ".join(f"{m:.2f}" + ("" if m <= n + 1 else " (never)")
                               for m, n in zip(taus, blocks, strict=True)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
