"""The history index's memory and time per token, on the repository's own Python source
tokenized by a real model's tokenizer (code, as an editor or agent history holds).

    python bench/history_index_costs.py [-m qwen2.5-coder-0.5b-instruct] [--tokens 1048576]

Fills one SuffixIndex of --tokens capacity with the source files as documents (repeated
until full), then prints: bytes of its arrays per token held; seconds per token added;
and a lookup (SuffixIndex.candidates + propose, the history source's work each round)
for contexts cut from the held text, per lookup and per token proposed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from specd.daemon.drafters.suffix_index import MAX_MATCH, SuffixIndex, propose
from specd.daemon.models.store import resolve_model
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args()
    tok = Tokenizer.from_metadata(GGUFFile(resolve_model(args.model)).metadata)
    docs = [np.asarray(tok.encode(p.read_text()), np.int32)
            for p in sorted(ROOT.glob("daemon/**/*.py")) if p.stat().st_size > 2000]
    ix = SuffixIndex(args.tokens)
    added, seconds, i = 0, 0.0, 0
    while added < 2 * args.tokens:  # fill, then keep dropping the oldest
        d = docs[i % len(docs)]
        t0 = time.perf_counter()
        ix.add_document(d)
        seconds += time.perf_counter() - t0
        added += d.size + 1
        i += 1
    print(f"held {ix.n_tokens} tokens in {ix.nbytes / 2**20:.1f} MiB: "
          f"{ix.nbytes / ix.n_tokens:.1f} bytes/token; adding: "
          f"{seconds / added * 1e6:.2f} us/token ({added} tokens)")
    live = ix.live_tokens()
    rng = np.random.default_rng(0)
    n_proposed, t_lookup = 0, 0.0
    for _ in range(args.lookups):
        end = int(rng.integers(MAX_MATCH, live.size - 16))
        tail = live[end - MAX_MATCH:end]
        if (tail < 0).any():
            continue
        t0 = time.perf_counter()
        got = propose([ix.candidates(tail, 8)], 8)
        t_lookup += time.perf_counter() - t0
        n_proposed += len(got.tokens)
    print(f"lookup: {t_lookup / args.lookups * 1e6:.0f} us each, "
          f"{t_lookup / max(n_proposed, 1) * 1e6:.1f} us per token proposed "
          f"({n_proposed / args.lookups:.2f} tokens a lookup)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
