"""Speculation types: each name maps to the factory of its drafter.

The engine, the CLI and the bench all build drafters here. `auto` and `none` are not
drafters: `auto` resolves by the draft file (`-md`): a head (its kind recognised from its
metadata, `ort_models.heads.head_kind`) to its type (`draft-dflash`, `draft-dspark`,
`draft-dflash2`, `draft-eagle3`), a draft model to `draft+ngram`, a head and a draft model
(two draft files) to `head+draft`, no draft to `none`. Prompt lookup offers its proposals
in front of a model or a head. Where the engine keeps a history (`DrafterInputs.history`),
every drafter gets the history source's offer beside its own (history.py `WithHistory`);
`none` stays target-only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specd.daemon.spec.drafter import Drafter
from specd.ort_models.head_runner import HeadRunner
from specd.ort_models.runner import ModelRunner

from .composite import CompositeDrafter
from .dflash import DFlash2Drafter, DFlashDrafter
from .draft_model import DraftModelDrafter
from .eagle3 import Eagle3Drafter
from .history import HistoryDrafter, WithHistory
from .ngram import NgramDrafter
from .synthetic import SyntheticDrafter

HEAD_AND_MODEL = "head+draft"  # the spec type of two draft files: a head and a model


class SpecTypeError(ValueError):
    """An unknown speculation type, or one whose needs are not met (message for the user)."""


@dataclass(frozen=True)
class DrafterInputs:
    """What a drafter may be built from."""

    draft_runner: ModelRunner | None = None  # the draft model, for the types that load one
    head_runner: HeadRunner | None = None  # the drafter head, for the types that load one
    target_vocab: int | None = None  # the target's vocabulary size (drafts propose below it)
    ngram_min: int = 2
    ngram_max: int = 4
    synthetic_rates: Sequence[float] | None = None
    synthetic_mean: float | None = None
    synthetic_seed: int = 0
    n_max: int = 8  # the longest draft (synthetic rates for a mean length)
    # the history source, offered in front of the drafter (None: no history)
    history: HistoryDrafter | None = None


@dataclass(frozen=True)
class SpecType:
    name: str
    loads_draft_model: bool  # the draft file (-md) is loaded: a model, or a head
    build: Callable[[DrafterInputs], Drafter]
    head_kind: str | None = None  # the kind of head the draft file must be (None: a model)
    chains_lookup: bool = False  # prompt lookup offers its proposals in front of the draft
    # other spec types' names that mean this one for a file of its head kind (llama.cpp
    # names no DFlash2 type: its draft-dflash runs DFlash2 heads)
    also_named: tuple[str, ...] = ()
    # loads two draft files, a head and a draft model (head_kind: any the registry runs)
    loads_head_and_model: bool = False


def _model(inputs: DrafterInputs) -> DraftModelDrafter:
    assert inputs.draft_runner is not None
    return DraftModelDrafter(inputs.draft_runner, vocab_limit=inputs.target_vocab)


# each head kind's drafter (DSpark heads draft a DFlash block; llama.cpp's draft-dflash
# runs DFlash2 heads too)
HEAD_DRAFTERS: dict[str, Callable[[HeadRunner], Drafter]] = {
    "dflash": DFlashDrafter, "dspark": DFlashDrafter, "dflash2": DFlash2Drafter,
    "eagle3": Eagle3Drafter}


def _head(inputs: DrafterInputs) -> Drafter:
    """The drafter of the loaded head's kind."""
    assert inputs.head_runner is not None
    return HEAD_DRAFTERS[inputs.head_runner.built.head.kind](inputs.head_runner)


def _model_with_lookup(inputs: DrafterInputs) -> CompositeDrafter:
    """A draft model, with prompt lookup in front."""
    return CompositeDrafter("draft+ngram", [_model(inputs)], _ngram(inputs))


def _head_with_lookup(inputs: DrafterInputs) -> CompositeDrafter:
    """A head, with prompt lookup in front."""
    head = _head(inputs)
    return CompositeDrafter(f"{head.name}+ngram", [head], _ngram(inputs))


def _head_and_model(inputs: DrafterInputs) -> CompositeDrafter:
    """A head and a draft model, each round drafting with one, prompt lookup in front."""
    return CompositeDrafter(HEAD_AND_MODEL, [_head(inputs), _model(inputs)], _ngram(inputs))


def _ngram(inputs: DrafterInputs) -> NgramDrafter:
    return NgramDrafter(min_ngram=inputs.ngram_min, max_ngram=inputs.ngram_max)


def _synthetic(inputs: DrafterInputs) -> SyntheticDrafter:
    return SyntheticDrafter(inputs.synthetic_rates, mean_length=inputs.synthetic_mean,
                            n_max=inputs.n_max, seed=inputs.synthetic_seed)


SPEC_TYPE_REGISTRY: dict[str, SpecType] = {s.name: s for s in (
    SpecType("draft", True, _model),
    SpecType("ngram", False, _ngram),
    SpecType("draft+ngram", True, _model_with_lookup, chains_lookup=True),
    SpecType("synthetic", False, _synthetic),
    SpecType("draft-dflash", True, _head_with_lookup, head_kind="dflash", chains_lookup=True),
    SpecType("draft-dspark", True, _head_with_lookup, head_kind="dspark", chains_lookup=True),
    SpecType("draft-dflash2", True, _head_with_lookup, head_kind="dflash2",
             chains_lookup=True, also_named=("draft-dflash",)),
    SpecType("draft-eagle3", True, _head_with_lookup, head_kind="eagle3", chains_lookup=True),
    SpecType(HEAD_AND_MODEL, True, _head_and_model, chains_lookup=True,
             loads_head_and_model=True),
)}
SPEC_TYPES = ("auto", "none", *SPEC_TYPE_REGISTRY)
# the spec types that load a draft model
MODEL_SPEC_TYPES = tuple(n for n, s in SPEC_TYPE_REGISTRY.items() if s.loads_draft_model)


def check_spec_type(spec_type: str, draft: str | None) -> None:
    """An unknown spec type, or one that needs a draft file without one, is refused."""
    if spec_type not in SPEC_TYPES:
        raise SpecTypeError(f"unknown spec type {spec_type!r} (one of {', '.join(SPEC_TYPES)})")
    if spec_type in MODEL_SPEC_TYPES and not draft:
        raise SpecTypeError(f"--spec-type {spec_type} needs a draft model (-md)")


def _head_spec_type(draft: str | None, draft_kind: str) -> str:
    """The spec type that runs a `draft_kind` head (`draft`: its file, named in the error
    where specd runs no such head)."""
    spec_type = next((n for n, s in SPEC_TYPE_REGISTRY.items() if s.head_kind == draft_kind),
                     None)
    if spec_type is None:
        raise SpecTypeError(f"{draft} is a {draft_kind} drafter head, which specd does not "
                            "run yet (it runs "
                            + ", ".join(s.head_kind for s in SPEC_TYPE_REGISTRY.values()
                                        if s.head_kind) + " heads)")
    return spec_type


def resolve_spec_type(spec_type: str, draft: str | None, draft_kind: str | None = None,
                      head_and_model: bool = False) -> str:
    """The spec type to run: `auto` resolved by the draft file's kind (`head_kind`: None for
    a draft model; `head_and_model`: two draft files were given, a head, `draft`, and a
    draft model), a type that needs another kind of draft file refused, and a head of a
    kind specd does not run."""
    check_spec_type(spec_type, draft)
    if head_and_model:
        if draft_kind is not None:
            _head_spec_type(draft, draft_kind)
        if spec_type in ("auto", HEAD_AND_MODEL):
            return HEAD_AND_MODEL
        raise SpecTypeError(f"--spec-type {spec_type} runs one draft file, and -md names "
                            f"a head and a draft model (both run as {HEAD_AND_MODEL})")
    if spec_type == HEAD_AND_MODEL:
        raise SpecTypeError(f"--spec-type {HEAD_AND_MODEL} needs a head and a draft model: "
                            "-md twice")
    if spec_type == "auto":
        if not draft:
            return "none"
        if draft_kind is None:  # a draft model, with prompt lookup in front
            return "draft+ngram"
        return _head_spec_type(draft, draft_kind)
    named = next((n for n, s in SPEC_TYPE_REGISTRY.items()
                  if spec_type in s.also_named and s.head_kind == draft_kind), None)
    if named is not None:
        return named
    spec = SPEC_TYPE_REGISTRY.get(spec_type)
    if spec is not None and spec.loads_draft_model and spec.head_kind != draft_kind:
        what = "a draft model" if draft_kind is None else f"a {draft_kind} head"
        want = "a draft model" if spec.head_kind is None else f"a {spec.head_kind} head"
        raise SpecTypeError(f"--spec-type {spec_type} needs {want}, and {draft} is {what} "
                            "(--spec-type auto picks by the file)")
    return spec_type


def make_drafter(spec_type: str, inputs: DrafterInputs) -> Drafter | None:
    """The drafter of a resolved spec type (None for `none`), with the history source in
    front where `inputs` has one (not for a drafter that decides acceptance itself)."""
    drafter = _make_drafter(spec_type, inputs)
    if drafter is None or inputs.history is None or drafter.decides_acceptance:
        return drafter
    return WithHistory(drafter, inputs.history)


def _make_drafter(spec_type: str, inputs: DrafterInputs) -> Drafter | None:
    if spec_type == "none":
        return None
    spec = SPEC_TYPE_REGISTRY.get(spec_type)
    if spec is None:
        raise SpecTypeError(f"unknown spec type {spec_type!r} (one of {', '.join(SPEC_TYPES)})")
    if spec.loads_head_and_model:
        if inputs.head_runner is None or inputs.draft_runner is None:
            raise SpecTypeError(f"spec type {spec_type} needs a head and a draft model")
        return spec.build(inputs)
    loaded = inputs.draft_runner if spec.head_kind is None else inputs.head_runner
    if spec.loads_draft_model and loaded is None:
        raise SpecTypeError(f"spec type {spec_type} needs a draft "
                            + ("model" if spec.head_kind is None else f"{spec.head_kind} head"))
    return spec.build(inputs)
