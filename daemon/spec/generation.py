"""One request's decode: prefill, then one speculative round per step.

A round's phases (plan → propose → forward → verify → commit → observe) are driven for
a batch by round.py, whose docstring states their invariants; a Generation holds one
sequence's part of each. Prefill and round are split at the target's pass, so that a step
runs several sequences' calls in one: `prefill_call()`, or `plan_round()` (the draft it
asks of its source) and `round_call()` (given that proposal), do everything up to it and
return the `Call`; `complete()` verifies, commits and emits with the pass's output. A
round drafts at most `invariant_block_limit(pos) - 1` tokens, so that every verified row
equals the single step at its position (ort_models/runner.py), and prefill passes end on
attention-bucket boundaries. A seeded request's drafts are coupled to the target's draws
(coupling.py); where the target's graph samples, verification runs there
(graph_sampling.py). A drafter's exception is logged and counted and the request goes on
target-only (with SPECD_RAISE_DRAFTER_ERRORS=1 it fails the request instead).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specd.daemon.text.grammar import GrammarState
from specd.ort_models.graph_builder import ATTN_BUCKET
from specd.ort_models.runner import Call, CallOutput, ModelRunner
from specd.ort_models.sampling_op import MAX_LOGPROBS, EmittedLogprobs, SampleSpec

from .batch_policy import Outlook
from .coupling import CoupledSampler
from .drafter import Drafter, DraftParams, DraftRequest, Features, Proposal
from .graph_sampling import (
    BONUS_CANDIDATES,
    block_result,
    runs_in_graph,
    sample_spec,
    sparse_q,
)
from .logprobs import LogprobRecorder
from .media import (
    PromptImage,
    check_images,
    chunk_end,
    image_at,
    is_placeholder,
    mrope_positions,
    outside_images,
)
from .policy import (
    AdaptiveDraftLength,
    DraftPolicy,
    FixedDraftLength,
    ModelCall,
    PolicyMemory,
    RoundPlan,
    RoundRecord,
    SourceTraits,
)
from .round import BatchRound, DraftJob
from .sampling import (
    Sampler,
    SamplerParams,
    SamplerVocab,
    TokenLogprob,
    derive_seeds,
)
from .stats import SpecStats
from .verify import VerifyResult, verify_greedy, verify_rejection

# prompt tokens (cached, processed so far, in all) before the first chunk and after each
PromptProgress = Callable[[int, int, int], None]

log = logging.getLogger("specd.generation")

# set to 1 (the test suite sets it), a drafter's exception fails its request instead of
# being logged and counted while the request goes on target-only: a broken drafter then
# fails its test
RAISE_DRAFTER_ERRORS = "SPECD_RAISE_DRAFTER_ERRORS"


def drafter_errors_raise() -> bool:
    return os.environ.get(RAISE_DRAFTER_ERRORS, "") == "1"


class RequestError(ValueError):
    """A request that cannot be served as asked (message for the client)."""


def check_prompt_fits(prompt: Sequence[int], n_ctx: int) -> None:
    """A prompt must leave room for at least one generated token."""
    if not prompt:
        raise RequestError("the prompt is empty")
    room = n_ctx - 1
    if len(prompt) > room:
        raise RequestError(f"the prompt is {len(prompt)} tokens long but the context "
                           f"holds {n_ctx}: at most {room} prompt tokens fit")


def causal_images(target: ModelRunner) -> bool:
    """Whether the target's image rows are causal (gemma3's see the whole image)."""
    emb = target.embeddings_runner
    return emb is None or emb.built.options.causal


def check_prompt_images(target: ModelRunner, prompt: Sequence[int],
                        images: Sequence[PromptImage]) -> None:
    """RequestError unless the target takes these images: a graph taking embeddings of
    its width, each image at its placeholders, and an image not causal within itself
    no longer than one call."""
    emb = target.embeddings_runner
    if emb is None:
        raise RequestError(f"{target.built.gguf_path.name} takes no images: start it with "
                           "--mmproj, the vision projector of its family")
    try:
        check_images(prompt, images)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    for im in images:
        if im.embeddings.shape[1] != target.hp.n_embd:
            raise RequestError(f"an image's embeddings are {im.embeddings.shape[1]} wide, "
                               f"the model's {target.hp.n_embd}: the projector does not fit "
                               "the model")
        if target.takes_rope_positions and im.chunk.grid is None:
            raise RequestError(f"{target.built.gguf_path.name} places an image's tokens on "
                               "their grid (M-RoPE): an image needs its grid")
        if not causal_images(target) and im.chunk.n_tokens > emb.max_call_rows:
            raise RequestError(f"an image of {im.chunk.n_tokens} tokens exceeds the "
                               f"{emb.max_call_rows} rows one call evaluates")


def rope_positions(target: ModelRunner, images: Sequence[PromptImage], start: int,
                   end: int) -> np.ndarray | None:
    """The M-RoPE positions [4, end - start] of KV rows start..end-1 where they are not
    the runner's default, else None: on an M-RoPE target the rows after an image are not
    at their KV positions, so every call of a prompt with images gives its rows'."""
    return (mrope_positions(images, start, end)
            if images and target.takes_rope_positions else None)


def prompt_chunk(target: ModelRunner, seq: int, prompt: Sequence[int],
                 images: Sequence[PromptImage], start: int, end: int,
                 layers: tuple[int, ...]) -> Call:
    """The target call evaluating the prompt chunk of sequence `seq` from `start`, ending
    by `end` and within start's bucket (so prefill is the same computation whoever runs
    it), an image's rows by themselves from its embeddings (chunk_end), with their
    M-RoPE positions where the target takes them."""
    end = chunk_end(images, start, min(end, start - start % ATTN_BUCKET + ATTN_BUCKET),
                    whole_images=not causal_images(target))
    image = image_at(images, start)
    return Call(seq, prompt[start:end], start, None, layers,
                embeds=None if image is None
                else image.embeddings[start - image.start:end - image.start],
                rope_positions=rope_positions(target, images, start, end))


def prompt_calls(target: ModelRunner, seq: int, prompt: Sequence[int],
                 images: Sequence[PromptImage], layers: tuple[int, ...]) -> list[Call]:
    """The calls evaluating a whole prompt holding `images` from position 0 of `seq`, as
    a Generation's prefill chunks it with no budget; RequestError unless the target
    takes these images."""
    check_prompt_images(target, prompt, images)
    calls: list[Call] = []
    start = 0
    while start < len(prompt):
        calls.append(prompt_chunk(target, seq, prompt, images, start, len(prompt), layers))
        start += len(calls[-1].tokens)
    return calls


@dataclass
class GenerationParams:
    max_tokens: int = 256
    sampling: SamplerParams = field(default_factory=lambda: SamplerParams(temperature=0.0))
    draft: DraftParams = field(default_factory=DraftParams)
    adaptive: bool = False
    draft_top_k: int = 10  # q is the draft's top-k, renormalised, at the request temperature
    ignore_eos: bool = False
    # each emitted token's logprob under the target's logits and the `logprobs` most
    # likely tokens' (None: not recorded)
    logprobs: int | None = None
    # those logprobs from the distribution each token was drawn from instead (after the
    # sampler's bias, penalties, filters, temperature and the grammar's mask: llama.cpp's
    # post_sampling_probs)
    post_sampling_probs: bool = False
    # decide tokens in the target's (and the draft's) graph where it has a sampler
    # (graph_sampling): only token ids and a few probabilities leave the session
    backend_sampling: bool = True
    # sampled drafts drawn with the target's noise and kept where the target's own draw
    # equals them (spec/coupling.py): the output is target-only decoding's for the seed,
    # whatever is drafted. None: for seeded requests; False: rejection sampling
    coupled: bool | None = None

    @property
    def couples_drafts(self) -> bool:
        """Whether sampled drafts are coupled to the target's draws."""
        sp = self.sampling
        if sp.is_greedy or not self.draft.probabilistic:
            return False
        return sp.seed is not None if self.coupled is None else self.coupled


def make_policy(params: GenerationParams, drafter: Drafter | None) -> DraftPolicy:
    """The request's draft-length policy: adaptive, or n_max every round (always for a
    drafter that decides acceptance itself: there is nothing to learn from it, and its
    configured rates are the point)."""
    dp = params.draft
    if params.adaptive and not (drafter is not None and drafter.decides_acceptance):
        sources = () if drafter is None else tuple(
            SourceTraits(d.one_pass, d.catch_up) for d in drafter.model_sources)
        return AdaptiveDraftLength(dp.n_max, n_min=dp.n_min, sources=sources,
                                   free_max=dp.free_limit)
    return FixedDraftLength(dp.n_max, n_min=dp.n_min)


@dataclass
class _Proposed:
    """The propose step's outcome: the proposal to verify, and what the policy learns."""

    proposal: Proposal
    model_call: ModelCall | None = None
    offer_next: int | None = None  # the offer's token after those kept (all of them kept)
    seconds: float = 0.0  # what proposing cost this sequence (its share of shared passes)


@dataclass
class _PrefillChunk:
    """A pending prompt chunk: the cursor once its KV is in."""

    end: int


@dataclass
class _Planned:
    """A planned round waiting for its proposal: the plan, the offer it weighed, what
    planning cost, and the model draft it asked for (None: none)."""

    plan: RoundPlan
    offer: Proposal | None
    seconds: float
    job: DraftJob | None


@dataclass
class _Round:
    """A pending round: its proposal, and what planning and proposing cost."""

    proposed: _Proposed
    seconds: float


class Generation:
    """State of one sequence slot while it generates."""

    def __init__(self, target: ModelRunner, seq: int, prompt: Sequence[int],
                 params: GenerationParams, *, eog: set[int], drafter: Drafter | None = None,
                 reuse: int = 0, grammar: GrammarState | None = None,
                 on_prompt_progress: PromptProgress | None = None,
                 memory: PolicyMemory | None = None,
                 images: Sequence[PromptImage] = (), vocab: SamplerVocab | None = None):
        """on_prompt_progress: told the prompt's progress (called on the caller's thread);
        memory: an adaptive policy starts from the last finished request's of the same
        drafter, and is kept there when this one closes; images: the prompt's images, at
        their placeholders (media.py), evaluated from their embeddings; vocab: the
        target's vocabulary, for a sampler chain with infill or DRY."""
        check_prompt_fits(prompt, target.n_ctx)
        self.images = tuple(images)
        if self.images or any(is_placeholder(t) for t in prompt):
            check_prompt_images(target, prompt, self.images)
            reuse = outside_images(self.images, reuse)
        params.sampling.validate()
        params.draft.validate()
        if drafter is not None and drafter.target_layers:
            missing = set(drafter.target_layers) - set(target.feature_layers)
            if missing:
                raise ValueError(f"drafter {drafter.name} reads the target's layers "
                                 f"{sorted(missing)}, which its graph does not output")
        # the runner, let go at close (an unloaded model's memory is not kept by a
        # finished request whose result is still being sent)
        self._target: ModelRunner | None = target
        self.seq, self.params = seq, params
        self.prompt = list(prompt)
        self.eog = set() if params.ignore_eos else set(eog)
        self.drafter = drafter
        self._failed_drafter: Drafter | None = None  # dropped after raising (still ended)
        self.grammar = grammar  # the request's constraint state (advanced on emitted tokens)
        t_seed, d_seed = derive_seeds(params.sampling.seed)
        # the penalties and DRY see the prompt's text before the reply, as llama-server's
        # samplers accept every prompt token (not an image's positions)
        self.sampler = Sampler(params.sampling, seed=t_seed, vocab=vocab,
                               history=[t for t in prompt if not is_placeholder(t)],
                               position=len(prompt))
        # tokens decided in the target's graph (logprobs are computed on the host from
        # the logits, which then leave the session too), where it runs the request's chain
        self.in_graph = (params.backend_sampling and target.samples
                         and runs_in_graph(params.sampling))
        self.coupled = drafter is not None and params.couples_drafts
        self.draft_sampler = self._make_draft_sampler(d_seed)
        self.policy = make_policy(params, drafter)
        # where this request's policy starts from, and where close() leaves it
        self._memory: PolicyMemory | None = None
        if memory is not None and drafter is not None and params.adaptive:
            memory.start(drafter.name, self.policy)
            self._memory = memory
        # a fully cached prompt still evaluates its last token (its logits are needed)
        self.stats = SpecStats(prompt_tokens=len(prompt),
                               cached_tokens=min(reuse, max(len(prompt) - 1, 0)))
        self.tokens: list[int] = []  # generated
        self.token_logprobs: list[TokenLogprob] = []  # one per generated token, if asked for
        self.finish_reason: str | None = None
        self._reuse = reuse
        self._last: int | None = None
        self._pos = 0
        self._cursor: int | None = None
        self._prompt_features: dict[int, list[np.ndarray]] = {}
        # the target's distribution [vocab] of the last round's bonus token (None: the
        # round did not end on one, or greedy)
        self._bonus_p: np.ndarray | None = None
        self._t_decode = time.perf_counter()
        # the step under way: a prompt chunk or a round, once its call is out; a round
        # waiting for its proposal
        self._pending: _PrefillChunk | _Planned | _Round | None = None
        self._offered: tuple[int, Proposal | None] | None = None  # (position, offer)
        self._on_progress = on_prompt_progress
        self._logprobs = None if params.logprobs is None else LogprobRecorder(
            params.logprobs, self.sampler, post_sampling=params.post_sampling_probs,
            grammar=grammar)

    def _make_draft_sampler(self, seed: int) -> Sampler | None:
        """q's sampler: the draft's top-k at the temperature the request's chain applies,
        after the request's logit bias and penalties (over the same emitted tokens as p's),
        so that q stays near p; drawing the target's uniforms where drafts are coupled
        (None: greedy). Verification is against p, the whole chain's distribution, so q
        need not follow the rest of the chain."""
        sp = self.params.sampling
        if sp.is_greedy:
            return None
        q = SamplerParams(temperature=sp.effective_temperature, top_k=self.params.draft_top_k,
                          seed=seed,
                          repeat_penalty=sp.repeat_penalty, repeat_last_n=sp.repeat_last_n,
                          presence_penalty=sp.presence_penalty,
                          frequency_penalty=sp.frequency_penalty, logit_bias=sp.logit_bias)
        if self.coupled:
            return CoupledSampler(q, self.sampler)
        return Sampler(q, seed=seed, history=self.sampler.history)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def reused(self) -> int:
        """Prompt tokens whose KV an earlier request left (never part of an image)."""
        return self._reuse

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def evaluated_tokens(self) -> list[int]:
        """Tokens whose KV the target's cache holds for this sequence, in order (while the
        prompt is being evaluated: the reused prefix and the chunks done so far)."""
        if not self._pos:
            return self.prompt[: self._reuse if self._cursor is None else self._cursor]
        if not self.stats.valid:  # synthetic acceptance: drafts' rows hold no real KV
            return self.prompt[: self._pos]
        return self.all_tokens[: self._pos]

    @property
    def _layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads."""
        return () if self.drafter is None else self.drafter.target_layers

    # -- prefill --------------------------------------------------------------------------
    @property
    def prefilled(self) -> bool:
        return self._last is not None or self.done

    def prefill(self, budget: int | None = None) -> list[int]:
        """Evaluate the prompt (after any reused prefix), at most `budget` tokens per call.

        Returns [] while prompt remains, then the first generated token. A budgeted call
        stops at the last attention-bucket boundary within its budget (at the budget when
        none is in reach); every pass ends at a bucket boundary too: with budgets of a
        bucket or more the passes are those of one unbudgeted prefill, so the KV is the
        same however the prompt is split.
        """
        out: list[int] = []
        while not self.prefilled:
            call = self.prefill_call(budget)
            if call is None:
                break
            out = self.complete(self.target.forward_batch([call])[0])
            if budget is not None:
                break
        return out

    def prefill_call(self, budget: int | None = None) -> Call | None:
        """The target call of the next prompt chunk (None: done): from the cursor to the
        budget's last bucket boundary (the budget where none is in reach), within one
        bucket; `complete` must follow."""
        if self._pending is not None:
            raise RuntimeError("the previous call was not completed")
        if self.done:
            return None
        if self.prefilled:
            raise RuntimeError("the prompt is already evaluated")
        if self._cursor is None:
            self._cursor = outside_images(self.images, min(self._reuse, len(self.prompt) - 1))
            if self._on_progress is not None:
                self._on_progress(self._cursor, self._cursor, len(self.prompt))
        start = self._cursor
        end = len(self.prompt)
        if budget is not None and start + budget < end:
            cut = start + budget
            boundary = cut - cut % ATTN_BUCKET
            end = boundary if boundary > start else cut
        call = prompt_chunk(self.target, self.seq, self.prompt, self.images, start, end,
                            self._layers)
        end = start + len(call.tokens)
        self._pending = _PrefillChunk(end)
        if end == len(self.prompt) and self.params.max_tokens > 0 and call.embeds is None:
            call = replace(call, sample=self._spec(len(self.prompt)))
        return call

    def _complete_prefill(self, chunk: _PrefillChunk, out: CallOutput) -> list[int]:
        """The chunk's KV is in: keep the drafter's features; after the last chunk, start
        the drafter and sample the first token from the prompt's last logits."""
        t0 = time.perf_counter()
        self.stats.prefill_s += out.seconds
        for layer, rows in out.features.items():
            self._prompt_features.setdefault(layer, []).append(rows)
        self._cursor = chunk.end
        if self._on_progress is not None:
            self._on_progress(self.stats.cached_tokens, chunk.end, len(self.prompt))
        if chunk.end < len(self.prompt):
            return []
        logits = out.logits[0]  # [vocab]
        self._begin_drafter()
        # what the drafter does with the prompt is prompt processing too (it precedes the
        # first token), not decoding
        self.stats.prefill_s += time.perf_counter() - t0
        self._pos = len(self.prompt)
        self._t_decode = time.perf_counter()
        if self.params.max_tokens <= 0:  # evaluate (and cache) the prompt only
            self.finish("length")
            return []
        if self._grammar_finished():
            return []
        if out.sampled is not None:
            tok = block_result(out.sampled, 0, self.sampler, None, self.target.logits_width
                               ).tokens[0]
        else:
            mask = None if self.grammar is None else self.grammar.allowed(len(logits))
            tok = self.sampler.sample(logits, mask)
            self.sampler.accept(tok)
        if self.draft_sampler is not None:
            self.draft_sampler.accept(tok)
        if self.grammar is not None:
            self.grammar.consume(tok)
        emitted = self._emit([tok], out.logits,
                             None if out.sampled is None else out.sampled.logprobs)
        self._grammar_finished()
        return emitted

    def _begin_drafter(self) -> None:
        """Start the drafter on the evaluated prompt (a failing drafter is dropped: the
        request goes on target-only). A drafter reading features gets those of the
        tokens evaluated here (a reused prefix's were computed by an earlier request)."""
        if self.drafter is None:
            return
        features = ({layer: np.concatenate(rows) for layer, rows
                     in self._prompt_features.items()} if self._layers else None)
        self._prompt_features = {}
        try:
            if self.images:
                self.drafter.place_images(self.seq, self.images)
            self.drafter.begin(self.seq, self.prompt, self.draft_sampler, features)
        except Exception as exc:
            self._drafter_failed(exc, "starting")

    def _drafter_failed(self, exc: Exception, during: str, name: str | None = None) -> None:
        """A drafter raised: reported (`name`: the model source's that raised) and dropped
        (so reported once), and the request goes on target-only."""
        drafter = self.drafter
        assert drafter is not None
        self._report_drafter_failure(exc, during, name or drafter.name)
        self._failed_drafter, self.drafter = drafter, None

    def _report_drafter_failure(self, exc: Exception, during: str, name: str) -> None:
        """A drafter's exception, counted under its name and logged with the exception;
        where drafter errors raise (the test suite), re-raised instead."""
        self.stats.record_drafter_failure(name)
        if drafter_errors_raise():
            raise exc
        log.error("drafter %s failed while %s on slot %d; the request goes on without it",
                  name, during, self.seq, exc_info=exc)

    def _grammar_finished(self, dead: bool = False) -> bool:
        """Stop at a grammar dead end, or once the grammar allows nothing but the end."""
        g = self.grammar
        if g is None:
            return self.done
        if self.done:
            # the token budget ran out on the token that completed the grammar: nothing
            # was cut off (clients such as the OpenAI SDK's parse() refuse "length")
            if self.finish_reason == "length" and not dead and g.is_stopped() and not g.dead_end:
                self.finish_reason = "stop"
            return True
        if dead or g.dead_end:
            self.finish_reason = "grammar_dead_end"
        elif g.is_stopped():
            self.finish_reason = "stop"
        return self.done

    # -- one round ------------------------------------------------------------------------
    def step(self) -> list[int]:
        """One round alone (or, before the prompt is in, the whole prefill): returns the
        tokens it emitted (empty once done)."""
        if not self.prefilled:
            return self.prefill()
        result = BatchRound(self.target).step([self]).results[0]
        if isinstance(result, Exception):
            raise result
        return result

    @property
    def verifies_offer(self) -> bool:
        """The round whose call is out verifies a free offer (lookup, history): tokens
        that came without a model's draft."""
        pending = self._pending
        return (isinstance(pending, _Round) and pending.proposed.model_call is None
                and bool(pending.proposed.proposal.tokens))

    @property
    def round_planned(self) -> bool:
        """A round is planned and waits for its proposal (`round_call`)."""
        return isinstance(self._pending, _Planned)

    def plan_round(self, plan: RoundPlan | None = None) -> DraftJob | None:
        """The round's plan: `plan`, the step's where it is planned with other sequences
        (batch_policy), else the policy's. Returns the model draft the round asks for
        (None: it proposes nothing from a model); `round_call` follows, given that
        draft's proposal. No round where the sequence is done or ends here."""
        if self._pending is not None:
            raise RuntimeError("the previous call was not completed")
        if self.done or not self.prefilled or self._grammar_finished():
            return None
        limit = self._draft_limit()
        if limit < 0:
            self.finish_reason = "length"
            return None
        t0 = time.perf_counter()
        plan, offer = self._plan(limit) if plan is None else self._directed(plan, limit)
        job = self._draft_job(plan, offer)
        self._pending = _Planned(plan, offer, time.perf_counter() - t0, job)
        return job

    def round_call(self, drafted: Proposal | Exception | None = None) -> Call | None:
        """The planned round's proposal (`drafted`: what its model draft gave, or how it
        failed) and the target's call over [last, *draft]; `complete` must follow."""
        planned = self._pending
        if not isinstance(planned, _Planned):
            raise RuntimeError("round_call() without plan_round()")
        self._pending = None
        proposed = self._proposed(planned, drafted)
        self._pending = _Round(proposed, planned.seconds + proposed.seconds)
        assert self._last is not None
        tokens = [self._last, *proposed.proposal.tokens]
        return Call(self.seq, tokens, self._pos, list(range(len(tokens))), self._layers,
                    self._round_spec(proposed.proposal),
                    rope_positions=rope_positions(self.target, self.images, self._pos,
                                                  self._pos + len(tokens)))

    def complete(self, out: CallOutput) -> list[int]:
        """The step whose call went out (`prefill_call`, `round_call`), finished with the
        target's output for that call: the tokens it emitted. The call's share of its pass
        (`out.seconds`) is what the statistics and the policy count as the step's target
        time."""
        pending, self._pending = self._pending, None
        if isinstance(pending, _PrefillChunk):
            return self._complete_prefill(pending, out)
        assert isinstance(pending, _Round), "complete() without a call"
        seconds = out.seconds
        self.stats.verify_s += seconds
        rows = out.logits  # [n + 1, vocab] ([n + 1, 0]: decided in the graph)
        proposal = pending.proposed.proposal
        result = (self._verify(rows, proposal) if out.sampled is None
                  else block_result(out.sampled, len(proposal.tokens), self.sampler,
                                    self.grammar, self.target.logits_width,
                                    bonus=self.drafter is not None))
        self._commit(result, out.features if self._layers else None)
        self._observe(pending.proposed, result, pending.seconds + seconds, seconds,
                      out.experts_woken)
        emitted = self._emit(result.tokens, rows,
                             None if out.sampled is None else out.sampled.logprobs)
        self._grammar_finished(result.grammar_dead_end)
        return emitted

    def _draft_limit(self) -> int:
        """Most tokens this round may draft: every verified row must equal a single step
        (one attention bucket), fit the context, and leave room for the target's token."""
        pos = self._pos
        return min(self.target.invariant_block_limit(pos) - 1,
                   self.target.n_ctx - pos - 1,
                   self.params.max_tokens - len(self.tokens) - 1)

    def _plan(self, limit: int) -> tuple[RoundPlan, Proposal | None]:
        """The policy's plan, and the drafter's free offer it weighed (if any)."""
        dp = self.params.draft
        if self.drafter is None or limit <= 0 or dp.n_max <= 0:
            return RoundPlan(0), None
        offer = self._offer(min(self.policy.offer_limit, limit))
        if self.drafter is None:  # it failed offering
            return RoundPlan(0), None
        return self.policy.plan(limit, offer, self.drafter.runs_model), offer

    def _directed(self, plan: RoundPlan, limit: int) -> tuple[RoundPlan, Proposal | None]:
        """The step's plan for this round, within what it may draft, and the offer it
        takes (if it does)."""
        n = min(plan.n, limit, self.policy.offer_limit if plan.take_offer
                else self.params.draft.n_max)
        if self.drafter is None or n <= 0:
            return RoundPlan(0), None
        if not plan.take_offer:
            return RoundPlan(n, source=plan.source), None
        offer = self._offer(n)
        if offer is None or not offer.tokens:
            return RoundPlan(0), None
        return RoundPlan(min(n, len(offer.tokens)), True, plan.source), offer

    def _offer(self, n_max: int) -> Proposal | None:
        """The free offer of up to n_max tokens this round weighs: of the drafter's free
        sources' offers, the one its policy picks (asked once a round: the step's plan
        may have weighed it already)."""
        assert self.drafter is not None and self._last is not None
        if self._offered is None or self._offered[0] != self._pos:
            try:
                offers = self.drafter.offers(self.seq, self._last, self._pos, n_max)
            except Exception as exc:
                self._drafter_failed(exc, "offering")
                return None
            offer = self.policy.pick_offer(offers)
            self._offered = (self._pos, offer)
        offer = self._offered[1]
        return None if offer is None else offer.truncate(n_max)

    def outlook(self) -> Outlook | None:
        """What drafting could bring this sequence's next round, for a step planned with
        other sequences (None: it is not between rounds, or its policy keeps no estimates;
        a round that cannot draft, its drafter dropped or its budget spent, is a plain
        step's single row)."""
        dp = self.params.draft
        if self.done or not self.prefilled or self._pending is not None:
            return None
        room = self._draft_limit()
        limit = min(room, dp.n_max)
        remaining = min(self.params.max_tokens - len(self.tokens),
                        self.target.n_ctx - self._pos)
        if self.drafter is None or limit <= 0:
            return Outlook([1.0], None, remaining=remaining)
        offer = self._offer(min(room, self.policy.offer_limit))
        if self.drafter is None:  # it failed offering
            return Outlook([1.0], None, remaining=remaining)
        seen = self.policy.outlook(limit, offer)
        if seen is None:
            return None
        model, s, lookup, catch_up = seen
        source = self.drafter.model_sources[s]
        if not self.drafter.runs_model:
            model = model[:1]
        # the source's first pass also runs the rows it left pending (its prompt)
        catch_up += source.pending_rows(self.seq)
        return Outlook(model, source, s, source.one_pass, lookup, catch_up, remaining)

    def _draft_job(self, plan: RoundPlan, offer: Proposal | None) -> DraftJob | None:
        """The model draft of n tokens the plan asks for (None: it takes the offer, or
        drafts nothing)."""
        dp = self.params.draft
        if offer is not None and plan.take_offer:
            return None
        if self.drafter is None or not self.drafter.runs_model or plan.n < max(dp.n_min, 1):
            return None
        assert self._last is not None
        fork = None if self.grammar is None else self.grammar.fork()
        if isinstance(self.draft_sampler, CoupledSampler):
            self.draft_sampler.start_round(self._pos + 1)
        return DraftJob(self.drafter.model_sources[plan.source], DraftRequest(
            self.seq, self._last, self._pos, plan.n,
            replace(dp, backend_sampling=self.params.backend_sampling), fork))

    def _proposed(self, planned: _Planned, drafted: Proposal | Exception | None
                  ) -> _Proposed:
        """The proposal to verify: the offer's first n tokens or the model's draft of n,
        trimmed to what may be emitted (empty: a plain target step)."""
        plan, offer, job = planned.plan, planned.offer, planned.job
        if offer is not None and plan.take_offer:
            t0 = time.perf_counter()
            proposal = self._usable(offer.truncate(plan.n))
            whole = len(proposal.tokens) == plan.n < len(offer.tokens)
            return _Proposed(proposal, offer_next=offer.tokens[plan.n] if whole else None,
                             seconds=time.perf_counter() - t0)
        if job is None or self.drafter is None:
            return _Proposed(Proposal([]))
        if drafted is None:
            raise RuntimeError("a round that asked for a draft was given none")
        if isinstance(drafted, Exception):
            self._drafter_failed(drafted, "drafting", job.source.name)
            return _Proposed(Proposal([]))
        self.stats.draft_s += drafted.seconds
        self.stats.record_source(job.source.name)
        call = ModelCall(plan.n, len(drafted.tokens), drafted.seconds, drafted.evidence,
                         plan.source)
        return _Proposed(self._usable(drafted.truncate(plan.n)), model_call=call,
                         seconds=drafted.seconds)

    def _usable(self, proposal: Proposal) -> Proposal:
        """The part of a proposal worth verifying: up to its first end of generation, what
        the grammar allows, at least n_min tokens (else nothing)."""
        cut = next((i + 1 for i, t in enumerate(proposal.tokens) if t in self.eog), None)
        if cut is not None:  # nothing after an end of generation would be emitted
            proposal = proposal.truncate(cut)
        if self.grammar is not None and proposal.q_rows is None:
            # drafts made without the grammar (lookup): keep the part it allows (exact:
            # greedy verification is exact for any draft)
            proposal = proposal.truncate(self.grammar.valid_prefix(proposal.tokens))
        if len(proposal.tokens) < max(self.params.draft.n_min, 1):
            return Proposal([])
        return proposal

    def _spec(self, position: int, proposal: Proposal | None = None) -> SampleSpec | None:
        """How the target's graph decides the call's rows (None: on the host): the token at
        `position`, or the verification of `proposal`."""
        if not self.in_graph or (self.grammar is not None and self.grammar.is_stopped()):
            return None
        drafts = [] if proposal is None else list(proposal.tokens)
        q = None
        if drafts and proposal is not None and proposal.q_rows is not None and (
                self._rejection_sampled):
            q = sparse_q(proposal.q_rows)
            if q is None:  # too wide to send: verified on the host
                return None
        # logprobs under the raw logits come out of the graph; post-sampling ones (and very
        # long top lists) are computed on the host from the rows' logits
        k = self.params.logprobs
        on_host = k is not None and (self.params.post_sampling_probs or k > MAX_LOGPROBS)
        return sample_spec(self.sampler, position, self.target.logits_width, drafts=drafts,
                           q=q, grammar=self.grammar,
                           candidates=(BONUS_CANDIDATES if self.drafter is not None
                                       and not self.sampler.is_greedy else 0),
                           logprobs=-1 if k is None or on_host else k, want_logits=on_host)

    def _round_spec(self, proposal: Proposal) -> SampleSpec | None:
        """The graph's decision of a round's block, where the round is verified as the host
        verifiers do (not by a drafter that decides acceptance itself)."""
        if proposal.tokens and self.drafter is not None and self.drafter.decides_acceptance:
            return None
        return self._spec(self._pos + 1, proposal)

    @property
    def _rejection_sampled(self) -> bool:
        """Sampled drafts are verified by rejection sampling against their q (else by the
        target's own draw: coupled drafts)."""
        return self.params.draft.probabilistic and not self.coupled

    def _verify(self, rows: np.ndarray, proposal: Proposal) -> VerifyResult:
        if proposal.tokens and self.drafter is not None and self.drafter.decides_acceptance:
            self.stats.valid = False  # rows after the first follow placeholder drafts
            out = self._verify_by_drafter(rows, proposal, self.drafter)
            return VerifyResult(len(out) - 1, out, len(proposal.tokens))
        if proposal.q_rows is not None and self._rejection_sampled:
            return verify_rejection(rows, proposal.tokens, proposal.q_rows, self.sampler,
                                    self.grammar, draft_masked=True)
        return verify_greedy(rows, proposal.tokens, self.sampler, self.grammar)

    def _verify_by_drafter(self, rows: np.ndarray, proposal: Proposal,
                           drafter: Drafter) -> list[int]:
        """The target's own choice per row, for as many rows as the drafter accepts."""
        out: list[int] = []
        for i in range(len(proposal.tokens) + 1):
            g = self.grammar
            choice = self.sampler.sample(rows[i], None if g is None else g.allowed(len(rows[i])))
            self.sampler.accept(choice)
            if g is not None:
                g.consume(choice)
            out.append(choice)
            if i == len(proposal.tokens) or not drafter.accepts_position(i, choice, self.eog):
                break
            if g is not None and g.is_stopped():
                break
        return out

    def _commit(self, result: VerifyResult, features: Features | None) -> None:
        """The verified tokens join the sequence: the drafter drops its rejected drafts
        and sees the tokens now in the target's KV ([last, *emitted[:-1]]; the last
        emitted token is the next round's `last`)."""
        assert self._last is not None
        emitted = result.tokens
        if self.draft_sampler is not None:  # q's penalties see the tokens p's saw
            for t in emitted:
                self.draft_sampler.accept(t)
        if self.drafter is not None:
            kept = None if features is None else {
                layer: rows[: len(emitted)] for layer, rows in features.items()}
            try:
                self.drafter.accept(self.seq, len(emitted) - 1)
                self.drafter.process(self.seq, [self._last, *emitted[:-1]], kept)
            except Exception as exc:
                self._drafter_failed(exc, "taking the verified tokens")
        self._pos += len(emitted)

    def _observe(self, proposed: _Proposed, result: VerifyResult, seconds: float,
                 verify_s: float, verify_experts: int) -> None:
        """Statistics and the policy learn from the round."""
        proposal = proposed.proposal
        self.stats.record_round(len(proposal.tokens), result.n_accepted, proposal.is_lookup,
                                proposal.evidence.lookup_source)
        self.policy.observe(RoundRecord(
            n_drafted=len(proposal.tokens), n_accepted=result.n_accepted,
            emitted=result.tokens, seconds=seconds, verify_seconds=verify_s,
            verify_experts=verify_experts,
            model_call=proposed.model_call, lookup_match=proposal.evidence.lookup_match,
            lookup_source=proposal.evidence.lookup_source,
            accept_probs=result.accept_probs, offer_next=proposed.offer_next,
            bonus_probs=result.bonus_probs, last_bonus_probs=self._bonus_p))
        self._bonus_p = result.bonus_probs  # the next draft's guess for the bonus meets it

    # -- output ---------------------------------------------------------------------------
    def _emit(self, toks: list[int], rows: np.ndarray,
              graph_logprobs: EmittedLogprobs | None = None) -> list[int]:
        """Emit tokens (until an end of generation or max_tokens); rows [>= len(toks),
        vocab] are the target's logits each was decided on, or `graph_logprobs` the
        logprobs the graph computed for them."""
        out: list[int] = []
        logprobs = (None if self._logprobs is None
                    else self._logprobs.of_round(toks, rows, self.tokens, graph_logprobs))
        for i, t in enumerate(toks):
            if logprobs is not None:
                self.token_logprobs.append(logprobs[i])
            self.tokens.append(t)
            out.append(t)
            if t in self.eog:
                self.finish_reason = "stop"
                break
            if len(self.tokens) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        self._last = out[-1] if out else self._last
        self.stats.generated_tokens = len(self.tokens)
        self.stats.decoded_tokens = max(len(self.tokens) - 1, 0)
        self.stats.decode_s = time.perf_counter() - self._t_decode
        return out

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    @property
    def target(self) -> ModelRunner:
        if self._target is None:
            raise RuntimeError("the generation is closed")
        return self._target

    def close(self) -> None:
        """End the sequence with the drafter, and let go of the target's runner."""
        if self.drafter is not None and self._memory is not None:
            self._memory.keep(self.drafter.name, self.policy)
        self._memory = None
        drafter = self.drafter or self._failed_drafter
        self._target = None
        if drafter is not None:
            try:
                drafter.end(self.seq)
            except Exception as exc:  # the request is over; the slot's next one begins anew
                self._report_drafter_failure(exc, "ending", drafter.name)
