"""A reasoning budget kept as llama.cpp's reasoning-budget sampler keeps it
(common/reasoning-budget.cpp), riding on a grammar state: counting once the start tag
is written (or from the first token where the prompt opened it), the end tag's tokens
forced one by one once the budget is spent, nothing forced after a reasoning the model
closed itself, re-armed by a new start tag; drafting's valid_prefix, fork and rollback
see it too."""

from __future__ import annotations

import numpy as np
import pytest

from specd.daemon.text.grammar import compile_constraint
from specd.daemon.text.reasoning import END, START
from specd.daemon.text.reasoning_budget import ReasoningBudget


@pytest.fixture(scope="module")
def tags(tiny_tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(tiny_tok.encode(START, add_bos=False)), tuple(tiny_tok.encode(END,
                                                                               add_bos=False))


def _state(tok, tags, budget: int, opened: bool):
    anything = compile_constraint("regex", r"(?s:.*)", tok)
    return anything.with_budget(ReasoningBudget(*tags, budget, opened)).start()


def _free_tokens(tok, n: int, seed: int = 0) -> list[int]:
    """n tokens of plain text that spell no tag."""
    rng = np.random.default_rng(seed)
    ids = tok.encode("abcdefghij klmnop qrst uvwxyz" * 4, add_bos=False)
    return [int(t) for t in rng.choice(ids, n)]


def _only(state, tok) -> int | None:
    allowed = np.flatnonzero(state.allowed(tok.vocab_size))
    return int(allowed[0]) if len(allowed) == 1 else None


def _take_forced(state, tok, n: int) -> tuple[int | None, ...]:
    """The next n tokens, each the only one allowed (None where more are), consumed."""
    forced = []
    for _ in range(n):
        forced.append(_only(state, tok))
        state.consume(forced[-1])
    return tuple(forced)


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_end_tag_is_forced_once_the_budget_is_spent(tiny_tok, tags, budget: int) -> None:
    state = _state(tiny_tok, tags, budget, opened=True)
    for t in _free_tokens(tiny_tok, budget):
        assert _only(state, tiny_tok) is None  # still free
        state.consume(t)
    assert _take_forced(state, tiny_tok, len(tags[1])) == tags[1]
    assert _only(state, tiny_tok) is None  # the answer is free
    for t in _free_tokens(tiny_tok, 20, seed=1):
        state.consume(t)
        assert _only(state, tiny_tok) is None


def test_counting_starts_at_the_start_tag_and_rearms(tiny_tok, tags) -> None:
    state = _state(tiny_tok, tags, 3, opened=False)
    for t in _free_tokens(tiny_tok, 10):  # no reasoning opened: nothing counted
        state.consume(t)
        assert _only(state, tiny_tok) is None
    for round_ in range(2):  # a reasoning opened, spent, forced closed; then again
        for t in tags[0] + tuple(_free_tokens(tiny_tok, 3, seed=round_)):
            state.consume(t)
        assert _take_forced(state, tiny_tok, len(tags[1])) == tags[1]


def test_a_reasoning_closed_within_the_budget_is_left_alone(tiny_tok, tags) -> None:
    state = _state(tiny_tok, tags, 50, opened=True)
    for t in tuple(_free_tokens(tiny_tok, 5)) + tags[1] + tuple(_free_tokens(tiny_tok, 80)):
        assert _only(state, tiny_tok) is None
        state.consume(t)


def test_drafts_see_the_budget(tiny_tok, tags) -> None:
    """valid_prefix stops a draft where it leaves the forced tokens; a fork advances
    alone; rollback returns to where the budget stood."""
    state = _state(tiny_tok, tags, 2, opened=True)
    free = _free_tokens(tiny_tok, 4)
    assert state.valid_prefix(free) == 2
    assert state.valid_prefix(free[:2] + list(tags[1]) + free) == 2 + len(tags[1]) + 4
    fork = state.fork()
    for t in free[:2]:
        fork.consume(t)
    assert _only(fork, tiny_tok) == tags[1][0] and _only(state, tiny_tok) is None
    fork.rollback(2)
    assert _only(fork, tiny_tok) is None


def test_the_message_is_forced_before_the_end_tag(tiny_tok, tags) -> None:
    message = tuple(tiny_tok.encode(" Enough.", add_bos=False))
    anything = compile_constraint("regex", r"(?s:.*)", tiny_tok)
    state = anything.with_budget(ReasoningBudget(*tags, 2, True, message)).start()
    for t in _free_tokens(tiny_tok, 2):
        state.consume(t)
    assert _take_forced(state, tiny_tok, len(message + tags[1])) == message + tags[1]
    assert _only(state, tiny_tok) is None


def test_a_character_is_never_cut_in_two(tiny_tok, tags) -> None:
    """The budget spent on a token that ends inside a UTF-8 character: forcing waits for
    a token that ends one (llama.cpp's waiting state)."""
    from specd.daemon.text.reasoning_budget import partial_utf8_ids

    partial = partial_utf8_ids(tiny_tok)
    lead, cont, last = (next(i for i in range(tiny_tok.vocab_size)
                             if tiny_tok.token_bytes(i) == b)
                        for b in (b"\xe2", b"\x82", b"\xac"))  # "€", a byte a token
    assert {lead, cont, last} <= partial
    assert not any(tiny_tok.token_bytes(i).isascii() for i in partial)
    anything = compile_constraint("regex", r"(?s:.*)", tiny_tok)
    state = anything.with_budget(ReasoningBudget(*tags, 2, True, (), partial)).start()
    state.consume(_free_tokens(tiny_tok, 1)[0])
    state.consume(lead)  # the budget is spent inside a character
    assert _only(state, tiny_tok) is None
    for t in (cont, last):  # (a lone byte is never whole, as llama.cpp reads a piece)
        state.consume(t)
        assert _only(state, tiny_tok) is None
    state.consume(tiny_tok.encode("a", add_bos=False)[0])  # one that ends whole
    assert _only(state, tiny_tok) == tags[1][0]
