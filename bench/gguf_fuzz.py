"""The long run of the GGUF fuzzer (tests/support/gguf_fuzz.py; the test runs a few hundred).

    python bench/gguf_fuzz.py [--tiny 600] [--smollm2 600] [--seed 1] [--out FILE.json]

Mutants of three tiny models written by tests/support/tiny_gguf.py (llama Q8_0, qwen2
Q4_K, qwen3 F16) and of SmolLM2-135M's real file (from the model store; skipped where it
is not downloaded), `--tiny` per tiny model and `--smollm2` of SmolLM2. Every mutant goes
the daemon's way (GGUFFile, the tokenizer, validate_gguf); each one accepted is built with
the target's options and run (a prompt and a step). Prints the counts per base and every
failure: a crash (an error other than the clear one), a rejection of more than one line,
a hang (60 s), a memory blowup (peak RSS up 1 GiB), NaN logits. Exits 1 on any failure.
`--out` writes the counts and the failures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from gguf_fuzz import fuzz

from tiny_gguf import write_tiny_gguf

TINY = [dict(arch="llama", weight_type="Q8_0"),
        dict(arch="qwen2", weight_type="Q4_K", n_embd=256, n_ff=512),
        dict(arch="qwen3", weight_type="F16")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", type=int, default=600, help="mutants per tiny model")
    ap.add_argument("--smollm2", type=int, default=600, help="mutants of SmolLM2's file")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from specd.daemon.models.store import model_path

    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-bases-") as tmp:
        bases: list[tuple[Path, bool, int]] = [
            (write_tiny_gguf(Path(tmp) / f"tiny-{kw['arch']}-{kw['weight_type']}.gguf",
                             **kw), True, args.tiny)  # type: ignore[arg-type]
            for kw in TINY]
        smollm2 = model_path("smollm2-135m-instruct")
        if args.smollm2 and smollm2.is_file():
            bases.append((smollm2, True, args.smollm2))
        elif args.smollm2:
            print(f"{smollm2} is not downloaded: tiny models only", file=sys.stderr)
        done = [0]

        def progress(result: dict[str, object]) -> None:
            done[0] += 1
            if done[0] % 200 == 0:
                print(f"  {done[0]} mutants", file=sys.stderr, flush=True)

        report = fuzz(bases, seed=args.seed, limit_s=60, progress=progress)
    print(report.summary())
    if args.out is not None:
        per_base = {Path(name).name: dict(sorted(Counter(
            r["outcome"] for r in report.results if r["base"] == b).items()))
            for b, name in enumerate(report.bases)}
        args.out.write_text(json.dumps({
            "seed": args.seed, "mutants": len(report.results),
            "seconds": round(report.seconds), "counts": dict(sorted(report.counts().items())),
            "per_base": per_base, "failures": report.failures()}, indent=1) + "\n")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
