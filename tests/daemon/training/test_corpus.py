"""The training text: what it is made of and its licences, the evaluation split disjoint
from the training one, and `specd bench`'s prompts never trained on."""

from __future__ import annotations

import itertools

from specd.daemon.benchmark.run import PROMPTS
from specd.daemon.training import corpus


def _first(split: str, n: int = 300, **kw: object) -> list[corpus.Instruction]:
    return list(itertools.islice(corpus.instructions(split, **kw), n))  # type: ignore[arg-type]


def test_instructions_of_every_kind_with_their_licences() -> None:
    train = _first("train")
    assert {i.kind for i in train} == {"code", "docs", "story"}
    assert {i.source for i in train} <= set(corpus.LICENCES)
    licences = {r["source"]: r["licence"] for r in corpus.sources_record()}
    assert licences == {"python-stdlib": "PSF-2.0", "python-docs": "PSF-2.0",
                        "stories": "Apache-2.0"}
    code = next(i for i in train if i.kind == "code")
    assert "```python\n" in code.text and code.item.startswith("stdlib/")
    assert _first("train", 50) == train[:50]  # the same order for the same seed
    assert _first("train", 50, seed=1) != train[:50]


def test_the_splits_share_no_source_item() -> None:
    train, held_out = _first("train"), _first("eval", 100)
    assert held_out and all(corpus.split_of(i.item) == "eval" for i in held_out)
    assert all(corpus.split_of(i.item) == "train" for i in train)
    assert not {i.item for i in train} & {i.item for i in held_out}


def test_bench_prompts_are_excluded() -> None:
    ex = corpus.Excluder(list(PROMPTS.values()))
    for prompt in PROMPTS.values():
        assert ex.hits(prompt)
        assert ex.hits(f"Explain this:\n\n{prompt}\n\nThanks")  # embedded, reflowed too
        assert ex.hits(" ".join(prompt.split()))
    assert not ex.hits("Write a Python function that reverses a string.")
    for split in corpus.SPLITS:
        assert not any(ex.hits(i.text) for i in _first(split, 200))
    # an excluded text drops the instructions that contain it, and only those
    first = _first("train", 5)
    kept = _first("train", 4, exclude=[first[1].text[:200]])
    assert first[1] not in kept and kept[:1] == first[:1] and kept[1:] == first[2:5]
