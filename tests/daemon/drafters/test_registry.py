"""The speculation-type registry: one place maps a spec type to its drafter."""

from __future__ import annotations

import pytest

from specd.daemon.drafters.composite import CompositeDrafter
from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.drafters.registry import (
    MODEL_SPEC_TYPES,
    SPEC_TYPES,
    DrafterInputs,
    SpecTypeError,
    make_drafter,
    resolve_spec_type,
)
from specd.daemon.drafters.synthetic import SyntheticDrafter
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner


def test_spec_types_name_the_registry() -> None:
    assert SPEC_TYPES == ("auto", "none", "draft", "ngram", "draft+ngram", "synthetic",
                          "draft-dflash", "draft-dspark", "draft-dflash2", "draft-eagle3",
                          "head+draft")
    assert MODEL_SPEC_TYPES == ("draft", "draft+ngram", "draft-dflash", "draft-dspark",
                                "draft-dflash2", "draft-eagle3", "head+draft")


def test_two_draft_files_resolve_to_head_and_draft() -> None:
    """A head and a draft model run side by side; no other type takes two files, and
    head+draft takes no fewer."""
    assert resolve_spec_type("auto", "h.gguf", "dflash", head_and_model=True) == "head+draft"
    assert resolve_spec_type("head+draft", "h.gguf", "dflash",
                             head_and_model=True) == "head+draft"
    with pytest.raises(SpecTypeError, match="draft-dflash runs one draft file"):
        resolve_spec_type("draft-dflash", "h.gguf", "dflash", head_and_model=True)
    with pytest.raises(SpecTypeError, match="needs a head and a draft model: -md twice"):
        resolve_spec_type("head+draft", "h.gguf", "dflash")
    with pytest.raises(SpecTypeError, match="needs a head and a draft model"):
        make_drafter("head+draft", DrafterInputs())


def test_auto_resolves_by_whether_there_is_a_draft() -> None:
    assert resolve_spec_type("auto", "d.gguf") == "draft+ngram"
    assert resolve_spec_type("auto", None) == "none"
    with pytest.raises(SpecTypeError, match="needs a draft model"):
        resolve_spec_type("draft", None)
    with pytest.raises(SpecTypeError, match="unknown spec type 'eagle'"):
        resolve_spec_type("eagle", None)


def test_auto_resolves_a_head_by_its_kind() -> None:
    assert resolve_spec_type("auto", "h.gguf", "dflash") == "draft-dflash"
    assert resolve_spec_type("draft-dflash", "h.gguf", "dflash") == "draft-dflash"
    assert resolve_spec_type("auto", "h.gguf", "dspark") == "draft-dspark"
    with pytest.raises(SpecTypeError, match="needs a dflash head, and h.gguf is a dspark head"):
        resolve_spec_type("draft-dflash", "h.gguf", "dspark")
    assert resolve_spec_type("auto", "h.gguf", "eagle3") == "draft-eagle3"
    assert resolve_spec_type("auto", "h.gguf", "dflash2") == "draft-dflash2"
    assert resolve_spec_type("draft-dflash", "h.gguf", "dflash2") == "draft-dflash2"
    with pytest.raises(SpecTypeError, match="mtp drafter head, which specd does not run"):
        resolve_spec_type("auto", "h.gguf", "mtp")
    with pytest.raises(SpecTypeError, match="h.gguf is a mtp drafter head, which specd does not"):
        resolve_spec_type("auto", "h.gguf", "mtp", head_and_model=True)  # beside a model
    with pytest.raises(SpecTypeError, match="needs a draft model, and h.gguf is a dflash head"):
        resolve_spec_type("draft+ngram", "h.gguf", "dflash")
    with pytest.raises(SpecTypeError, match="needs a dflash head, and m.gguf is a draft model"):
        resolve_spec_type("draft-dflash", "m.gguf", None)
    with pytest.raises(SpecTypeError, match="needs a draft dflash head"):
        make_drafter("draft-dflash", DrafterInputs())


def test_each_type_builds_its_drafter(tiny_model_factory) -> None:
    runner = ModelRunner(load_or_build(tiny_model_factory(arch="qwen2")), n_ctx=256)
    inputs = DrafterInputs(draft_runner=runner, target_vocab=300, ngram_min=1, ngram_max=3,
                           synthetic_mean=2.0, n_max=4)
    assert make_drafter("none", inputs) is None
    model = make_drafter("draft", inputs)
    assert isinstance(model, DraftModelDrafter) and model.vocab_limit == 300
    hybrid = make_drafter("draft+ngram", inputs)
    assert isinstance(hybrid, CompositeDrafter) and hybrid.lookup.max_ngram == 3
    ngram = make_drafter("ngram", inputs)
    assert isinstance(ngram, NgramDrafter) and (ngram.min_ngram, ngram.max_ngram) == (1, 3)
    synthetic = make_drafter("synthetic", inputs)
    assert isinstance(synthetic, SyntheticDrafter) and len(synthetic.rates) == 4
    with pytest.raises(SpecTypeError, match="needs a draft model"):
        make_drafter("draft", DrafterInputs())
