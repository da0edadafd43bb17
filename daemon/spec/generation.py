"""One request's decode: prefill, then speculative rounds, one round per `step()`.

The speculative round (see docs/architecture.md for the invariants):
 1. choose n: min(n_max or adaptive choice, room in the context, room in the attention
    bucket so every verified row equals a single-token step, tokens left to generate - 1)
 2. draft = drafter.draft(seq, last, pos, n)          (drafts shorter than n_min dropped;
    under the adaptive controller a prompt lookup, alone or in a HybridDrafter, first
    offers its tokens and the controller picks the source: the offer, the draft model
    (if any) or neither)
 3. target.forward(seq, [last, *draft], pos, all rows) (one pass; writes KV in place)
 4. verify: greedy (target's choice per row) or rejection sampling (p vs q)
 5. drafter.accept(k); drafter.process(emitted); stats; the rejected rows of both KV
    caches are simply overwritten next round (position pos + k + 1)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specd.daemon.drafters.hybrid import HybridDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.drafters.synthetic import SyntheticDrafter
from specd.daemon.text.grammar import GrammarState
from specd.ort_models.graph_builder import ATTN_BUCKET
from specd.ort_models.runner import ModelRunner

from .drafter import Draft, Drafter, DraftParams
from .policy import AdaptiveDraftLength
from .sampling import Sampler, SamplerParams, derive_seeds
from .stats import SpecStats
from .verify import (
    VerifyResult,
    acceptance_probability,
    to_width,
    verify_greedy,
    verify_rejection,
)


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


@dataclass
class GenerationParams:
    max_tokens: int = 256
    sampling: SamplerParams = field(default_factory=lambda: SamplerParams(temperature=0.0))
    draft: DraftParams = field(default_factory=DraftParams)
    adaptive: bool = False
    draft_top_k: int = 10  # q is the draft's top-k, renormalised, at the request temperature
    ignore_eos: bool = False


class Generation:
    """State of one sequence slot while it generates."""

    def __init__(self, target: ModelRunner, seq: int, prompt: Sequence[int],
                 params: GenerationParams, *, eog: set[int], drafter: Drafter | None = None,
                 reuse: int = 0, grammar: GrammarState | None = None):
        check_prompt_fits(prompt, target.n_ctx)
        params.sampling.validate()
        params.draft.validate()
        self.target, self.seq, self.params = target, seq, params
        self.prompt = list(prompt)
        self.eog = set() if params.ignore_eos else set(eog)
        self.drafter = drafter
        self.grammar = grammar  # the request's constraint state (advanced on emitted tokens)
        seed = params.sampling.seed
        t_seed, d_seed = derive_seeds(seed)
        self.sampler = Sampler(params.sampling, seed=t_seed)
        dp = params.sampling
        self.draft_sampler = Sampler(
            SamplerParams(temperature=dp.temperature, top_k=params.draft_top_k,
                          seed=d_seed), seed=d_seed) if not dp.is_greedy else None
        self.adaptive = AdaptiveDraftLength(
            params.draft.n_max, n_min=params.draft.n_min,
            catch_up_limit=None if drafter is None else drafter.catch_up,
        ) if params.adaptive else None
        # a fully cached prompt still evaluates its last token (its logits are needed)
        self.stats = SpecStats(prompt_tokens=len(prompt),
                               cached_tokens=min(reuse, max(len(prompt) - 1, 0)))
        self.tokens: list[int] = []  # generated
        self.finish_reason: str | None = None
        self._reuse = reuse
        self._last: int | None = None
        self._pos = 0
        self._cursor: int | None = None
        self._offer_next: int | None = None  # the offered token after those verified
        # the target's distribution [vocab] of the last round's bonus token (None: the
        # round did not end on one, or greedy)
        self._bonus_p: np.ndarray | None = None
        self._t_decode = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

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

    # -- prefill --------------------------------------------------------------------------
    @property
    def prefilled(self) -> bool:
        return self._last is not None or self.done

    def prefill(self, budget: int | None = None) -> list[int]:
        """Evaluate the prompt (after any reused prefix), at most `budget` tokens per call.

        Returns [] while prompt remains, then the first generated token. A budgeted call
        stops at the last attention-bucket boundary within its budget (at the budget when
        none is in reach), and the runner chunks on those boundaries too: with budgets of
        a bucket or more the calls are those of one unbudgeted prefill. (On the CPU the KV
        is the same however the prompt is split; on CUDA it is the same calls that make
        it the same.)
        """
        if self.prefilled:
            return []
        t0 = time.perf_counter()
        if self._cursor is None:
            self._cursor = min(self._reuse, len(self.prompt) - 1)
        start = self._cursor
        end = len(self.prompt)
        if budget is not None and start + budget < end:
            # stop on a bucket boundary where one is in reach, so a budgeted prompt is cut
            # where the runner would cut it anyway (the same calls on any device)
            cut = start + budget
            boundary = cut - cut % ATTN_BUCKET
            end = boundary if boundary > start else cut
        logits = self.target.prefill(self.seq, self.prompt[start:end], start)  # [vocab]
        self._cursor = end
        if end < len(self.prompt):
            self.stats.prefill_s += time.perf_counter() - t0
            return []
        if self.drafter is not None:
            try:
                self.drafter.begin(self.seq, self.prompt, self.draft_sampler)
            except Exception:  # noqa: BLE001 - a failing draft never fails the request
                self.drafter = None
        # the draft's pass over the prompt is prompt processing too (it precedes the first
        # token), not decoding
        self.stats.prefill_s += time.perf_counter() - t0
        self._pos = len(self.prompt)
        self._t_decode = time.perf_counter()
        if self.params.max_tokens <= 0:  # evaluate (and cache) the prompt only
            self.finish("length")
            return []
        if self._grammar_finished():
            return []
        mask = None if self.grammar is None else self.grammar.allowed(len(logits))
        tok = self.sampler.sample(logits, mask)
        self.sampler.accept(tok)
        if self.grammar is not None:
            self.grammar.consume(tok)
        out = self._emit([tok])
        self._grammar_finished()
        return out

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
        """One round: returns the tokens it emitted (empty once done)."""
        if self.done:
            return []
        if not self.prefilled:
            return self.prefill()
        if self._grammar_finished():
            return []
        last, pos = self._last, self._pos
        assert last is not None
        limit = min(self.target.invariant_block_limit(pos) - 1,
                    self.target.n_ctx - pos - 1,
                    self.params.max_tokens - len(self.tokens) - 1)
        if limit < 0:
            self.finish_reason = "length"
            return []
        t_round = time.perf_counter()
        draft, draft_s = self._draft(last, pos, limit)
        t0 = time.perf_counter()
        rows = self.target.forward(self.seq, [last, *draft.tokens], pos,
                                   list(range(len(draft.tokens) + 1)))  # [n+1, vocab]
        dt = time.perf_counter() - t0
        self.stats.verify_s += dt
        if self.adaptive is not None:
            self.adaptive.observe_verify(len(draft.tokens) + 1, dt)
        result = self._verify(rows, draft)
        emitted, accepted = result.tokens, result.n_accepted
        self._bonus_p = result.bonus_probs  # the next draft's guess for the bonus meets it
        self.stats.record_round(len(draft.tokens), accepted, draft.lookup)
        if self.adaptive is not None and draft.tokens:
            match = draft.match  # > 0: a lookup offer's round
            self.adaptive.observe_acceptance(len(draft.tokens), accepted, match,
                                             result.accept_probs)
            nxt = self._offer_next
            if match and accepted == len(draft.tokens) < len(emitted) and nxt is not None:
                # the offer's next token against the bonus: the probability the target
                # gave it where it drew the bonus (at temperature > 0), else whether it won
                p = self._bonus_p
                hit = (float(p[nxt]) if p is not None and nxt < p.shape[0]
                       else float(emitted[accepted] == nxt))
                self.adaptive.observe_position(accepted, hit, match)
        if self.drafter is not None:
            # the last emitted token is the next round's `last`, whatever chose it
            self.drafter.accept(self.seq, len(emitted) - 1)
            self.drafter.process(self.seq, [last, *emitted[:-1]])  # now in the target's KV
        self._pos = pos + len(emitted)
        if self.adaptive is not None:
            self.adaptive.observe_round(len(draft.tokens), len(emitted),
                                        time.perf_counter() - t_round, draft_s,
                                        draft.lookup)
        out = self._emit(emitted)
        self._grammar_finished(result.grammar_dead_end)
        return out

    def _draft(self, last: int, pos: int, limit: int) -> tuple[Draft, float]:
        """The round's draft and the seconds the drafter took (0 if it did not run)."""
        dp = self.params.draft
        if self.drafter is None or limit <= 0 or dp.n_max <= 0:
            return Draft([]), 0.0
        drafter = self.drafter
        if self.adaptive is None:
            n = min(dp.n_max, limit)
        elif isinstance(drafter, HybridDrafter | NgramDrafter):
            # a free offer first; the controller weighs it against the model (if any)
            # and a plain step
            hybrid = isinstance(drafter, HybridDrafter)
            lookup = drafter.lookup if hybrid else drafter
            offered = lookup.draft(self.seq, last, pos, min(dp.n_max, limit), dp)
            n, take_offer = self.adaptive.choose_source(
                limit, len(offered.tokens), offered.match, model=hybrid)
            if take_offer:
                draft = self._usable(offered.truncate(n))
                # the offer's next token, checked against the bonus token if all n pass
                whole = len(draft.tokens) == n < len(offered.tokens)
                self._offer_next = offered.tokens[n] if whole else None
                return draft, 0.0
            if not hybrid:
                return Draft([]), 0.0  # a plain step: the lookup is the only source
            drafter = drafter.model
        else:
            n = self.adaptive.choose(limit)
        if n <= 0 or n < dp.n_min:  # a draft shorter than n_min would not be verified
            return Draft([]), 0.0
        t0 = time.perf_counter()
        fork = None if self.grammar is None else self.grammar.fork()
        try:
            draft = drafter.draft(self.seq, last, pos, n, dp, fork)
        except Exception:  # noqa: BLE001 - fall back to target-only decoding
            self.drafter = None
            return Draft([]), 0.0
        dt = time.perf_counter() - t0
        self.stats.draft_s += dt
        if self.adaptive is not None:
            if not draft.caught_up:  # a steady round, overheads included
                self.adaptive.observe_draft(dt, draft.step_s[1:])
            for i, hit in draft.forced or ():
                self.adaptive.observe_position(i, hit)
            if draft.bonus_q is not None and self._bonus_p is not None:
                i, q = draft.bonus_q
                self.adaptive.observe_position(
                    i, acceptance_probability(self._bonus_p, to_width(q, self._bonus_p.shape[0])))
            if draft.unsure and len(draft.tokens) < n:
                # stopped short for want of confidence (p_min): position len(tokens)
                # yields nothing, as a rejection there would (else nothing tells the
                # controller that drafting n no longer pays)
                self.adaptive.observe_position(len(draft.tokens), False)
        return self._usable(draft.truncate(n)), dt

    def _usable(self, draft: Draft) -> Draft:
        """The part of a draft worth verifying: up to its first end of generation, what
        the grammar allows, at least n_min."""
        cut = next((i + 1 for i, t in enumerate(draft.tokens) if t in self.eog), None)
        if cut is not None:  # nothing after an end of generation would be emitted
            draft = draft.truncate(cut)
        if self.grammar is not None and draft.probs is None:
            # drafts made without the grammar (n-gram): keep the part it allows (exact:
            # greedy verification is exact for any draft)
            draft = draft.truncate(self.grammar.valid_prefix(draft.tokens))
        if len(draft.tokens) < max(self.params.draft.n_min, 1):
            assert self.drafter is not None
            self.drafter.accept(self.seq, 0)
            return Draft([])
        if not draft.valid:
            self.stats.valid = False
        return draft

    def _verify(self, rows: np.ndarray, draft: Draft) -> VerifyResult:
        if isinstance(self.drafter, SyntheticDrafter) and draft.tokens:
            out = self._verify_synthetic(rows, draft)
            return VerifyResult(len(out) - 1, out, len(draft.tokens))
        if draft.probs is not None and self.params.draft.probabilistic:
            return verify_rejection(rows, draft.tokens, draft.probs, self.sampler,
                                    self.grammar, draft_masked=True)
        return verify_greedy(rows, draft.tokens, self.sampler, self.grammar)

    def _verify_synthetic(self, rows: np.ndarray, draft: Draft) -> list[int]:
        assert isinstance(self.drafter, SyntheticDrafter)
        out: list[int] = []
        for i in range(len(draft.tokens) + 1):
            g = self.grammar
            choice = self.sampler.sample(rows[i], None if g is None else g.allowed(len(rows[i])))
            self.sampler.accept(choice)
            if g is not None:
                g.consume(choice)
            out.append(choice)
            if i == len(draft.tokens) or not self.drafter.accept_position(i, choice, self.eog):
                break
            if g is not None and g.is_stopped():
                break
        return out

    # -- output ---------------------------------------------------------------------------
    def _emit(self, toks: list[int]) -> list[int]:
        out: list[int] = []
        for t in toks:
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

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.end(self.seq)
