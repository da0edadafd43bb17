"""Drafter head passes of N slots batched in one pass against one pass per slot, side by
side in one process, for random heads shaped like each target's own layers.

    python bench/head_batch.py [--targets smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct]
                               [--slots 4] [--block 8] [--repeats 15] [-t 2]

Per target: a one-layer DFlash head (the target's LM head shared) and a one-layer EAGLE-3
head (its own 32k-row LM head through d2t, as SpecForge trains them), built as specd
builds them on the CPU (Q4_K, specd's kernels), each of N slots holding 300 context rows.
Timed, alternating A and B each repeat (medians):

- DFlash block of `--block` drafts per slot: HeadRunner.forward_batch of all N blocks (one
  pass, as the scheduler runs them) against N passes of one block each;
- DFlash injection of 2 committed tokens per slot: N injections waiting in
  `deferred_injections` (one pass) against N passes;
- EAGLE-3 drafting step per slot: N steps in one pass against N passes.
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

from specd.daemon.models.store import resolve_model
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.head_runner import BlockCall, HeadRunner, StepCall, load_or_build_head

from tiny_heads import write_tiny_head

POS = 300  # context rows per slot


def paired_ms(a: Callable[[], object], b: Callable[[], object], repeats: int
              ) -> tuple[float, float]:
    """Median ms of a and of b, run alternately (a first, then b, each repeat)."""
    a(), b()  # the first call of a shape runs slower
    ta, tb = [], []
    for _ in range(repeats):
        for call, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def dflash_rows(head: HeadRunner, n: int, block: int, repeats: int,
                rng: np.random.Generator) -> list[tuple[str, float, float]]:
    """The DFlash block and injection of N slots, batched and per slot."""
    assert head.packs_blocks and head.packs_injections
    width = head.feature_width
    for seq in range(n):
        head.inject(seq, rng.standard_normal((POS + seq, width), np.float32), 0)
    mask = head.built.head.mask_token_id
    assert mask is not None
    blocks = [BlockCall(seq, [11] + [mask] * block, POS + seq, list(range(1, block + 1)))
              for seq in range(n)]
    two = [rng.standard_normal((2, width), np.float32) for _ in range(n)]

    def deferred() -> None:
        with head.deferred_injections():
            apart()

    def apart() -> None:
        for seq in range(n):
            head.inject(seq, two[seq], POS + seq)

    return [(f"DFlash block, {block} drafts", *paired_ms(
                lambda: head.forward_batch(blocks),
                lambda: [head.forward_batch([c]) for c in blocks], repeats)),
            ("DFlash injection, 2 tokens", *paired_ms(deferred, apart, repeats))]


def eagle3_rows(head: HeadRunner, n: int, repeats: int, rng: np.random.Generator
                ) -> list[tuple[str, float, float]]:
    """The EAGLE-3 drafting step of N slots, batched and per slot."""
    assert head.packs_steps
    gs = []
    for seq in range(n):
        g = head.encode(rng.standard_normal((POS + seq + 1, head.feature_width), np.float32))
        head.pair(seq, [11] * (POS + seq), g[:-1], 0)
        gs.append(g[-1:])
    steps = [StepCall(seq, [11], gs[seq], POS + seq, [0]) for seq in range(n)]
    return [("EAGLE-3 step (32k vocab)", *paired_ms(
        lambda: head.forward_batch(steps),
        lambda: [head.forward_batch([c]) for c in steps], repeats))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--block", type=int, default=8, help="drafts per DFlash block")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    n, r = args.slots, args.repeats
    rng = np.random.default_rng(0)
    print(f"{n} slots, {POS} context rows each; ms per step of all slots (median of {r}), "
          "batched / per slot\n")
    print("| target | head pass | batched ms | per slot ms | ratio |")
    print("|---|---|---|---|---|")
    for name in args.targets.split(","):
        target_path = resolve_model(name, to_run=True)
        hp = read_hparams(GGUFFile(target_path))
        shape = {"n_layer": 1, "n_embd": hp.n_embd, "n_head": hp.n_head,
                 "n_head_kv": hp.n_head_kv, "head_dim": hp.head_dim, "n_ff": hp.n_ff,
                 "target_layers": (2, hp.n_layer // 2, hp.n_layer - 1),
                 "target_hidden_size": hp.n_embd, "vocab_size": hp.n_vocab,
                 "target_arch": hp.arch, "weight_type": "Q8_0", "block_size": args.block + 1}
        with tempfile.TemporaryDirectory() as tmp:
            path = write_tiny_head(Path(tmp) / "dflash.gguf", kind="dflash",
                                   **shape)  # type: ignore[arg-type]
            rows = dflash_rows(HeadRunner(load_or_build_head(path, target_path), n_ctx=1024,
                                          n_seq=n, threads=args.threads),
                               n, args.block, r, rng)
            path = write_tiny_head(Path(tmp) / "eagle3.gguf", kind="eagle3",
                                   draft_vocab=min(32768, hp.n_vocab),
                                   **shape)  # type: ignore[arg-type]
            rows += eagle3_rows(HeadRunner(load_or_build_head(path, target_path), n_ctx=1024,
                                           n_seq=n, threads=args.threads), n, r, rng)
        for what, batched, apart_ms in rows:
            print(f"| {name} | {what} | {batched:.2f} | {apart_ms:.2f} | "
                  f"{batched / apart_ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
