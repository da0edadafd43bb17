"""A token budget for the reasoning between think tags, as llama.cpp's reasoning-budget
sampler keeps one (common/reasoning-budget.cpp; llama-server's --reasoning-budget, a
request's `thinking_budget_tokens`, Anthropic's `thinking.budget_tokens`):

* idle until the start tag's tokens are written (or counting from the first token where
  the prompt opened the reasoning);
* counting: each token spends one of the budget; the end tag's tokens end the reasoning
  (done);
* once the budget is spent (and the token that spent it does not end inside a UTF-8
  character: else waiting for one that completes it), forcing: the budget's message,
  if it has one, then the end tag's tokens are the only ones allowed, one after
  another; then done, until a new start tag opens another reasoning (a fresh budget, as
  llama.cpp re-arms).

A budget rides on a grammar state (grammar.GrammarState), so it holds on every path a
constraint holds on: plain decoding, drafting and verification. Each consumed token's
position is kept, so that a state rolls back with its grammar.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, replace

from .tokenizer import Tokenizer

IDLE, COUNTING, WAITING, FORCING, DONE = "idle", "counting", "waiting", "forcing", "done"


@dataclass(frozen=True)
class ReasoningBudget:
    """The tags' token ids, the budget in tokens (0: the reasoning closed at once),
    whether the prompt opened the reasoning, the message forced before the end tag, and
    the ids of the tokens that end inside a UTF-8 character (`partial_utf8_ids`)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    budget: int
    in_thinking: bool = False
    message: tuple[int, ...] = ()
    partial: frozenset[int] = frozenset()

    @property
    def forced(self) -> tuple[int, ...]:
        """The tokens forced once the budget is spent."""
        return self.message + self.end

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("a reasoning budget needs the think tags' tokens")
        if self.budget < 0:
            raise ValueError(f"a reasoning budget is at least 0 tokens, got {self.budget}")

    def begin(self) -> BudgetPosition:
        """Where a reply starts."""
        if not self.in_thinking:
            return BudgetPosition(IDLE, self.budget)
        return BudgetPosition(FORCING if self.budget == 0 else COUNTING, self.budget)


@dataclass(frozen=True)
class BudgetPosition:
    """Where a reply stands in its budget: the state, the tokens left, how many of the
    end tag's tokens are forced already, and the last tokens (to match a tag)."""

    state: str
    remaining: int
    forced: int = 0
    recent: tuple[int, ...] = ()

    def forced_token(self, b: ReasoningBudget) -> int | None:
        """The only token allowed next (None: any)."""
        return b.forced[self.forced] if self.state == FORCING else None

    def after(self, b: ReasoningBudget, token: int) -> BudgetPosition:
        """The position once `token` is written."""
        keep = max(len(b.start), len(b.end))
        recent = (self.recent + (int(token),))[-keep:]
        ends = recent[-len(b.end):] == b.end
        if self.state in (IDLE, DONE):
            if recent[-len(b.start):] == b.start:  # a reasoning opens: a fresh budget
                return BudgetPosition(FORCING if b.budget == 0 else COUNTING, b.budget)
            return replace(self, recent=recent)
        if self.state == FORCING:
            forced = self.forced + 1
            if forced >= len(b.forced):
                return BudgetPosition(DONE, 0, 0, recent)
            return BudgetPosition(FORCING, 0, forced, recent)
        if ends:  # the model closed its reasoning itself
            return BudgetPosition(DONE, self.remaining, 0, recent)
        remaining = self.remaining - 1 if self.state == COUNTING else 0
        if remaining > 0:
            return BudgetPosition(COUNTING, remaining, 0, recent)
        if int(token) in b.partial:  # never cut a character in two
            return BudgetPosition(WAITING, 0, 0, recent)
        return BudgetPosition(FORCING, 0, 0, ())


def _utf8_partial(data: bytes) -> bool:
    """Whether `data` ends inside a UTF-8 character (llama.cpp's
    common_utf8_is_complete, negated)."""
    for i in range(1, min(4, len(data)) + 1):
        c = data[-i]
        if c & 0xC0 != 0x80:  # the last character's lead byte
            expected = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return i < expected
    return bool(data)


_partial_ids: weakref.WeakKeyDictionary[Tokenizer, frozenset[int]] = (
    weakref.WeakKeyDictionary())
_partial_lock = threading.Lock()


def partial_utf8_ids(tok: Tokenizer) -> frozenset[int]:
    """The ids of the vocabulary's tokens that end inside a UTF-8 character (found once
    per tokenizer)."""
    with _partial_lock:
        found = _partial_ids.get(tok)
        if found is None:
            found = frozenset(i for i in range(tok.vocab_size)
                              if _utf8_partial(tok.token_bytes(i)))
            _partial_ids[tok] = found
        return found
