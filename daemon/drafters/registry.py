"""Speculation types: each name maps to the factory of its drafter.

The engine, the CLI and the bench all build drafters here. `auto` and `none` are not
drafters: `auto` resolves to `draft+ngram` with a draft model, else to `none`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specd.daemon.spec.drafter import Drafter
from specd.ort_models.runner import ModelRunner

from .draft_model import DraftModelDrafter
from .hybrid import HybridDrafter
from .ngram import NgramDrafter
from .synthetic import SyntheticDrafter


class SpecTypeError(ValueError):
    """An unknown speculation type, or one whose needs are not met (message for the user)."""


@dataclass(frozen=True)
class DrafterInputs:
    """What a drafter may be built from."""

    draft_runner: ModelRunner | None = None  # the draft model, for the types that load one
    target_vocab: int | None = None  # the target's vocabulary size (drafts propose below it)
    ngram_min: int = 2
    ngram_max: int = 4
    synthetic_rates: Sequence[float] | None = None
    synthetic_mean: float | None = None
    synthetic_seed: int = 0
    n_max: int = 8  # the longest draft (synthetic rates for a mean length)


@dataclass(frozen=True)
class SpecType:
    name: str
    loads_draft_model: bool
    build: Callable[[DrafterInputs], Drafter]


def _model(inputs: DrafterInputs) -> DraftModelDrafter:
    assert inputs.draft_runner is not None
    return DraftModelDrafter(inputs.draft_runner, vocab_limit=inputs.target_vocab)


def _ngram(inputs: DrafterInputs) -> NgramDrafter:
    return NgramDrafter(min_ngram=inputs.ngram_min, max_ngram=inputs.ngram_max)


def _synthetic(inputs: DrafterInputs) -> SyntheticDrafter:
    return SyntheticDrafter(inputs.synthetic_rates, mean_length=inputs.synthetic_mean,
                            n_max=inputs.n_max, seed=inputs.synthetic_seed)


SPEC_TYPE_REGISTRY: dict[str, SpecType] = {s.name: s for s in (
    SpecType("draft", True, _model),
    SpecType("ngram", False, _ngram),
    SpecType("draft+ngram", True, lambda i: HybridDrafter(_model(i), _ngram(i))),
    SpecType("synthetic", False, _synthetic),
)}
SPEC_TYPES = ("auto", "none", *SPEC_TYPE_REGISTRY)
# the spec types that load a draft model
MODEL_SPEC_TYPES = tuple(n for n, s in SPEC_TYPE_REGISTRY.items() if s.loads_draft_model)


def resolve_spec_type(spec_type: str, draft: str | None) -> str:
    """The spec type to run: `auto` resolved, a type that needs a draft model checked."""
    if spec_type not in SPEC_TYPES:
        raise SpecTypeError(f"unknown spec type {spec_type!r} (one of {', '.join(SPEC_TYPES)})")
    if spec_type == "auto":  # the draft model and prompt lookup where there is a draft
        return "draft+ngram" if draft else "none"
    if spec_type in MODEL_SPEC_TYPES and not draft:
        raise SpecTypeError(f"--spec-type {spec_type} needs a draft model (-md)")
    return spec_type


def make_drafter(spec_type: str, inputs: DrafterInputs) -> Drafter | None:
    """The drafter of a resolved spec type (None for `none`)."""
    if spec_type == "none":
        return None
    spec = SPEC_TYPE_REGISTRY.get(spec_type)
    if spec is None:
        raise SpecTypeError(f"unknown spec type {spec_type!r} (one of {', '.join(SPEC_TYPES)})")
    if spec.loads_draft_model and inputs.draft_runner is None:
        raise SpecTypeError(f"spec type {spec_type} needs a draft model")
    return spec.build(inputs)
