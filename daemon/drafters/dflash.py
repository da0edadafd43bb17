"""A DFlash-family head (DFlash, DSpark) as the draft: a whole block proposed in one pass,
fed by the target's own hidden states.

Per sequence the head's KV cache holds, at each position the target has verified, K/V
rows injected from that token's features (the target layers' hidden states the head
reads, concatenated in its order). A round runs one block at the next positions: DFlash's
[last, MASK × n] proposing from rows 1..n; a DSpark head's anchor-first block [last,
MASK × (n - 1)] proposing from rows 0..n-1 (or DFlash's layout where the head says
`sample_from_anchor` false). Each row's distribution is a fixed function of the context
and the block (DSpark's Markov chain conditions on the argmax, in the graph), not of the
tokens drawn at the other rows, so sampling row by row and verifying by rejection
sampling against those rows is exact. p_min stops at a row whose DSpark confidence, or
without a confidence head its top probability, is below it. The block's own rows are
overwritten by the next injection, so nothing needs rolling back.

The head's two graphs (ort_models/head_runner.py) share one KVCache and, on the CPU, the
target's token embedding table (ort_models/shared_initializers.py). `draft_steps` yields
the block as one `BlockCall`; where the graphs run on specd's attention, the blocks and
the injections of several slots run in one pass each (injections wait for
`batched_updates` to close), a block's bits those of the block alone. `DFlash2Drafter`
walks a DFlash2 head's candidate lattice from the anchor, on the host, greedily.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.drafter import (
    DraftEvidence,
    DraftParams,
    DraftSteps,
    Features,
    Proposal,
    head_input_rows,
)
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState
from specd.ort_models.head_runner import BlockCall, BlockOutput, HeadRunner
from specd.ort_models.heads import DEFAULT_BLOCK_SIZE
from specd.ort_models.sampling_op import SampleSpec

from .model_backed import ModelBackedDrafter
from .picking import QRow, pick_from_block, pick_spec, pick_token, stack_q


@dataclass
class _SeqState:
    injected: int = 0  # positions [0, injected) hold the context's K/V rows
    sampler: Sampler | None = None


class DFlashDrafter(ModelBackedDrafter[_SeqState, HeadRunner]):
    one_pass = True
    catch_up = 0  # tokens skipped while the target decoded alone were injected as they came

    def __init__(self, runner: HeadRunner):
        head = runner.built.head
        if head.mask_token_id is None:
            raise ValueError(f"{runner.built.head_path.name} names no mask token")
        # the scheduler runs the blocks of several sequences in one pass of it
        super().__init__()
        self.runner = self.step_runner = runner
        self.name = head.kind
        self.target_layers = head.hidden_layers
        self.mask_id = head.mask_token_id
        # the block's first proposing row: 0 for an anchor-first DSpark block, else 1
        self.first_row = 0 if head.sample_from_anchor else 1
        self.max_drafts = (head.block_size or DEFAULT_BLOCK_SIZE) - self.first_row

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        """Inject the evaluated prompt tokens' rows (a prefix reused from an earlier request
        on this slot was injected by it: its rows are still in the cache)."""
        self._ensure_sequence(seq)
        n = 0 if features is None else next(iter(features.values())).shape[0]
        start = len(prompt) - n
        old = self._seqs.get(seq)
        if start > (old.injected if old is not None else 0):
            raise ValueError(f"the head's cache holds {old.injected if old else 0} context "
                             f"rows, the prompt's features start at {start}")
        self._seqs[seq] = _SeqState(injected=start, sampler=sampler)
        if n:
            self.process(seq, prompt[start:], features)

    def draft_steps(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
                    grammar: GrammarState | None = None) -> DraftSteps:
        """The draft as one yielded BlockCall (sent its BlockOutput): a scheduler runs the
        blocks of several sequences in one pass of the head."""
        st = self._seqs[seq]
        if st.injected != pos:
            raise RuntimeError(f"the head's context ends at {st.injected}, the target at {pos}")
        first = self.first_row
        n = min(n_max, self.max_drafts, self.runner.n_ctx - pos - first)
        if n <= 0:
            return Proposal([])
        t0 = time.perf_counter()
        sampler = st.sampler if params.probabilistic else None  # None: the argmax
        call = BlockCall(seq, [last] + [self.mask_id] * (n + first - 1), pos,
                         list(range(first, first + n)),
                         self._specs(sampler, grammar, pos, n, params))
        t1 = time.perf_counter()
        out: BlockOutput = yield call
        # what waiting for the other sequences' rows of the pass cost is not this draft's
        waited = max(time.perf_counter() - t1 - out.seconds, 0.0)
        tokens, q_rows, unsure = self._read(out, sampler, params.p_min, grammar, pos + 1)
        seconds = time.perf_counter() - t0 - waited  # one pass proposed them all
        return Proposal(tokens, stack_q(q_rows),
                        DraftEvidence(step_seconds=(seconds,), stopped_unsure=unsure))

    def _specs(self, sampler: Sampler | None, grammar: GrammarState | None, pos: int, n: int,
               params: DraftParams) -> list[SampleSpec] | None:
        """The block's rows chosen in its graph, one spec per row (None: on the host, as
        under a grammar, whose masks follow the picks before them)."""
        if not (params.backend_sampling and self.runner.block_samples) or grammar is not None:
            return None
        p_min = 0.0 if self.runner.built.head.has_confidence_head else params.p_min
        specs = [pick_spec(sampler, None, pos + 1 + i, p_min, self.runner.hp.n_vocab)
                 for i in range(n)]
        return None if any(s is None for s in specs) else specs  # type: ignore[return-value]

    def _read(self, out: BlockOutput, sampler: Sampler | None, p_min: float,
              grammar: GrammarState | None, first: int) -> tuple[list[int], list[QRow], bool]:
        """The proposals of a block's rows in order (the first at sequence position
        `first`): tokens, the q rows they were drawn from (none for argmax picks), and
        whether p_min stopped them."""
        confident = out.confidence  # [n] where the head judges its rows itself
        tokens: list[int] = []
        q_rows: list[QRow] = []
        for i, row in enumerate(out.logits):  # [vocab] ([0] where the graph chose)
            if confident is not None and confident[i] < p_min:
                return tokens, q_rows, True
            row_p_min = p_min if confident is None else 0.0
            chosen = None if out.sampled is None else out.sampled[i]
            pick = (pick_token(row, sampler, grammar, row_p_min, first + i) if chosen is None
                    else pick_from_block(chosen, sampler is not None, row_p_min))
            if pick.token is None:
                return tokens, q_rows, pick.unsure
            tokens.append(pick.token)
            if pick.q is not None:
                q_rows.append(pick.q)
            if grammar is not None:
                grammar.consume(pick.token)
                if grammar.is_stopped():
                    break
        return tokens, q_rows, False

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        """Inject the verified tokens' rows after the context (over the block's rows)."""
        st = self._seqs[seq]
        rows = head_input_rows(features, self.target_layers, len(tokens))  # [n, L*E]
        self.runner.inject(seq, rows, st.injected)
        st.injected += len(tokens)

    def batched_updates(self) -> AbstractContextManager[None]:
        """The injections of the sequences completed together in one pass of the head
        (where its injection graph packs them)."""
        return self.runner.deferred_injections()



class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 head: its block's candidate lattice walked from the anchor, each row's
    token the best successor of the previous row's pick, as llama.cpp walks it. The walk
    is greedy whatever the request samples (no q rows: a sampled request keeps a draft
    where the target's own draw equals it)."""

    def _read(self, out: BlockOutput, sampler: Sampler | None, p_min: float,
              grammar: GrammarState | None, first: int) -> tuple[list[int], list[QRow], bool]:
        assert out.candidates is not None and out.scores is not None
        tokens: list[int] = []
        prev = 0  # the anchor: every predecessor row of the first position is the same
        for cand, scores in zip(out.candidates, out.scores, strict=True):  # [k], [k, k]
            row = scores[prev].astype(np.float64)  # successors of the previous pick
            prev = int(np.argmax(row))
            if p_min > 0 and 1.0 / np.exp(row - row[prev]).sum() < p_min:
                return tokens, [], True
            token = int(cand[prev])
            if grammar is not None and not grammar.allowed(self.runner.built.target.n_vocab
                                                           )[token]:
                break
            tokens.append(token)
            if grammar is not None:
                grammar.consume(token)
                if grammar.is_stopped():
                    break
        return tokens, [], False
