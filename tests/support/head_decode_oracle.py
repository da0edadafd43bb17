"""specd's greedy speculative decoding with a drafter head, compared round by round with
llama.cpp's (llama-speculative-simple), a float64 numpy reference ruling on near ties.

`compare_decodes(target, head, text, n_predict=..., n_max=...)` runs both and asserts:

* **Alignment.** llama-speculative-simple evaluates its prompt but the last token and
  drafts its first round from that token; specd evaluates the whole prompt and takes its
  first token from the target alone. So llama.cpp is given specd's prompt followed by the
  text of specd's first token (checked to tokenize back to those ids, and checked again by
  llama.cpp's first round starting at the same position): both then draft their first
  round from that token, at the same position.
* **Rounds compared.** llama-speculative-simple drafts a whole block and cuts it to its
  remaining token budget (and stops cutting once that budget is 0), where specd drafts a
  smaller block; so the rounds compared are those in which both draft n_max tokens: every
  round starting at most n_predict - 1 - n_max tokens after the first. There, both sides
  must have the same number of rounds (none left over on either side), each starting at
  the same position, with the same number of drafts, every drafted token equal (llama.cpp's
  top candidate), the same accepted count and the same last token. The whole text of both
  decodes (all of llama.cpp's rounds) must be equal, and every llama.cpp round's accepted
  drafts and last token must be that text's tokens.
* **Near ties**, the only difference allowed: where the two drafts differ at a position,
  the float64 reference computes the head's scores there from the same verified context
  (and, where later drafts follow earlier picks, the same earlier drafts): the two tokens
  must be its top two, less than NEAR_TIE apart (logits; DFlash2's lattice scores). A
  DFlash block's rows do not depend on each other, so the round's other positions are
  still compared; where they do (DSpark's Markov chain, DFlash2's lattice walk, EAGLE-3's
  steps), each side's later drafts in that round are checked against the reference
  following that side's own picks (each the reference's top pick, or a near tie's
  second).
* **Resynchronisation.** Where a near tie changed the accepted count, the two decodes' rounds
  no longer start at the same positions, though they emit the same tokens. Each side's
  rounds are then skipped up to the first position at which both start a round: the next
  verified token both draft from, with the same context. Every skipped round's drafts are
  checked against the reference as above, at most MAX_SKIPPED rounds per side per tie,
  and the comparison goes on in step from there.
* **DFlash2.** llama.cpp's debug log does not show its lattice picks, only each round's
  draft length, accepted count and last token ("accepted k/n draft tokens, the last target
  token is: (id)"), which are compared as above; every specd draft is checked against the
  reference's lattice walk instead, and where the accepted counts differ, the draft at the
  first position where they do must be a near tie between the target's token and specd's.

The result counts what was compared; it fails where specd drafted nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specd.daemon.drafters.registry import HEAD_DRAFTERS
from specd.daemon.spec.drafter import DraftParams, DraftRequest, Proposal
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.head_runner import HeadRunner, load_or_build_head
from specd.ort_models.heads import HeadParams, read_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

import llama_cpp_oracle
from numpy_muse_glimmer import MuseGlimmerReference
from numpy_reference import ReferenceDFlash, ReferenceEagle3, ReferenceModel

NEAR_TIE = 1e-3  # the float64 reference's top two within this (logits): either may win
MAX_SKIPPED = 4  # rounds of one side skipped to resynchronise after one near tie
N_CTX = 256
# target architectures with their own float64 reference (else numpy_reference's)
TARGET_REFERENCES: dict[str, type[ReferenceModel]] = {"muse-glimmer": MuseGlimmerReference}


@dataclass
class SpecdRound:
    pos: int  # position of the round's first verified token (the one drafted from)
    drafts: list[int]
    emitted: list[int]  # the accepted drafts and the target's token

    @property
    def accepted(self) -> int:
        return len(self.emitted) - 1


@dataclass
class Comparison:
    """What was compared: rounds in step (with their drafts and accepted counts), near
    ties, rounds skipped to resynchronise (per side), the text's tokens."""

    kind: str
    rounds: int = 0
    drafted: int = 0  # specd's drafted tokens in the rounds compared
    drafts_compared: int = 0  # of which compared with llama.cpp's, token by token
    accepted: int = 0  # specd's drafts the target accepted in those rounds
    accepted_counts: list[int] = field(default_factory=list)  # per round compared
    near_ties: list[str] = field(default_factory=list)
    skipped: tuple[int, int] = (0, 0)  # (specd's, llama.cpp's)
    text_tokens: int = 0  # tokens of the text compared (the first one's and llama.cpp's)


def text_prompt(target: Path, text: str) -> tuple[list[int], set[int]]:
    """`text` in the target's tokens, and the target's end-of-generation ids."""
    tok = Tokenizer.from_metadata(GGUFFile(target).metadata)
    return tok.encode(text), {t for t in range(tok.vocab_size) if tok.is_eog(t)}


def target_only(target: Path, prompt: list[int], eog: set[int], max_tokens: int
                ) -> list[int]:
    """The target's own greedy text after `prompt` (default build, no drafter)."""
    gen = Generation(ModelRunner(load_or_build(target, BuildOptions()), n_ctx=N_CTX), 0,
                     prompt, GenerationParams(max_tokens=max_tokens), eog=eog)
    tokens = gen.prefill()
    while not gen.done:
        tokens += gen.step()
    gen.close()
    return tokens


def serving_decode(target: Path, head: Path, prompt: list[int], eog: set[int], *,
                   max_tokens: int, n_max: int = 3) -> tuple[list[int], Generation]:
    """Greedy decoding with the head as specd serves it (its default build: matrices
    re-quantized for specd's kernels), n_max drafts a round: the tokens and the finished
    Generation (its stats)."""
    params = read_head(GGUFFile(head))
    built = load_or_build(target, BuildOptions(hidden_layers=tuple(sorted(set(
        params.hidden_layers)))))
    drafter = HEAD_DRAFTERS[params.kind](HeadRunner(load_or_build_head(head, target),
                                                    n_ctx=N_CTX))
    gen = Generation(ModelRunner(built, n_ctx=N_CTX), 0, prompt, GenerationParams(
        max_tokens=max_tokens, draft=DraftParams(n_max=n_max)), eog=eog, drafter=drafter)
    tokens = gen.prefill()
    while not gen.done:
        tokens += gen.step()
    gen.close()
    return tokens, gen


def specd_decode(target: Path, head: Path, prompt: list[int], *, max_tokens: int, n_max: int,
                 eog: set[int]) -> tuple[list[int], list[SpecdRound]]:
    """specd's greedy decode after `prompt` with the head drafting n_max tokens a round
    (float32 products, as llama.cpp computes an F32 head; specd's default re-quantizes a
    head's matrices to Q4_K): its tokens and every round that drafted."""
    params = read_head(GGUFFile(head))
    built = load_or_build(target, BuildOptions(hidden_layers=tuple(sorted(set(
        params.hidden_layers)))))
    runner = HeadRunner(load_or_build_head(head, target, accuracy_level=1, kernels="ort"),
                        n_ctx=N_CTX)
    drafter = HEAD_DRAFTERS[params.kind](runner)
    proposed: list[tuple[int, list[int]]] = []
    propose = drafter.propose

    def record(requests: Sequence[DraftRequest], *args: Any) -> list[Proposal]:
        proposals = propose(requests, *args)
        proposed.extend((r.pos, list(p.tokens)) for r, p in zip(requests, proposals,
                                                                 strict=True))
        return proposals

    drafter.propose = record  # type: ignore[method-assign]
    gen = Generation(ModelRunner(built, n_ctx=N_CTX), 0, prompt, GenerationParams(
        max_tokens=max_tokens, draft=DraftParams(n_max=n_max), adaptive=False), eog=eog,
        drafter=drafter)
    tokens = gen.prefill()
    rounds: list[SpecdRound] = []
    while not gen.done:
        pos, n = len(prompt) + len(tokens) - 1, len(proposed)
        emitted = gen.step()
        if len(proposed) > n:
            (at, drafts), = proposed[n:]
            assert at == pos, (at, pos)
            rounds.append(SpecdRound(pos, drafts, emitted))
        tokens += emitted
    return tokens, rounds


class ReferenceHead:
    """The head's float64 scores at each drafted position of a round, from the verified
    context: `rows(context, chain, n)` gives, for positions 0..n-1, the ids and scores the
    head picks from, position i conditioned on chain[:i] where later picks follow earlier
    ones (else on the reference's own picks)."""

    def __init__(self, target: Path, head: Path, params: HeadParams):
        reference = TARGET_REFERENCES.get(GGUFFile(target).arch, ReferenceModel)
        self.target, self.head, self.params = reference(target), head, params

    def _features(self, context: list[int]) -> np.ndarray:
        inputs: dict[int, np.ndarray] = {}
        self.target.step(context[:-1], self.target.new_cache(), inputs)
        layers = self.params.target_layers
        return np.concatenate([inputs[i] for i in layers], axis=-1)  # [pos, L*E]

    def rows(self, context: list[int], chain: Sequence[int], n: int
             ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per position (ids [k], scores [k]) for a round drafting n tokens after
        context[-1] (at position len(context) - 1)."""
        pos, last, kind = len(context) - 1, context[-1], self.params.kind
        features = self._features(context)
        if kind == "eagle3":
            return self._eagle3_rows(context, features, chain, n)
        ref = ReferenceDFlash(self.head, self.target, n_ctx=N_CTX)
        ref.inject(features, np.arange(pos))
        mask = self.params.mask_token_id
        assert mask is not None
        vocab = np.arange(self.target.vocab_size)
        if kind == "dflash":
            logits = ref.block([last] + [mask] * n, pos)[1:]
            return [(vocab, row) for row in logits]
        if kind == "dspark":
            first = 0 if self.params.sample_from_anchor else 1  # the first proposing row
            logits, _ = ref.markov_block([last] + [mask] * (n - 1 + first), pos,
                                         list(range(first, first + n)), list(chain))
            return [(vocab, row) for row in logits]
        cand, scores = ref.lattice([last] + [mask] * n, pos, list(range(1, n + 1)))
        out, p = [], 0
        for r in range(n):  # the walk from the anchor, llama.cpp's (speculative.cpp)
            out.append((cand[r], scores[r, p]))
            if r < len(chain):
                hits = np.flatnonzero(cand[r] == chain[r])
                assert hits.size, f"draft {chain[r]} is not among the candidates {cand[r]}"
                p = int(hits[0])
            else:
                p = int(np.argmax(scores[r, p]))
        return out

    def _eagle3_rows(self, context: list[int], features: np.ndarray, chain: Sequence[int],
                     n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The row at position P pairs the token at P + 1 with g[P]; the row of the last
        verified pair predicts the first draft, its pre-norm output is the next row's g."""
        pos = len(context) - 1
        ref = ReferenceEagle3(self.head, self.target, n_ctx=N_CTX)
        logits, hidden = ref.step(context[1:], ref.encode(features), np.arange(pos))
        vocab = np.arange(self.target.vocab_size)
        out = [(vocab, logits[-1])]
        for i in range(1, n):
            token = chain[i - 1] if i - 1 < len(chain) else int(np.argmax(out[-1][1]))
            logits, hidden = ref.step([token], hidden[-1:], np.array([pos + i - 1]))
            out.append((vocab, logits[-1]))
        return out


def _top_two(ids: np.ndarray, scores: np.ndarray) -> tuple[int, int, float]:
    order = np.argsort(-scores, kind="stable")[:2]
    return int(ids[order[0]]), int(ids[order[1]]), float(scores[order[0]] - scores[order[1]])


def _near_tie(row: tuple[np.ndarray, np.ndarray], a: int, b: int | None, where: str) -> str:
    """Asserts a and b (None: unknown, but not a) are the reference's top two at `row`,
    within NEAR_TIE."""
    first, second, gap = _top_two(*row)
    ids, scores = row
    top = np.argsort(-scores, kind="stable")[:5]
    assert a in (first, second) and b in (first, second, None) and gap < NEAR_TIE, (
        f"{where}: drafts {a} and {b} differ, but the float64 reference's top two are "
        f"{first}, {second}, {gap:.3g} apart (a near tie is < {NEAR_TIE}) "
        f"{[(int(ids[t]), float(scores[t])) for t in top]}")
    return f"{where}: {a} / {b}, {gap:.2g} apart, reference top {first}"


def _check_chain(ref: ReferenceHead, context: list[int], drafts: list[int], start: int,
                 where: str) -> list[str]:
    """Asserts drafts[start:] follow the reference from `context` given drafts[:start]:
    each its top pick, or the second of a near tie. Returns the near ties."""
    ties = []
    for i, row in enumerate(ref.rows(context, drafts, len(drafts))):
        if i < start:
            continue
        first, second, gap = _top_two(*row)
        if drafts[i] != first:
            assert drafts[i] == second and gap < NEAR_TIE, (
                f"{where} position {i}: draft {drafts[i]}, the reference's top two "
                f"{first}, {second} ({gap:.3g} apart)")
            ties.append(f"{where} position {i}: {drafts[i]} / {first}, {gap:.2g} apart")
    return ties


def _compare_round(ref: ReferenceHead, tokens: list[int], ours: SpecdRound,
                   theirs: llama_cpp_oracle.Round, chained: bool) -> list[str]:
    """One round in step (module docstring); returns its near ties."""
    where = f"round at {ours.pos}"
    context = tokens[: ours.pos + 1]
    assert theirs.n_drafted == len(ours.drafts), (where, theirs.n_drafted, ours.drafts)
    ties: list[str] = []
    if not theirs.candidates:  # DFlash2: llama.cpp logs no picks; the reference stands in
        ties += _check_chain(ref, context, ours.drafts, 0, where)
        if ours.accepted != theirs.accepted:  # one side drafted the target's token at j
            j = min(ours.accepted, theirs.accepted)
            row = ref.rows(context, ours.drafts, j + 1)[j]
            target = tokens[ours.pos + 1 + j]
            ties.append(_near_tie(row, ours.drafts[j],
                                  None if ours.drafts[j] == target else target,
                                  f"{where} position {j}"))
        return ties
    rows: list[tuple[np.ndarray, np.ndarray]] | None = None
    for i, (a, b) in enumerate(zip(ours.drafts, theirs.drafts, strict=True)):
        if a == b:
            continue
        rows = rows or ref.rows(context, ours.drafts, len(ours.drafts))
        ties.append(_near_tie(rows[i], a, b, f"{where} position {i}"))
        if chained:  # the later drafts follow each side's pick
            ties += _check_chain(ref, context, ours.drafts, i + 1, f"specd's {where}")
            ties += _check_chain(ref, context, theirs.drafts, i + 1, f"llama.cpp's {where}")
            break
    if ours.accepted != theirs.accepted:
        assert ties, (f"{where}: the same drafts {ours.drafts}, accepted {ours.accepted} by "
                      f"specd's target and {theirs.accepted} by llama.cpp's")
    return ties


def _skip_to_common_start(ref: ReferenceHead, tokens: list[int], ours: list[SpecdRound],
                          theirs: list[llama_cpp_oracle.Round], i: int, j: int
                          ) -> tuple[int, int, list[str]]:
    """Skips each side's rounds up to the first position both start a round at, checking
    the skipped rounds' drafts against the reference (module docstring)."""
    ties: list[str] = []
    i0, j0 = i, j
    while i < len(ours) and j < len(theirs) and ours[i].pos != theirs[j].pos:
        if ours[i].pos < theirs[j].pos:
            ties += _check_chain(ref, tokens[: ours[i].pos + 1], ours[i].drafts, 0,
                                 f"specd's skipped round at {ours[i].pos}")
            i += 1
        else:
            if theirs[j].candidates:
                ties += _check_chain(ref, tokens[: theirs[j].pos + 1], theirs[j].drafts, 0,
                                     f"llama.cpp's skipped round at {theirs[j].pos}")
            j += 1
    assert i - i0 <= MAX_SKIPPED and j - j0 <= MAX_SKIPPED, (
        f"resynchronising skipped {i - i0} of specd's and {j - j0} of llama.cpp's rounds")
    return i, j, ties


def check_drafts_against_reference(target: Path, head: Path, tokens: list[int],
                                   rounds: Sequence[SpecdRound]) -> list[str]:
    """Asserts every round's drafts follow the float64 reference from that round's context
    (`tokens`: the prompt and the generated tokens): each the reference's top pick, or
    the second of a near tie. Returns the near ties."""
    ref = ReferenceHead(target, head, read_head(GGUFFile(head)))
    ties: list[str] = []
    for r in rounds:
        ties += _check_chain(ref, tokens[: r.pos + 1], r.drafts, 0, f"round at {r.pos}")
    return ties


def assert_drafts_follow_the_reference(target: Path, head: Path, text: str, max_tokens: int
                                        ) -> None:
    """specd's float32 decode of `text` with the head drafting 3 a round: at least 8 full
    rounds, every draft the float64 reference's (at most one near tie), and the greedy
    text the target's alone."""
    prompt, eog = text_prompt(target, text)
    tokens, rounds = specd_decode(target, head, prompt, max_tokens=max_tokens, n_max=3,
                                  eog=eog)
    assert len(rounds) >= 8 and all(len(r.drafts) == 3 for r in rounds[:-2])
    ties = check_drafts_against_reference(target, head, prompt + tokens, rounds)
    assert len(ties) <= 1, ties
    assert tokens == target_only(target, prompt, eog, max_tokens)


def compare_decodes(target: Path, head: Path, text: str, *, n_predict: int, n_max: int
                    ) -> Comparison:
    """specd's and llama.cpp's greedy speculative decodes of `text`, compared (module
    docstring)."""
    params = read_head(GGUFFile(head))
    tok = Tokenizer.from_metadata(GGUFFile(target).metadata)
    prompt = tok.encode(text)
    eog = {t for t in range(tok.vocab_size) if tok.is_eog(t)}
    # specd's tokens cover llama.cpp's, which may overrun n_predict by a round
    tokens, ours = specd_decode(target, head, prompt, max_tokens=n_predict + n_max + 2,
                                n_max=n_max, eog=eog)
    first = tok.decode([tokens[0]])
    assert tok.encode(text + first) == prompt + tokens[:1], (
        f"{text + first!r} does not tokenize to the prompt and specd's first token "
        f"{tokens[0]}: choose another text")
    run = llama_cpp_oracle.speculative_run(target, head, text + first,
                                           spec_type=_SPEC_TYPES[params.kind],
                                           n_predict=n_predict, n_max=n_max)
    start = len(prompt)  # the first round's position, on both sides
    full = prompt + tokens  # the whole sequence, specd's
    # every llama.cpp round: its accepted drafts and last token are the text's tokens
    at = start
    for r in run.rounds:
        assert r.pos in (-1, at), (r.pos, at)  # (-1: an empty draft logs no position)
        r.pos = at
        got = full[at + 1: at + 2 + r.accepted]
        assert r.last == got[-1] and (not r.candidates or r.drafts[: r.accepted] == got[:-1]), (
            f"llama.cpp's round at {at} emitted {r.drafts[: r.accepted]} + {r.last}, specd's "
            f"text has {got}")
        at += r.accepted + 1
    generated = at - start  # llama.cpp's tokens after the first
    want = b"".join(tok.token_bytes(t) for t in prompt + tokens[: 1 + generated]
                    if t not in eog)
    assert run.output.rstrip(b"\n") == b"\n\n" + want.rstrip(b"\n"), (run.output, want)

    last_full = start + n_predict - 1 - n_max  # the last position of a full-budget round
    mine = [r for r in ours if r.pos <= last_full]
    theirs = [r for r in run.rounds if r.pos <= last_full]
    result = Comparison(params.kind, text_tokens=1 + generated)
    ref = ReferenceHead(target, head, params)
    chained = params.kind != "dflash"
    i = j = 0
    skipped = [0, 0]
    while i < len(mine) and j < len(theirs):
        a, b = mine[i], theirs[j]
        assert a.pos == b.pos, f"rounds out of step without a near tie: {a.pos} vs {b.pos}"
        ties = _compare_round(ref, full, a, b, chained)
        result.near_ties += ties
        result.rounds += 1
        result.drafted += len(a.drafts)
        result.drafts_compared += len(b.candidates)
        result.accepted += a.accepted
        result.accepted_counts.append(a.accepted)
        i, j = i + 1, j + 1
        if a.accepted != b.accepted:  # resynchronise on the next start both share
            i2, j2, more = _skip_to_common_start(ref, full, mine, theirs, i, j)
            result.near_ties += more
            skipped[0] += i2 - i
            skipped[1] += j2 - j
            i, j = i2, j2
    assert i == len(mine) and j == len(theirs), (
        f"specd has {len(mine) - i} and llama.cpp {len(theirs) - j} more rounds")
    result.skipped = (skipped[0], skipped[1])
    assert result.drafted > 0, "specd drafted nothing"
    assert result.rounds >= 4, f"only {result.rounds} rounds compared"
    return result


# the --spec-type llama.cpp drafts each kind with (its draft-dflash runs DFlash2 heads)
_SPEC_TYPES = {"dflash": "draft-dflash", "dflash2": "draft-dflash", "dspark": "draft-dspark",
               "eagle3": "draft-eagle3"}
