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

A head of an M-RoPE target (qwen2vl) follows llama.cpp's rule for media: an image's rows,
all at one rope position (media.pinned_rows), are not injected, and the head drafts over
the gap; media whose positions advance (audio) are injected like text. Its cache then
holds a row per injected token, in order (a position's row is that position less the
tokens skipped), each rotated at the target's t position, as llama.cpp places them: the
text at its rope position (media.mrope_positions), the block at the next token's.

The head's two graphs (ort_models/head_runner.py) share one KVCache and, on the CPU, the
target's token embedding table (ort_models/shared_initializers.py). A draft is one
`BlockCall`; where the graphs run on specd's attention, the blocks and
the injections of several slots run in one pass each (injections wait for
`batched_updates` to close), a block's bits those of the block alone. `DFlash2Drafter`
walks a DFlash2 head's candidate lattice from the anchor, on the host, greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.drafter import DraftParams, DraftRequest, Features, head_input_rows
from specd.daemon.spec.media import PromptImage, mrope_positions, mrope_shift, pinned_rows
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState
from specd.ort_models.head_runner import BlockCall, BlockOutput, HeadRunner
from specd.ort_models.heads import DEFAULT_BLOCK_SIZE
from specd.ort_models.sampling_op import SampleSpec

from .model_backed import DraftRun, ModelBackedDrafter
from .picking import Pick, pick_from_block, pick_spec, pick_token


@dataclass
class _SeqState:
    injected: int = 0  # cache rows [0, injected) hold the context's K/V rows
    sampler: Sampler | None = None
    # the sequence's positions without a row (skipped images' tokens): a position past
    # the prompt has its row at the position less these
    skipped: int = 0
    # rope position minus sequence position of the tokens past the prompt's images
    rope_shift: int = 0

    @property
    def end(self) -> int:
        """The sequence position after the context the cache holds."""
        return self.injected + self.skipped

    def rope(self, pos: int, n: int) -> np.ndarray | None:
        """The rope positions [n] of the tokens at sequence positions pos.. past the
        prompt (None: they are pos.., the runner's default)."""
        if not self.skipped and not self.rope_shift:
            return None
        return np.arange(pos + self.rope_shift, pos + self.rope_shift + n, dtype=np.int64)


class DFlashDrafter(ModelBackedDrafter[_SeqState, HeadRunner]):
    one_pass = True
    catch_up = 0  # tokens skipped while the target decoded alone were injected as they came

    def __init__(self, runner: HeadRunner):
        head = runner.built.head
        if head.mask_token_id is None:
            raise ValueError(f"{runner.built.head_path.name} names no mask token")
        super().__init__()
        self.runner = runner
        self.name = head.kind
        self.target_layers = head.hidden_layers
        self.mask_id = head.mask_token_id
        # the block's first proposing row: 0 for an anchor-first DSpark block, else 1
        self.first_row = 0 if head.sample_from_anchor else 1
        self.max_drafts = (head.block_size or DEFAULT_BLOCK_SIZE) - self.first_row
        self._images: dict[int, tuple[PromptImage, ...]] = {}  # for the next begin, by seq

    def place_images(self, seq: int, images: Sequence[PromptImage]) -> None:
        """An M-RoPE target's images: their pinned rows are skipped (module docstring)."""
        if self.runner.takes_rope_positions:
            self._images[seq] = tuple(images)

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        """Inject the evaluated prompt tokens' rows (a prefix reused from an earlier request
        on this slot was injected by it: its rows are still in the cache)."""
        self._ensure_sequence(seq)
        n = 0 if features is None else next(iter(features.values())).shape[0]
        start = len(prompt) - n
        images = self._images.pop(seq, ())
        skip = pinned_rows(images, 0, len(prompt))  # [len(prompt)]
        first_row = start - int(skip[:start].sum())  # the row of the features' first token
        old = self._seqs.get(seq)
        if first_row > (old.injected if old is not None else 0):
            raise ValueError(f"the head's cache holds {old.injected if old else 0} context "
                             f"rows, the prompt's features start at row {first_row}")
        st = _SeqState(injected=first_row, sampler=sampler, skipped=int(skip.sum()),
                       rope_shift=mrope_shift(images) if images else 0)
        self._seqs[seq] = st
        if not n:
            return
        rows = head_input_rows(features, self.target_layers, n)  # [n, L*E]
        if not images:
            self.runner.inject(seq, rows, st.injected)
            st.injected += n
            return
        keep = ~skip[start:]  # [n]
        rope = mrope_positions(images, start, len(prompt))[0]  # [n] t: llama.cpp's pos[0]
        self.runner.inject(seq, rows[keep], st.injected, rope[keep])
        st.injected += int(keep.sum())

    def start(self, request: DraftRequest) -> DraftRun:
        """The draft as one BlockCall: the blocks of a batch run in one pass of the head."""
        r = request
        st = self._seqs[r.seq]
        if st.end != r.pos:
            raise RuntimeError(f"the head's context ends at {st.end}, the target at {r.pos}")
        n = min(r.n_max, self.max_drafts, self.runner.n_ctx - st.injected - self.first_row)
        rope = st.rope(r.pos, 1)
        return _BlockRun(self, r, n, st.sampler if r.params.probabilistic else None,
                         st.injected, None if rope is None else int(rope[0]))

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

    def _read(self, run: _BlockRun, out: BlockOutput) -> None:
        """The proposals of a block's rows in order, added to the run until one stops it."""
        confident = out.confidence  # [n] where the head judges its rows itself
        p_min = run.params.p_min
        for i, row in enumerate(out.logits):  # [vocab] ([0] where the graph chose)
            if confident is not None and confident[i] < p_min:
                run.unsure = True
                return
            row_p_min = p_min if confident is None else 0.0
            chosen = None if out.sampled is None else out.sampled[i]
            pick = (pick_token(row, run.sampler, run.grammar, row_p_min, run.pos + 1 + i)
                    if chosen is None
                    else pick_from_block(chosen, run.sampler is not None, row_p_min))
            if not run.add(pick):
                return

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        """Inject the verified tokens' rows after the context (over the block's rows)."""
        st = self._seqs[seq]
        rows = head_input_rows(features, self.target_layers, len(tokens))  # [n, L*E]
        self.runner.inject(seq, rows, st.injected, st.rope(st.end, len(tokens)))
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

    def _read(self, run: _BlockRun, out: BlockOutput) -> None:
        assert out.candidates is not None and out.scores is not None
        p_min, grammar = run.params.p_min, run.grammar
        prev = 0  # the anchor: every predecessor row of the first position is the same
        for cand, scores in zip(out.candidates, out.scores, strict=True):  # [k], [k, k]
            row = scores[prev].astype(np.float64)  # successors of the previous pick
            prev = int(np.argmax(row))
            if p_min > 0 and 1.0 / np.exp(row - row[prev]).sum() < p_min:
                run.unsure = True
                return
            token = int(cand[prev])
            if grammar is not None and not grammar.allowed(self.runner.built.target.n_vocab
                                                           )[token]:
                return
            if not run.add(Pick(token)):
                return


class _BlockRun(DraftRun):
    """A head's draft of one sequence: one block, its rows read in order."""

    def __init__(self, drafter: DFlashDrafter, r: DraftRequest, n: int,
                 sampler: Sampler | None, row: int, rope_pos: int | None):
        """row: the cache row the block starts at; rope_pos: its first row's rope position
        (None: row)."""
        super().__init__(r.grammar)
        self.d, self.seq, self.pos, self.n, self.params = drafter, r.seq, r.pos, n, r.params
        self.row, self.rope_pos = row, rope_pos
        self.last = r.last
        self.sampler = sampler  # None: the argmax
        self.done = n <= 0

    def call(self) -> BlockCall:
        d, first = self.d, self.d.first_row
        return BlockCall(self.seq, [self.last] + [d.mask_id] * (self.n + first - 1), self.row,
                         list(range(first, first + self.n)),
                         d._specs(self.sampler, self.grammar, self.pos, self.n, self.params),
                         self.rope_pos)

    def take(self, out: BlockOutput) -> None:
        self.d._read(self, out)
        self.done = True
