"""A smaller LLM as the draft: its own runner and KV cache, following the target's context.

Per sequence the drafter keeps the token history and how much of it its cache holds.
Drafting first evaluates whatever the cache lacks (the last token, and after a fully
accepted round the last draft too) in one call, then one token per step.

`begin` evaluates nothing: the prompt (past the prefix the slot's cache already holds) is
evaluated at the sequence's first draft, as part of that draft's catch-up, so a request
pays for it only if it drafts, and only after its first token. Until then the rows are
pending (`pending_rows`, which the step planner prices as catch-up rows). Pending input
runs in chunks as the target's prefill does: each within one attention bucket and at most
the runner's rows per call (a sliding-window ring's limit).

After rounds the target decoded alone (the adaptive controller found drafting did not
pay), the draft catches up on at most `catch_up` of the tokens it skipped, the latest:
the older ones are left out of its cache, a gap it never fills. A probe then costs the
same however long drafting was off, and a draft's context missing a stretch only changes
what it proposes, never the output.
From the gap on, the draft's cache position of a token is its sequence position less
`offset`, the tokens left out. Catch-up rows checked against the target's tokens, and
after a fully accepted round its guess for the bonus token, are free acceptance samples
for the policy (`DraftEvidence.guess_checks`, `bonus_q`).

An M-RoPE draft (qwen2vl) rotates the prompt's rows as the target does (an image's
placeholders on its grid, media.mrope_positions) and every later row at its cache position
plus the shift the prompt's images left (`rope_shift`): the text after an image is where
the target has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specd.daemon.spec.drafter import DraftEvidence, DraftRequest, Features
from specd.daemon.spec.media import PromptImage, mrope_positions, mrope_shift, text_ids
from specd.daemon.spec.sampling import Sampler
from specd.ort_models.runner import (
    Call,
    CallOutput,
    ContextFull,
    ModelRunner,
    bucket_block_limit,
    text_rope_positions,
)

from .model_backed import DraftRun, ModelBackedDrafter
from .picking import pick_from_block, pick_spec, pick_token


@dataclass
class _SeqState:
    history: list[int] = field(default_factory=list)  # tokens at positions 0..
    n_cached: int = 0  # cache positions [0, n_cached) are in the draft's KV cache
    offset: int = 0  # tokens of the history left out of the cache (catch-ups' gaps)
    gap_at: int | None = None  # cache position of the first gap (None: no gap)
    drafted: list[int] = field(default_factory=list)
    draft_pos: int | None = None  # cache position of `last` in the draft not yet accepted
    full_run: int = 0  # the last round's drafts, all accepted (0: not all, or none)
    sampler: Sampler | None = None
    # an M-RoPE draft after the prompt's images: rope position minus cache position of
    # the rows past the prompt (None: the runner's default, the cache position)
    rope_shift: int | None = None
    # cache positions [0, prompt_end) hold the prompt, evaluated whole (never a gap) at the
    # first draft; `images`: the prompt's, placing its rows (an M-RoPE draft)
    prompt_end: int = 0
    images: tuple[PromptImage, ...] = ()


FORCED_ROWS = 16  # late rows checked against the tokens that followed them (their logits
# cost an lm_head row each, little beside the pass, which reads the weights once)
CATCH_UP = 16  # most skipped tokens evaluated before drafting (the latest)


class DraftModelDrafter(ModelBackedDrafter[_SeqState, ModelRunner]):
    name = "draft"

    def __init__(self, runner: ModelRunner, *, vocab_limit: int | None = None,
                 catch_up: int | None = CATCH_UP):
        super().__init__()
        self.runner = runner
        self.catch_up = catch_up  # None: evaluate every skipped token
        self.vocab_limit = vocab_limit  # the target's vocab size, if smaller
        self._n_vocab = runner.hp.n_vocab  # the draft's own rows
        self._images: dict[int, tuple[PromptImage, ...]] = {}  # for the next begin, by seq

    @property
    def n_ctx(self) -> int:
        return self.runner.n_ctx

    def place_images(self, seq: int, images: Sequence[PromptImage]) -> None:
        if self.runner.takes_rope_positions:
            self._images[seq] = tuple(images)

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        """Start the sequence on the prompt: the prefix the slot's cache already holds is
        reused, the rest left pending for the first draft to evaluate (ContextFull where
        it cannot fit the draft's context: the request goes on without the drafter)."""
        if len(prompt) > self.n_ctx:
            raise ContextFull(f"prompt of {len(prompt)} tokens does not fit in the draft "
                              f"model's context of {self.n_ctx} tokens")
        self._ensure_sequence(seq)
        old = self._seqs.get(seq)
        reuse = 0
        if old is not None:
            whole = old.n_cached if old.gap_at is None else min(old.n_cached, old.gap_at)
            cached = old.history[:whole]  # the cache's prefix that matches the history
            n = min(len(cached), len(prompt))
            while reuse < n and cached[reuse] == prompt[reuse]:
                reuse += 1
        st = _SeqState(history=list(prompt), n_cached=reuse, sampler=sampler,
                       prompt_end=len(prompt), images=tuple(self._images.pop(seq, ())))
        if st.images:  # an M-RoPE draft: the prompt's rows as the target has them
            st.rope_shift = mrope_shift(st.images)
        self._seqs[seq] = st

    def pending_rows(self, seq: int) -> int:
        st = self._seqs.get(seq)
        return 0 if st is None else max(st.prompt_end - st.n_cached, 0)

    def _ids(self, tokens: Sequence[int]) -> list[int]:
        """Token ids as the draft can embed them: a target id past the draft's vocabulary
        (compat allows sizes to differ a little) becomes id 0, and so does an image's
        placeholder (media.text_ids: the draft has no vision; the text around the image
        keeps its positions). Only proposals change."""
        return [t if t < self._n_vocab else 0 for t in text_ids(tokens)]

    def _logits(self, rows: np.ndarray) -> np.ndarray:
        return rows[..., : self.vocab_limit] if self.vocab_limit else rows

    def start(self, request: DraftRequest) -> DraftRun:
        return _Run(self, request)

    def accept(self, seq: int, n_accepted: int) -> None:
        st = self._seqs[seq]
        if st.draft_pos is None:
            return  # no draft since the last accept (a target-only round): nothing to drop
        # the cache holds last, d0 .. d_{n-2}; keep last and the accepted drafts
        st.n_cached = min(st.n_cached, st.draft_pos + 1 + n_accepted)
        st.full_run = len(st.drafted) if st.drafted and n_accepted >= len(st.drafted) else 0
        st.drafted, st.draft_pos = [], None

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        self._seqs[seq].history.extend(tokens)

    def end(self, seq: int) -> None:
        """Keep the history and cache length: the next request on this slot may reuse it."""
        st = self._seqs.get(seq)
        if st is not None:
            st.drafted = []
        super().end(seq)


class _Run(DraftRun):
    """A draft model's draft of one sequence: first whatever its cache lacks (the last
    token; after target-only rounds, the skipped tokens it catches up on), then a token a
    step."""

    def __init__(self, drafter: DraftModelDrafter, r: DraftRequest):
        super().__init__(r.grammar)
        self.d, self.seq, self.pos, self.params = drafter, r.seq, r.pos, r.params
        st = self.st = drafter._seqs[r.seq]
        pos = r.pos
        if len(st.history) != pos:
            raise RuntimeError(f"draft history has {len(st.history)} tokens, target at {pos}")
        st.n_cached = min(st.n_cached, pos - st.offset)
        # the prompt rows the cache lacks (evaluated whole), then the tokens skipped since
        start = st.n_cached + st.offset  # history index of the first token the cache lacks
        self.owed = drafter.pending_rows(r.seq)  # the pending prompt rows not yet run
        self.prompt_rows = self.owed
        skipped = pos - start - self.owed
        left = 0  # skipped tokens left out of the cache, the oldest
        self.full_run, st.full_run = st.full_run, 0
        if drafter.catch_up is not None and skipped > drafter.catch_up:
            if st.gap_at is None:
                st.gap_at = st.n_cached + self.owed
            left = skipped - drafter.catch_up
            st.offset += left
            self.full_run = 0  # the last round's final draft is left out: its guess unchecked
        self.p = st.n_cached  # cache position of the next call's first token
        st.draft_pos = pos - st.offset  # last's cache position
        self.n_max = min(r.n_max, drafter.n_ctx - st.draft_pos - 1)
        st.drafted = self.tokens
        self.done = self.n_max <= 0
        owed_end = start + self.owed
        self.pending = [*st.history[start:owed_end], *st.history[owed_end + left:], r.last]
        self.caught_up = len(self.pending) > 2  # after target-only rounds: a small prefill
        self.forced: tuple[tuple[int, bool], ...] = ()
        self.bonus_q: tuple[int, np.ndarray] | None = None
        self.sampler = st.sampler if r.params.probabilistic else None  # None: the argmax
        runner = drafter.runner
        # the draft's choice made in its graph, where it has a sampler
        self.in_graph = (r.params.backend_sampling and runner.samples
                         and (drafter.vocab_limit is None
                              or drafter.vocab_limit >= runner.logits_width))
        self.kind = ""  # what the pending call computes (see `call`)
        self.chunk = 0  # tokens of a "chunk" call
        self.first = 0  # the first output row of a call checking guesses

    @property
    def at(self) -> int:
        """The sequence position of this step's token."""
        return self.pos + 1 + len(self.tokens)

    def call(self) -> Call:
        """More pending tokens than one call may hold: the next chunk, its rows only
        cached. Several pending tokens, greedily: their rows check the draft's earlier
        guesses (those of generated tokens, not the prompt's). After a fully accepted
        sampled round: the row of the last draft (where the bonus was drawn) and of the
        bonus. Else the last row, decided in the graph where it samples."""
        d = self.d
        n = min(bucket_block_limit(self.p, d.n_ctx), d.runner.max_call_rows)
        if len(self.pending) > n:
            self.kind, self.chunk = "chunk", n
            return Call(self.seq, d._ids(self.pending[:n]), self.p,
                        rope_positions=self._rope(n))
        pending, ids = self.pending, d._ids(self.pending)
        rope = self._rope(len(ids))
        if len(pending) > 1 and self.sampler is None:
            self.kind = "guesses"
            k = min(len(pending) - 1, FORCED_ROWS)
            self.first = max(len(pending) - 1 - k, self.owed)
            return Call(self.seq, ids, self.p, list(range(self.first, len(pending))),
                        rope_positions=rope)
        if len(pending) == 2 and self.full_run and self.grammar is None:
            self.kind = "bonus"
            return Call(self.seq, ids, self.p, [0, 1], rope_positions=rope)
        self.kind = "last"
        spec = (pick_spec(self.sampler, self.grammar, self.at, self.params.p_min,
                          d.runner.logits_width) if self.in_graph else None)
        return Call(self.seq, ids, self.p, sample=spec, rope_positions=rope)

    def _rope(self, n: int) -> np.ndarray | None:
        """The M-RoPE positions [4, n] of the next n pending rows where they are not the
        cache positions: the prompt's as the target has them (its images on their grid),
        later rows shifted past the images."""
        st = self.st
        if st.images and self.p < st.prompt_end:
            return mrope_positions(st.images, self.p, self.p + n)
        return None if st.rope_shift is None else text_rope_positions(self.p, n, st.rope_shift)

    def take(self, out: CallOutput) -> None:
        d, p_min = self.d, self.params.p_min
        if self.kind == "chunk":  # rows cached, nothing drafted yet
            self.p += self.chunk
            self.st.n_cached = self.p
            self.owed = max(self.owed - self.chunk, 0)
            self.pending = self.pending[self.chunk:]
            return
        if self.kind == "guesses":
            rows = out.logits  # [k + 1, vocab]
            self._check_guesses(d._logits(rows[:-1]).argmax(axis=-1))
            pick = pick_token(d._logits(rows[-1]), self.sampler, self.grammar, p_min, self.at)
        elif self.kind == "bonus":
            rows = out.logits  # [2, vocab]
            assert self.st.sampler is not None
            self.bonus_q = (self.full_run, self.st.sampler.probs(d._logits(rows[0])))
            pick = pick_token(d._logits(rows[1]), self.sampler, self.grammar, p_min, self.at)
        elif out.sampled is not None:
            pick = pick_from_block(out.sampled, self.sampler is not None, p_min)
        else:
            pick = pick_token(d._logits(out.logits[0]), self.sampler, self.grammar, p_min,
                              self.at)
        self.p += len(self.pending)
        self.st.n_cached = self.p
        going = self.add(pick)
        if pick.token is not None:
            self.pending = [pick.token]
        self.done = not going or len(self.tokens) >= self.n_max

    def _check_guesses(self, guesses: np.ndarray) -> None:
        """The greedy guesses [k] of the rows before the last, against the tokens that
        really followed them. Row 0 follows the last round's final draft: after
        `full_run` accepted drafts it guessed the target's bonus token (position
        full_run); any other row is a teacher-forced position 0."""
        hits = guesses == np.asarray(self.pending[self.first + 1:])  # [k]
        self.forced = tuple((self.full_run if self.first + i == 0 else 0, bool(h))
                            for i, h in enumerate(hits))

    def evidence(self) -> DraftEvidence:
        return replace(super().evidence(), includes_catch_up=self.caught_up,
                       prompt_rows=self.prompt_rows,
                       guess_checks=self.forced, bonus_q=self.bonus_q)
