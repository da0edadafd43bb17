"""A drafter head's block proposals chosen in its graph against on the host: the time of
one DFlash draft call (the block pass and the rows' choices) for a random head shaped for
Qwen2.5-Coder-1.5B, at T 0 and T 0.7, the two ways alternating in one process.

    python bench/head_sampling.py [--rows 8] [--repeats 30] [--layers 1]

The head is random (no trained head exists for this target yet), so its proposals mean
nothing; what is timed is the cost of making them. Host: the block's logits [n, vocab]
copied out and each row picked by `pick_token`; graph: one SampleSpec per row, the node
choosing in the pass, the token and its top-10 q read back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from specd.daemon.drafters.dflash import DFlashDrafter
from specd.daemon.models.store import resolve_model
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.sampling import Sampler, SamplerParams
from specd.ort_models.head_runner import HeadRunner, load_or_build_head

from tiny_heads import write_tiny_head

POS = 300
QWEN_VOCAB, QWEN_MASK = 151936, 151665


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", type=int, default=8, help="drafts per block")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    target_path = resolve_model(args.target, to_run=True)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        head_path = write_tiny_head(
            Path(tmp) / "dflash.gguf", kind="dflash", n_layer=args.layers, n_embd=1536,
            n_head=12, n_head_kv=2, head_dim=128, n_ff=8960, target_layers=(2, 14, 27),
            target_hidden_size=1536, block_size=args.rows + 1, vocab_size=QWEN_VOCAB,
            mask_token_id=QWEN_MASK, weight_type="Q8_0", target_arch="qwen2")
        runner = HeadRunner(load_or_build_head(head_path, target_path), n_ctx=1024,
                            threads=args.threads)
        assert runner.block_samples, "the head's block graph has no sampler (specd's kernels?)"
        drafter = DFlashDrafter(runner)
        features = {layer: rng.standard_normal((POS, 1536), np.float32)
                    for layer in drafter.target_layers}
        context = rng.integers(100, 20000, POS).tolist()
        for temperature in (0.0, 0.7):
            sampler = (Sampler(SamplerParams(temperature=temperature, top_k=10), seed=1)
                       if temperature else None)
            drafter.begin(0, context, sampler, features)
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for in_graph in (False, True):
                    params = DraftParams(n_max=args.rows, backend_sampling=in_graph)
                    t0 = time.perf_counter()
                    drafted = drafter.draft(0, 11, POS, args.rows, params)
                    times[in_graph].append(time.perf_counter() - t0)
                    assert len(drafted.tokens) == args.rows
            host, graph = (1e3 * statistics.median(times[k]) for k in (False, True))
            print(f"T {temperature:.1f}, a block of {args.rows}: host {host:.2f} ms, graph "
                  f"{graph:.2f} ms ({(host - graph) / args.rows:.3f} ms less a proposal)",
                  flush=True)
            drafter.end(0)


if __name__ == "__main__":
    main()
