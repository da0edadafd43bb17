"""A token budget for the reasoning between think tags, as llama.cpp's reasoning-budget
sampler keeps one (common/reasoning-budget.cpp; llama-server's --reasoning-budget, a
request's `thinking_budget_tokens`, Anthropic's `thinking.budget_tokens`):

* idle until the start tag's tokens are written (or counting from the first token where
  the prompt opened the reasoning);
* counting: each token spends one of the budget; the end tag's tokens end the reasoning
  (done);
* once the budget is spent, forcing: the end tag's tokens are the only ones allowed, one
  after another; then done, until a new start tag opens another reasoning (a fresh
  budget, as llama.cpp re-arms).

A budget rides on a grammar state (grammar.GrammarState), so it holds on every path a
constraint holds on: plain decoding, drafting and verification. Each consumed token's
position is kept, so that a state rolls back with its grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

IDLE, COUNTING, FORCING, DONE = "idle", "counting", "forcing", "done"


@dataclass(frozen=True)
class ReasoningBudget:
    """The tags' token ids, the budget in tokens (0: the reasoning closed at once), and
    whether the prompt opened the reasoning."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    budget: int
    in_thinking: bool = False

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
        return b.end[self.forced] if self.state == FORCING else None

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
            if forced >= len(b.end):
                return BudgetPosition(DONE, 0, 0, recent)
            return BudgetPosition(FORCING, 0, forced, recent)
        if ends:  # the model closed its reasoning itself
            return BudgetPosition(DONE, self.remaining, 0, recent)
        remaining = self.remaining - 1
        if remaining <= 0:
            return BudgetPosition(FORCING, 0, 0, ())
        return BudgetPosition(COUNTING, remaining, 0, recent)
