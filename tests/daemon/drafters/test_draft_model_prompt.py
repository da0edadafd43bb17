"""A draft model evaluates a sequence's prompt only when the sequence first drafts, as
that draft's catch-up: nothing at `begin`, the prompt rows pending (and priced by the step
planner) until then, fed in chunks no call of the runner refuses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.ort_models import native_ops
from specd.ort_models.graph_builder import ATTN_BUCKET, BuildOptions
from specd.ort_models.model_cache import BuiltModel, load_or_build
from specd.ort_models.runner import Call, CallOutput, ModelRunner

from speculation_checks import assert_speculated, decode_all

PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]
LONG = [int(t) for t in np.random.default_rng(0).integers(3, 340, 300)]  # past a bucket


@pytest.fixture(scope="module")
def models(tiny_model_factory: Callable[..., Path]) -> tuple[BuiltModel, BuiltModel]:
    target = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, context_length=1024)
    draft = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, perturb=0.01,
                               context_length=1024)
    return load_or_build(target), load_or_build(draft)


class Spied:
    """A draft runner's calls, (tokens, pos) each, as its passes and prefills ran them."""

    def __init__(self, runner: ModelRunner) -> None:
        self.calls: list[tuple[int, int]] = []
        self.passes: list[list[int]] = []  # the sequences of each pass
        self.prefills = 0
        forward, prefill = runner.forward_batch, runner.prefill

        def forward_batch(calls: Sequence[Call]) -> list[CallOutput]:
            self.calls.extend((len(c.tokens), c.pos) for c in calls)
            self.passes.append([c.seq for c in calls])
            return forward(calls)

        def counted_prefill(*args: Any, **kw: Any) -> np.ndarray:
            self.prefills += 1
            return prefill(*args, **kw)

        runner.forward_batch = forward_batch  # type: ignore[method-assign]
        runner.prefill = counted_prefill  # type: ignore[method-assign]


def _generation(target: BuiltModel, drafter: DraftModelDrafter | None,
                prompt: Sequence[int] = PROMPT, n_max: int = 4, max_tokens: int = 32
                ) -> Generation:
    return Generation(ModelRunner(target, n_ctx=1024), 0, prompt, GenerationParams(
        max_tokens=max_tokens, ignore_eos=True, draft=DraftParams(n_max=n_max)),
        eog=set(), drafter=drafter)


def test_the_prompt_waits_for_the_first_draft(models: tuple[BuiltModel, BuiltModel]
                                              ) -> None:
    """After the target's prefill the draft model has run nothing and reports the prompt
    pending (what the planner prices); the first draft's first call is the prompt and the
    first token, and the rounds draft and are accepted as before."""
    target, draft = models
    want = decode_all(_generation(target, None))
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=1024))
    spied = Spied(drafter.runner)
    gen = _generation(target, drafter)
    out = gen.prefill()
    assert spied.calls == [] and spied.prefills == 0
    assert drafter.pending_rows(0) == len(PROMPT)
    out += gen.step()
    assert spied.calls[0] == (len(PROMPT) + 1, 0)  # the prompt, then the first token
    assert drafter.pending_rows(0) == 0
    while not gen.done:
        out += gen.step()
    gen.close()
    assert out == want and spied.prefills == 0
    assert min(pos for _, pos in spied.calls[1:]) >= len(PROMPT)  # evaluated once
    assert_speculated(gen.stats)


def test_the_planner_prices_the_pending_prompt_as_catch_up(
        models: tuple[BuiltModel, BuiltModel]) -> None:
    """A sequence's outlook counts the prompt rows its draft model has yet to run among
    the rows its first draft catches up on, and none once it has drafted."""
    from specd.daemon.spec.policy import AdaptiveDraftLength

    target, draft = models
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=1024))
    gen = Generation(ModelRunner(target, n_ctx=1024), 0, PROMPT, GenerationParams(
        max_tokens=32, ignore_eos=True, draft=DraftParams(n_max=4), adaptive=True),
        eog=set(), drafter=drafter)
    gen.prefill()
    assert isinstance(gen.policy, AdaptiveDraftLength)
    gen.policy.observe_verify(1, 0.01)  # a target pass measured: the policy has estimates
    outlook = gen.outlook()
    assert outlook is not None and outlook.drafter is drafter
    assert outlook.catch_up == len(PROMPT)
    while not drafter._seqs[0].drafted and gen.stats.rounds == 0 and not gen.done:
        gen.step()
    after = gen.outlook()
    assert gen.stats.rounds > 0 and after is not None and after.catch_up < len(PROMPT)


def test_a_sequence_that_never_drafts_never_runs_its_prompt_on_the_draft(
        models: tuple[BuiltModel, BuiltModel]) -> None:
    target, draft = models
    want = decode_all(_generation(target, None, max_tokens=16))
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=1024))
    spied = Spied(drafter.runner)
    gen = _generation(target, drafter, n_max=0, max_tokens=16)
    assert decode_all(gen) == want
    assert spied.calls == [] and spied.prefills == 0
    assert gen.stats.rounds == 0


def test_a_long_prompt_runs_in_bucket_chunks(models: tuple[BuiltModel, BuiltModel]) -> None:
    """A prompt past an attention bucket: the first draft runs it in calls that end on
    the bucket's boundary, as the target's prefill does, and only the last one drafts."""
    target, draft = models
    want = decode_all(_generation(target, None, prompt=LONG, max_tokens=24))
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=1024))
    spied = Spied(drafter.runner)
    gen = _generation(target, drafter, prompt=LONG, max_tokens=24)
    assert decode_all(gen) == want
    assert spied.calls[:2] == [(ATTN_BUCKET, 0), (len(LONG) + 1 - ATTN_BUCKET, ATTN_BUCKET)]
    assert_speculated(gen.stats)


def test_a_follow_up_reuses_the_drafts_cached_prefix(models: tuple[BuiltModel, BuiltModel]
                                                     ) -> None:
    """The next request on the slot, sharing the prompt: its first draft runs only what
    the cache lacks. A request that never drafted leaves the cache as it found it."""
    target, draft = models
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=1024))
    first = decode_all(_generation(target, drafter, max_tokens=16))
    spied = Spied(drafter.runner)
    decode_all(_generation(target, drafter, prompt=PROMPT + first[:4], n_max=0))
    assert spied.calls == []
    longer = PROMPT + first[:8]
    gen = _generation(target, drafter, prompt=longer, max_tokens=16)
    decode_all(gen)
    # the middle request's prompt was cached whole: the first draft runs the four tokens
    # past it and the first token
    assert spied.calls[0] == (5, len(PROMPT) + 4)
    assert_speculated(gen.stats)


@pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels are off")
def test_a_sliding_window_draft_gets_chunks_its_ring_takes(
        tiny_model_factory: Callable[..., Path]) -> None:
    """A draft model whose sliding-window layers keep a ring (specd's attention): a prompt
    longer than the ring's call rows runs in calls it accepts, and the output is the
    target's."""
    gemma: dict[str, Any] = {"arch": "gemma3", "n_layer": 4, "head_dim": 32,
                             "sliding_window": 5, "swa_pattern": 2,
                             "rope_freq_base_swa": 10000.0, "weight_type": "Q8_0",
                             "seed": 1, "context_length": 1024}
    native = BuildOptions(kernels="gguf", attention="native", kv_dtype="f16")
    target = load_or_build(tiny_model_factory(**gemma))
    draft = load_or_build(tiny_model_factory(**gemma, perturb=0.05), native)
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=1024))
    assert drafter.runner.ring  # the draft's window layers keep rings
    spied = Spied(drafter.runner)
    want = decode_all(_generation(target, None, prompt=LONG, max_tokens=24))
    gen = _generation(target, drafter, prompt=LONG, max_tokens=24)
    assert decode_all(gen) == want
    assert max(n for n, _ in spied.calls) <= drafter.runner.max_call_rows
    assert sum(n for n, pos in spied.calls if pos < len(LONG)) == len(LONG) + 1
    assert_speculated(gen.stats)


def test_the_first_drafts_evidence_names_the_prompt_rows(models: tuple[BuiltModel, BuiltModel]
                                                         ) -> None:
    """The policy is told that the first draft's call ran the prompt (its time is no
    steady draft's, nor a skipped token's catch-up); later drafts ran none."""
    target, _ = models
    want = decode_all(_generation(target, None, max_tokens=8))
    drafter = DraftModelDrafter(ModelRunner(target, n_ctx=1024))  # the target as its draft
    drafter.begin(0, PROMPT)
    d = drafter.draft(0, want[0], len(PROMPT), 2, DraftParams(n_max=2))
    assert d.tokens == want[1:3]
    assert d.evidence.prompt_rows == len(PROMPT) and d.evidence.includes_catch_up
    assert d.evidence.guess_checks == ()  # prompt rows check no guesses
    drafter.accept(0, 2)
    drafter.process(0, [want[0], *d.tokens])
    d2 = drafter.draft(0, want[3], len(PROMPT) + 3, 2, DraftParams(n_max=2))
    assert d2.tokens == want[4:6] and d2.evidence.prompt_rows == 0


def test_a_batch_drafts_beside_a_sequence_still_running_its_prompt(
        models: tuple[BuiltModel, BuiltModel]) -> None:
    """One proposal call for two sequences: the one whose long prompt is pending runs its
    chunks in the passes where the other drafts, then drafts itself; each proposal is its
    solo one (the target as its own draft: the target's tokens)."""
    from specd.daemon.spec.drafter import DraftRequest

    target, _ = models
    long_want = decode_all(_generation(target, None, prompt=LONG, max_tokens=6))
    short_want = decode_all(_generation(target, None, max_tokens=6))
    drafter = DraftModelDrafter(ModelRunner(target, n_ctx=1024))
    spied = Spied(drafter.runner)
    drafter.begin(0, LONG)
    drafter.begin(1, PROMPT)
    short_first = drafter.draft(1, short_want[0], len(PROMPT), 1, DraftParams(n_max=1))
    drafter.accept(1, 1)
    drafter.process(1, [short_want[0], *short_first.tokens])
    spied.calls.clear()
    spied.passes.clear()
    long_p, short_p = drafter.propose([
        DraftRequest(0, long_want[0], len(LONG), 4, DraftParams(n_max=4)),
        DraftRequest(1, short_want[2], len(PROMPT) + 2, 3, DraftParams(n_max=3))])
    assert long_p.tokens == long_want[1:5] and short_p.tokens == short_want[3:6]
    assert long_p.evidence.prompt_rows == len(LONG) and short_p.evidence.prompt_rows == 0
    # passes: the long prompt's first chunk beside the short draft's first step, then its
    # last chunk with the first token, then draft steps
    assert spied.passes[:2] == [[0, 1], [0, 1]]
    assert spied.calls[0] == (ATTN_BUCKET, 0)
    assert spied.calls[2] == (len(LONG) + 1 - ATTN_BUCKET, ATTN_BUCKET)


def test_a_prompt_past_the_drafts_context_is_refused_at_begin(
        models: tuple[BuiltModel, BuiltModel]) -> None:
    """Where the prompt cannot fit the draft's context the drafter says so when the
    sequence starts (Generation then goes on without it), not by never drafting."""
    from specd.ort_models.runner import ContextFull

    _, draft = models
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=256))
    with pytest.raises(ContextFull, match="300 tokens does not fit in the draft model's"):
        drafter.begin(0, LONG)
