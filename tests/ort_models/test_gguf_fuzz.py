"""The GGUF fuzzer (tests/support/gguf_fuzz.py) over the tiny files, and SmolLM2's real
header where it is downloaded: no crash (only the clear error), no hang, no memory
blowup, no accepted file that gives NaN logits. `bench/gguf_fuzz.py` is the long run."""

from __future__ import annotations

from pathlib import Path

from gguf_fuzz import fuzz

from tiny_gguf import write_tiny_gguf

SEED = 40
TINY = [dict(arch="llama", weight_type="Q8_0"),
        dict(arch="qwen2", weight_type="Q4_K", n_embd=256, n_ff=512),
        dict(arch="qwen3", weight_type="F16")]


def test_mutants_are_refused_clearly_or_run_finite(tmp_path: Path) -> None:
    from specd.daemon.models.store import model_path

    bases: list[tuple[Path, bool, int]] = [
        (write_tiny_gguf(tmp_path / f"base{i}.gguf", **kw), True, 100)  # type: ignore[arg-type]
        for i, kw in enumerate(TINY)]
    smollm2 = model_path("smollm2-135m-instruct")
    if smollm2.is_file():  # its header only: a mutant of it is checked, not built
        bases.append((smollm2, False, 40))
    report = fuzz(bases, seed=SEED, limit_s=60)
    print(report.summary())
    assert not report.failures(), report.summary()
    counts = report.counts()
    assert counts["rejected"] + counts["accepted"] == sum(n for _, _, n in bases)
    # the mutations reach past the first checks: some files are accepted, built and run
    assert counts["accepted"] >= 30 and counts["rejected"] >= 150, counts


def test_a_mutant_is_the_same_on_every_run(tmp_path: Path) -> None:
    from gguf_fuzz import make_mutant, parse_base

    base = parse_base(write_tiny_gguf(tmp_path / "base.gguf", **TINY[0]), build=False)
    first = [make_mutant(base, SEED, 0, k) for k in range(100)]
    again = [make_mutant(base, SEED, 0, k) for k in range(100)]
    assert [(m.what, m.header, m.cut) for m in first] == [
        (m.what, m.header, m.cut) for m in again]
    assert len({(m.header, m.cut) for m in first}) > 80  # and they differ from each other
