"""Tests for grammar-constrained generation (specd.daemon.grammar + masked sampling/verify).

"Models" here are deterministic random logits as a function of the prefix, over the tiny
test vocabulary (350 real gpt2 BPE tokens, logits padded to 384 rows) and, when it is in
the model store, SmolLM2's 49152-token vocabulary.  A small speculative loop, `generate`,
drives them the way the generation integrates grammars: the draft advances a fork of the
request's grammar state, the verifier advances the request's state over emitted tokens.

The statistical tests follow tests/daemon/spec/test_verify.py: the correct rule must pass a
chi-square goodness-of-fit test at p > 1e-4 and each broken variant must fail it at
p < 1e-12 with the same seeds and trial counts.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
import numpy as np
import pytest

from specd.daemon.spec.sampling import (
    NoAllowedToken,
    Sampler,
    SamplerParams,
    derive_seeds,
    mask_logits,
    softmax,
)
from specd.daemon.spec.stats import SpecStats
from specd.daemon.spec.verify import verify_greedy, verify_rejection
from specd.daemon.text import grammar as grammar_mod
from specd.daemon.text.grammar import (
    Grammar,
    GrammarError,
    GrammarState,
    GrammarViolation,
    compile_constraint,
    lltokenizer_for,
)
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile

from chi_square import FAIL_P, PASS_P, chi2_pvalue
from speculation_checks import assert_speculated

TINY_LOGITS = 384  # the tiny vocabulary has 352 ids; the "model" has more logits rows

# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    from conftest import fetched_model

    return Tokenizer.from_metadata(GGUFFile(fetched_model("smollm2-135m-instruct")).metadata)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def vocab(request: pytest.FixtureRequest) -> tuple[Tokenizer, int]:
    """(tokenizer, logits rows) for each vocabulary under test."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny_tok"), TINY_LOGITS
    tok = request.getfixturevalue("smol_tok")
    return tok, tok.vocab_size


def dead_end_tokenizer() -> Tokenizer:
    """Three one-letter tokens and an end token: no way to spell an "x"."""
    return Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": ["a", "b", "c", "<|end|>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 3],
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 3,
        }
    )


# -- random-logit "models" and a speculative loop -------------------------------------------


@dataclass(frozen=True)
class RandomLM:
    """Logits [n_vocab] as a deterministic function of the prefix."""

    n_vocab: int
    seed: int
    scale: float = 2.0
    base: RandomLM | None = None  # draft = base's logits + this model's own (noise)

    def logits(self, prefix: Sequence[int]) -> np.ndarray:
        key = zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())
        rng = np.random.default_rng([self.seed, key, len(prefix)])
        own = rng.standard_normal(self.n_vocab) * self.scale  # [n_vocab]
        return own if self.base is None else self.base.logits(prefix) + own


def generate(
    tok: Tokenizer,
    grammar: Grammar,
    target: RandomLM,
    draft: RandomLM | None,
    params: SamplerParams,
    *,
    n_draft: int = 4,
    max_tokens: int = 400,
    probabilistic: bool = False,
    stats: SpecStats | None = None,
) -> tuple[list[int], str]:
    """Constrained speculative decoding from an empty prompt: (tokens, finish reason);
    each round's drafted and accepted counts go to `stats`."""
    t_seed, d_seed = derive_seeds(params.seed)
    sampler = Sampler(params, seed=t_seed)
    draft_sampler = Sampler(SamplerParams(temperature=params.temperature or 1.0), seed=d_seed)
    state = grammar.start()
    out: list[int] = []
    while len(out) < max_tokens:
        if state.dead_end:
            return out, "grammar_dead_end"
        fork = state.fork()  # the draft proposes along its own copy
        drafts: list[int] = []
        q_rows: list[np.ndarray] = []
        room = min(n_draft, max_tokens - len(out) - 1) if draft is not None else 0
        while len(drafts) < room and not fork.is_stopped():
            row = draft.logits(out + drafts)  # [n_vocab]
            mask = fork.allowed(row.shape[0])  # [n_vocab]
            if probabilistic:
                d, q = draft_sampler.sample_with_probs(row, mask)
                q_rows.append(q)
            else:
                d = int(np.argmax(mask_logits(row, mask)))
            fork.consume(d)
            drafts.append(d)
        rows = np.stack([target.logits(out + drafts[:i]) for i in range(len(drafts) + 1)])
        if probabilistic and drafts:
            result = verify_rejection(rows, drafts, np.stack(q_rows), sampler, state)
        else:
            result = verify_greedy(rows, drafts, sampler, state)
        if stats is not None:
            stats.record_round(len(drafts), result.n_accepted)
        for t in result.tokens:
            out.append(t)
            if t in tok.eot_ids:
                return out, "stop"
        if result.grammar_dead_end:
            return out, "grammar_dead_end"
    return out, "length"


def text_of(tok: Tokenizer, tokens: Sequence[int]) -> str:
    return tok.decode([t for t in tokens if t not in tok.eot_ids])


# -- compiling ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("regex", "[ab", "unclosed character class"),
        ("regex", "a(b", "unclosed group"),
        ("json_schema", {"type": "integer", "minimum": "x"}, "minimum"),
        ("json_schema", {"type": "strin"}, "strin"),
        ("json_schema", {"properties": {"a": {"$ref": "#/nope"}}}, "/nope"),
        ("json_schema", '{"type": "object"', "not JSON"),
        ("json_schema", "[1, 2]", "JSON object"),
        ("json_schema", False, "the schema false allows no value"),
        ("lark", "start: foo", 'unknown name: "foo"'),
        ("lark", 'start: ("a"', "Expected token ')'"),
        ("gbnf", 'root ::= "a" (', "Expected ')'"),
        ("regex", 42, "must be a string"),
        ("xml", "<a/>", "unknown constraint kind 'xml'"),
        ("regex", "a\ud800", "not valid Unicode text"),  # a lone surrogate from JSON
        # GBNF, though it has a rule "start" (Lark's start rule): named, not a Lark error
        ("lark", 'start ::= "x"\nroot ::= start', "Rule 'start' already exists"),
        ("lark", 'start: "\ud800"', "not valid Unicode text"),
    ],
)
def test_bad_constraints_raise_grammar_error(
    tiny_tok: Tokenizer, kind: str, spec: Any, message: str
) -> None:
    with pytest.raises(GrammarError) as info:
        compile_constraint(kind, spec, tiny_tok)
    assert message in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)  # the HTTP layer maps ValueError-ish to 400
    assert "<state>" not in str(info.value)


def _complete(tok: Tokenizer, grammar: Grammar, text: str) -> GrammarState:
    state = grammar.start()
    for t in tok.encode(text, add_bos=False, parse_special=False):
        state.consume(t)
    return state


@pytest.mark.parametrize(
    ("kind", "spec", "good", "bad"),
    [
        ("regex", "[ab]{1,3}", "abb", "abc"),
        ("lark", 'start: "x" item+\nitem: "a" | "b"', "xab", "xc"),
        ("lark", 'root ::= "x" [ab]+', "xab", "xc"),  # GBNF given as lark: converted
        ("gbnf", 'root ::= "x" ("a" | "b")+', "xba", "xc"),
        ("json_object", None, '{"k": [1, "v"]}', "[1]"),
        ("json_schema", {"type": "integer", "maximum": 20}, "17", "21"),
        ("json_schema", '{"enum": ["on", "off"]}', '"off"', '"of"x'),
    ],
)
def test_good_constraints_accept_their_language(
    tiny_tok: Tokenizer, kind: str, spec: Any, good: str, bad: str
) -> None:
    grammar = compile_constraint(kind, spec, tiny_tok)
    assert _complete(tiny_tok, grammar, good).is_accepting()
    state = grammar.start()
    ids = tiny_tok.encode(bad, add_bos=False, parse_special=False)
    assert state.valid_prefix(ids) < len(ids)
    with pytest.raises(GrammarViolation):
        for t in ids:
            state.consume(t)


def test_tokenizer_and_compiled_constraints_are_cached(tiny_tok: Tokenizer) -> None:
    assert lltokenizer_for(tiny_tok) is lltokenizer_for(tiny_tok)
    a = compile_constraint("json_schema", {"type": "string", "maxLength": 3}, tiny_tok)
    b = compile_constraint("json_schema", '{"type": "string", "maxLength": 3}', tiny_tok)
    assert a is b
    assert a.start() is not a.start()


def test_json_schema_properties_come_in_the_schemas_order(tiny_tok: Tokenizer) -> None:
    """"reasoning" before "answer" when the schema lists them so (OpenAI's order too)."""
    props = {"reasoning": {"type": "string"}, "answer": {"type": "integer"}}
    first = {"type": "object", "properties": props, "required": ["reasoning", "answer"]}
    swapped = {**first, "properties": dict(reversed(props.items()))}
    in_order = tiny_tok.encode('{"reasoning": "x", "answer": 1}', add_bos=False)
    other = tiny_tok.encode('{"answer": 1, "reasoning": "x"}', add_bos=False)
    for schema, good, bad in ((first, in_order, other), (swapped, other, in_order)):
        state = compile_constraint("json_schema", schema, tiny_tok).start()
        assert state.valid_prefix(good) == len(good)
        assert state.valid_prefix(bad) < len(bad)


def test_a_grammar_failing_inside_llguidance_is_a_dead_end(tiny_tok: Tokenizer) -> None:
    """The mask allows "a", but consuming it exceeds llguidance's lexer limit: the state
    becomes a dead end (the request ends "grammar_dead_end"), nothing raises."""
    state = compile_constraint("regex", "(a{1000}){1000}", tiny_tok).start()
    a = tiny_tok.encode("a", add_bos=False)[0]
    assert state.is_allowed(a)
    state.consume(a)
    assert state.dead_end and state.is_stopped() and not state.allowed(TINY_LOGITS).any()
    assert "too many expressions" in (state.stop_reason or "")


def test_json_whitespace_is_bounded(tiny_tok: Tokenizer) -> None:
    state = _complete(tiny_tok, compile_constraint("json_object", None, tiny_tok), '{"a":')
    space = tiny_tok.encode(" ", add_bos=False)[0]
    state.consume(space)
    assert not state.is_allowed(space)  # one space, not a run of them


# -- the state: masks, EOS, fork, rollback -------------------------------------------------------


def test_mask_is_padded_and_eos_allowed_only_when_accepting(tiny_tok: Tokenizer) -> None:
    grammar = compile_constraint("regex", "[ab]{1,3}", tiny_tok)
    state = grammar.start()
    a, b = (tiny_tok.encode(c, add_bos=False)[0] for c in "ab")
    eos = tiny_tok.eos_id
    mask = state.allowed(TINY_LOGITS)
    assert mask.shape == (TINY_LOGITS,) and mask.dtype == np.bool_
    assert set(np.flatnonzero(mask)) == {a, b}
    assert not mask[tiny_tok.vocab_size :].any()
    assert state.allowed(10).shape == (10,)  # cut to a narrower width as well
    with pytest.raises(ValueError):
        mask[a] = False  # read-only: it is shared with the cache
    state.consume(a)
    assert state.is_accepting() and not state.is_stopped()
    assert set(np.flatnonzero(state.allowed(TINY_LOGITS))) == {a, b, *tiny_tok.eot_ids}
    state.consume(b)
    state.consume(b)
    assert state.is_stopped() and state.is_accepting() and not state.dead_end
    assert set(np.flatnonzero(state.allowed(TINY_LOGITS))) == set(tiny_tok.eot_ids)
    assert state.stop_reason == "NoExtension"
    state.consume(eos)
    assert state.is_stopped() and state.n_consumed == 4
    state.rollback(2)  # the EOS and one "b" (llguidance did not record the EOS)
    assert state.n_consumed == 2 and not state.is_stopped() and state.is_accepting()
    assert set(np.flatnonzero(state.allowed(TINY_LOGITS))) == {a, b, *tiny_tok.eot_ids}
    state.consume(tiny_tok.eos_id)
    assert state.stop_reason == "EndOfSentence"
    state.rollback(3)
    assert state.n_consumed == 0 and set(np.flatnonzero(state.allowed(TINY_LOGITS))) == {a, b}


def test_consume_rejects_a_disallowed_token_and_keeps_the_state(tiny_tok: Tokenizer) -> None:
    state = compile_constraint("regex", "[ab]{1,3}", tiny_tok).start()
    a, c = (tiny_tok.encode(ch, add_bos=False)[0] for ch in "ac")
    for bad in (c, tiny_tok.eos_id, TINY_LOGITS - 1, 10**6, -1):
        with pytest.raises(GrammarViolation):
            state.consume(bad)
        assert not state.dead_end and state.n_consumed == 0
    assert state.valid_prefix([a, a, 10**6]) == 2  # out of range ids never reach llguidance
    state.consume(a)
    assert state.n_consumed == 1 and state.is_accepting()


def test_fork_is_independent_and_rollback_restores(tiny_tok: Tokenizer) -> None:
    grammar = compile_constraint(
        "json_schema", {"type": "array", "items": {"enum": [1, 22]}}, tiny_tok
    )
    state = _complete(tiny_tok, grammar, "[1,")
    before = state.allowed(TINY_LOGITS).copy()
    fork = state.fork()
    for t in tiny_tok.encode("22]", add_bos=False):
        fork.consume(t)
    assert fork.is_accepting() and not state.is_accepting()
    assert np.array_equal(state.allowed(TINY_LOGITS), before)
    fork.rollback(fork.n_consumed - state.n_consumed)
    assert np.array_equal(fork.allowed(TINY_LOGITS), before)
    with pytest.raises(ValueError):
        fork.rollback(fork.n_consumed + 1)


def test_dead_end_is_reported() -> None:
    tok = dead_end_tokenizer()
    grammar = compile_constraint("regex", "ax|b", tok)
    state = grammar.start()
    assert np.flatnonzero(state.allowed(4)).tolist() == [0, 1]  # "a" is a valid prefix...
    state.consume(0)
    assert state.dead_end and state.is_stopped() and not state.is_accepting()  # ...of "ax"
    assert not state.allowed(4).any()
    assert state.stop_reason is not None
    # the verifier cuts the block where the grammar died; the draft ran past it
    sampler = Sampler(SamplerParams(temperature=0.0))
    fresh = grammar.start()
    rows = np.zeros((3, 4))
    rows[0, 0] = 5.0  # the target likes "a" at row 0
    result = verify_greedy(rows, [0, 2], sampler, fresh)
    assert result.tokens == [0] and result.n_accepted == 1 and result.grammar_dead_end
    with pytest.raises(NoAllowedToken):  # at row 0 the caller must check dead_end first
        verify_greedy(rows, [0, 2], sampler, fresh)
    # and the whole loop finishes with the dead end
    lm = RandomLM(4, seed=1)
    for seed in range(6):
        out, reason = generate(tok, grammar, lm, lm, SamplerParams(temperature=1.0, seed=seed))
        assert (out, reason) in (([0], "grammar_dead_end"), ([1, 3], "stop"))


def test_a_draft_that_completes_the_grammar_counts_as_accepted() -> None:
    """The block ends on the accepted draft that completes the constraint: every token
    it emitted is an accepted draft (the acceptance statistics count them all)."""
    tok = dead_end_tokenizer()
    grammar = compile_constraint("regex", "ab", tok)
    rows = np.zeros((4, 4))
    rows[0, 0] = rows[1, 1] = 5.0  # the target writes "a", then "b"
    greedy = verify_greedy(rows, [0, 1, 2], Sampler(SamplerParams(temperature=0.0)),
                           grammar.start())
    assert greedy.tokens == [0, 1] and greedy.n_accepted == 2
    q = np.full((3, 4), 0.25)
    sampled = verify_rejection(rows * 10, [0, 1, 2], q,
                               Sampler(SamplerParams(temperature=1.0, seed=3)),
                               grammar.start())
    assert sampled.tokens == [0, 1] and sampled.n_accepted == 2


# -- masked sampling -----------------------------------------------------------------------------


def test_masked_probs_are_the_renormalised_allowed_distribution() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50)
    mask = rng.random(50) < 0.3
    p = Sampler(SamplerParams(temperature=1.0)).probs(logits, mask)
    expected = np.where(mask, softmax(logits), 0.0)
    # softmax's exp is float32: two routes to the same probabilities agree to its ulps
    assert np.allclose(p, expected / expected.sum(), rtol=1e-6, atol=0)
    full = np.ones(50, dtype=bool)
    sampler = Sampler(SamplerParams(temperature=0.7, top_k=5))
    assert np.array_equal(sampler.probs(logits, full), sampler.probs(logits))


def test_filters_see_only_allowed_tokens() -> None:
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    mask = np.array([True, False, False, True, True, True])
    p = Sampler(SamplerParams(temperature=1.0, top_k=2)).probs(logits, mask)
    assert np.flatnonzero(p).tolist() == [0, 3]
    p = Sampler(SamplerParams(temperature=1.0, min_p=0.3)).probs(logits, ~mask)
    assert np.flatnonzero(p).tolist() == [1, 2]  # min_p relative to the best allowed token


def test_masked_greedy_is_argmax_among_allowed() -> None:
    greedy = Sampler(SamplerParams(temperature=0.0))
    logits = np.array([1.0, 9.0, 3.0, 3.0, 2.0])
    mask = np.array([True, False, True, True, False])
    assert greedy.sample(logits, mask) == 2  # ties to the lowest id
    with pytest.raises(NoAllowedToken):
        greedy.sample(logits, np.zeros(5, dtype=bool))
    with pytest.raises(ValueError, match="mask"):
        greedy.sample(logits, np.ones(4, dtype=bool))
    with pytest.raises(ValueError, match="mask"):
        greedy.sample(logits, np.ones(5, dtype=np.int8))


def test_masked_sample_never_leaves_the_mask() -> None:
    rng = np.random.default_rng(1)
    sampler = Sampler(SamplerParams(temperature=1.5, top_p=0.95), seed=2)
    for _ in range(300):
        logits = rng.standard_normal(40) * 3
        mask = rng.random(40) < 0.1
        mask[rng.integers(40)] = True
        token, q = sampler.sample_with_probs(logits, mask)
        assert mask[token] and q[~mask].sum() == 0.0 and math.isclose(q.sum(), 1.0)


# -- JSON schema generation ------------------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "kind": {"enum": ["cat", "dog", 3, None]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "ok": {"type": "boolean"},
                "code": {"type": "string", "pattern": "^[A-F0-9]{2}-[0-9]{1,3}$"},
            },
            "required": ["id", "ok", "code"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "owner"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("temperature", "probabilistic"),
    [(0.0, False), (1.0, False), (1.0, True)],
    ids=["greedy", "sampled-greedy-verify", "sampled-rejection"],
)
def test_json_schema_outputs_validate(
    vocab: tuple[Tokenizer, int], temperature: float, probabilistic: bool
) -> None:
    tok, n_vocab = vocab
    grammar = compile_constraint("json_schema", SCHEMA, tok)
    n_runs = 3 if n_vocab == TINY_LOGITS else 2
    for run in range(n_runs):
        target = RandomLM(n_vocab, seed=run)
        draft = RandomLM(n_vocab, seed=100 + run, scale=1.0, base=target)
        params = SamplerParams(temperature=temperature, seed=run)
        out, reason = generate(tok, grammar, target, draft, params, probabilistic=probabilistic)
        assert reason == "stop", (reason, text_of(tok, out))
        jsonschema.validate(json.loads(text_of(tok, out)), SCHEMA)


# -- greedy verification under a grammar == constrained greedy decoding ----------------------------


@pytest.mark.parametrize("n_draft", [1, 3, 6])
def test_greedy_with_draft_equals_greedy_without(
    vocab: tuple[Tokenizer, int], n_draft: int
) -> None:
    tok, n_vocab = vocab
    grammar = compile_constraint("json_schema", SCHEMA, tok)
    target = RandomLM(n_vocab, seed=11)
    params = SamplerParams(temperature=0.0)
    plain, plain_reason = generate(tok, grammar, target, None, params)
    assert plain_reason == "stop"
    for scale in (0.3, 3.0):  # a draft that mostly agrees, and one that mostly does not
        draft = RandomLM(n_vocab, seed=12, scale=scale, base=target)
        stats = SpecStats()
        assert generate(tok, grammar, target, draft, params, n_draft=n_draft,
                        stats=stats) == (plain, "stop")
        if scale < 1:
            assert_speculated(stats)
        else:  # drafted, and rejected at some position
            assert stats.rounds > 0 and stats.accepted < stats.drafted, stats.as_dict()


def test_unconstrained_draft_is_corrected_by_the_grammar(tiny_tok: Tokenizer) -> None:
    """A draft that ignores the grammar (raw argmax) still gives the constrained output."""
    grammar = compile_constraint("json_schema", SCHEMA, tiny_tok)
    target = RandomLM(TINY_LOGITS, seed=5)
    params = SamplerParams(temperature=0.0)
    plain, _ = generate(tiny_tok, grammar, target, None, params)
    state = grammar.start()
    sampler = Sampler(params)
    out: list[int] = []
    while not out or out[-1] not in tiny_tok.eot_ids:
        drafts = [int(np.argmax(target.logits(out)))] * 3  # mostly not allowed at all
        rows = np.stack([target.logits(out + drafts[:i]) for i in range(4)])
        result = verify_greedy(rows, drafts, sampler, state)
        out.extend(result.tokens)
        assert len(out) < 500
    assert out[: len(plain)] == plain


def test_sampled_greedy_verify_equals_sampling_without_draft(tiny_tok: Tokenizer) -> None:
    """verify_greedy draws one uniform per emitted token: same seed, same tokens."""
    grammar = compile_constraint("json_schema", SCHEMA, tiny_tok)
    target = RandomLM(TINY_LOGITS, seed=3)
    for seed in range(3):
        params = SamplerParams(temperature=1.0, seed=seed)
        plain = generate(tiny_tok, grammar, target, None, params)
        draft = RandomLM(TINY_LOGITS, seed=4, scale=0.5, base=target)
        stats = SpecStats()
        assert generate(tiny_tok, grammar, target, draft, params, n_draft=4,
                        stats=stats) == plain
        assert_speculated(stats)


# -- distribution exactness of constrained rejection sampling ------------------------------------

N_TRIALS = 12_000
REGEX = "[a-f][a-z]{0,2}"  # first token: a..f or a merge like "an", "ed", "def"


@dataclass
class _ExactnessSetup:
    tok: Tokenizer
    grammar: Grammar
    mask0: np.ndarray  # [V] allowed first tokens
    p0: np.ndarray  # [V] the constrained target distribution of the first token
    q_raw: np.ndarray  # [V] the draft's unconstrained distribution (every position)
    target_logits: np.ndarray  # [V] the target's logits (every position)


@pytest.fixture(scope="module")
def exactness(tiny_tok: Tokenizer) -> _ExactnessSetup:
    grammar = compile_constraint("regex", REGEX, tiny_tok)
    mask0 = grammar.start().allowed(TINY_LOGITS)
    rng = np.random.default_rng(2024)
    allowed = np.flatnonzero(mask0)
    assert 8 <= allowed.shape[0] <= 40
    target_logits = rng.standard_normal(TINY_LOGITS) * 3.0
    target_logits[allowed] = rng.uniform(-1.0, 1.0, allowed.shape[0])  # every cell well filled
    p0 = Sampler(SamplerParams(temperature=1.0)).probs(target_logits, mask0)
    # the draft: only ~40% of its mass on allowed tokens, shaped unlike the target there
    q_raw = rng.dirichlet(np.ones(TINY_LOGITS))
    q_raw[allowed] = rng.uniform(0.2, 1.0, allowed.shape[0])[::-1]
    q_raw[allowed] *= 0.4 / q_raw[allowed].sum()
    q_raw[~mask0] *= 0.6 / q_raw[~mask0].sum()
    return _ExactnessSetup(tiny_tok, grammar, mask0, p0, q_raw, target_logits)


def _first_token_counts(
    setup: _ExactnessSetup, *, draft_uses_grammar: bool, draft_masked: bool, seed: int = 9
) -> np.ndarray:
    """Histogram of the first emitted token over N_TRIALS verification rounds of 2 drafts.

    The draft samples each proposal from q_raw, restricted to its fork's mask and
    renormalised when ``draft_uses_grammar``; it always reports the unmasked q_raw rows.
    """
    sampler = Sampler(SamplerParams(temperature=1.0), seed=seed)
    rng = np.random.default_rng(seed + 1)
    rows = np.tile(setup.target_logits, (3, 1))  # [3, V]
    q_rows = np.tile(setup.q_raw, (2, 1))  # [2, V]
    state = setup.grammar.start()
    masked_q: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n consumed-prefix cache

    def draw(fork: GrammarState, key: int) -> int:
        if not draft_uses_grammar:
            return int(rng.choice(TINY_LOGITS, p=setup.q_raw))
        if key not in masked_q:
            q = np.where(fork.allowed(TINY_LOGITS), setup.q_raw, 0.0)
            masked_q[key] = (np.flatnonzero(q), np.cumsum(q[q > 0]) / q.sum())
        ids, cdf = masked_q[key]
        return int(ids[min(np.searchsorted(cdf, rng.random(), side="right"), ids.shape[0] - 1)])

    counts = np.zeros(TINY_LOGITS, dtype=np.int64)
    for _ in range(N_TRIALS):
        fork = state.fork()
        d0 = draw(fork, -1)
        drafts = [d0]
        if fork.is_allowed(d0):
            fork.consume(d0)
            if not fork.dead_end:
                drafts.append(draw(fork, d0))
        if len(drafts) == 1:
            drafts.append(d0)  # past an invalid token anything goes: it is never reached
        result = verify_rejection(rows, drafts, q_rows, sampler, state, draft_masked=draft_masked)
        counts[result.tokens[0]] += 1
        state.rollback(state.n_consumed)
    return counts


def test_constrained_rejection_sampling_is_exact(exactness: _ExactnessSetup) -> None:
    counts = _first_token_counts(exactness, draft_uses_grammar=True, draft_masked=True)
    assert chi2_pvalue(counts, exactness.p0) > PASS_P


def test_constrained_rejection_without_renormalising_q_is_biased(
    exactness: _ExactnessSetup,
) -> None:
    # mask p but leave q unrenormalised, while the draft drew from the renormalised q
    counts = _first_token_counts(exactness, draft_uses_grammar=True, draft_masked=False)
    assert chi2_pvalue(counts, exactness.p0) < FAIL_P


def test_constrained_rejection_of_an_unconstrained_draft(exactness: _ExactnessSetup) -> None:
    # a draft that ignored the grammar: exact only when q is NOT renormalised
    exact = _first_token_counts(exactness, draft_uses_grammar=False, draft_masked=False)
    assert chi2_pvalue(exact, exactness.p0) > PASS_P
    biased = _first_token_counts(exactness, draft_uses_grammar=False, draft_masked=True)
    assert chi2_pvalue(biased, exactness.p0) < FAIL_P


def test_unmasked_target_is_not_the_constrained_distribution(
    exactness: _ExactnessSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test sees a verifier that forgets to mask p (off-mask tokens come out)."""
    original = Sampler.probs

    def unmasked(self: Sampler, logits: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        return original(self, logits)

    monkeypatch.setattr(Sampler, "probs", unmasked)
    monkeypatch.setattr(grammar_mod.GrammarState, "consume", lambda self, token: None)
    counts = _first_token_counts(exactness, draft_uses_grammar=True, draft_masked=True)
    assert chi2_pvalue(counts, exactness.p0) < FAIL_P


def _store_tokenizer(name: str) -> Tokenizer:
    from conftest import fetched_model

    return Tokenizer.from_metadata(GGUFFile(fetched_model(name)).metadata)


@pytest.mark.real
def test_user_defined_tokens_are_text_a_grammar_names() -> None:
    """Qwen's <tool_call> (151657) is a user-defined token the tokenizer makes of that text
    even without special parsing: a grammar's literal "<tool_call>" must match it and go
    on after it (it was a dead end after one token), and `<tool_call>` names it. Gemma's
    <table> is another."""
    from specd.daemon.text.tool_calls import forced_call_grammar

    tok = _store_tokenizer("qwen2.5-coder-0.5b-instruct")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.encode(call, add_bos=False, parse_special=False)
    assert ids[0] == 151657 and ids[-1] == 151658
    for source in (forced_call_grammar(tools), forced_call_grammar(tools, "get_weather", False),
                   'start: <tool_call> /(.|\\n)*/ </tool_call>'):
        state = compile_constraint("lark", source, tok).start()
        assert state.allowed(151936)[151657]
        for t in ids:
            state.consume(t)
        assert state.is_accepting() and not state.dead_end, source
    state = compile_constraint("lark", 'start: "say " <tool_call>', tok).start()
    say = tok.encode("say <tool_call>", add_bos=False)
    assert say[-1] == 151657 and state.valid_prefix(say) == len(say)
    with pytest.raises(GrammarError, match='unknown special token: "<nope>"') as info:
        compile_constraint("lark", 'start: <nope> "x"', tok)
    assert "<|im_start|>" not in str(info.value)  # not the list of them all

    gemma = _store_tokenizer("gemma-3-270m")
    html = gemma.encode("<table><tr>", add_bos=False, parse_special=False)
    assert gemma.token_bytes(html[0]) == b"<table>"
    state = compile_constraint("regex", "<table><tr>", gemma).start()
    for t in html:
        state.consume(t)
    assert state.is_accepting()


# -- JSON numbers' digit runs ------------------------------------------------------------------


def _walk(state: GrammarState, tok: Tokenizer, text: str) -> None:
    for t in tok.encode(text, add_bos=False, parse_special=False):
        state.consume(t)


def _digits_allowed(state: GrammarState, tok: Tokenizer, n_vocab: int) -> set[str]:
    mask = state.allowed(n_vocab)
    return {d for d in "0123456789"
            if all(mask[t] for t in tok.encode(d, add_bos=False, parse_special=False))}


def test_json_numbers_digit_runs_are_bounded_as_llama_cpp_bounds_them(vocab) -> None:
    """At most NUMBER_DIGITS (16) digits in a number's integral part, its fraction and its
    exponent (llama.cpp's [1-9][0-9]{0,15} and [0-9]{1,16}); strings are free; a schema
    whose own bound needs more digits keeps them; other kinds are not bounded."""
    tok, n_vocab = vocab
    numbers = compile_constraint("json_schema", {"type": "array", "items": {"type": "number"}},
                                 tok)
    state = numbers.start()
    _walk(state, tok, "[" + "1" * 15)
    assert _digits_allowed(state, tok, n_vocab) == set("0123456789")
    _walk(state, tok, "2")
    assert _digits_allowed(state, tok, n_vocab) == set()  # 16: the integral part is full
    assert state.allowed(n_vocab)[tok.encode(".", add_bos=False)[0]]
    fork = state.fork()
    _walk(fork, tok, ".")
    assert _digits_allowed(fork, tok, n_vocab) == set("0123456789")  # the fraction's own run
    _walk(fork, tok, "5" * 16)
    assert _digits_allowed(fork, tok, n_vocab) == set()
    _walk(fork, tok, "e-")
    assert _digits_allowed(fork, tok, n_vocab) == set("0123456789")  # the exponent's own run
    fork.rollback(len(tok.encode("e-", add_bos=False)))
    assert _digits_allowed(fork, tok, n_vocab) == set()  # back after 16 fraction digits
    assert _digits_allowed(state, tok, n_vocab) == set()  # the fork left the state alone
    assert state.valid_prefix(tok.encode("3", add_bos=False)) == 0

    strings = compile_constraint("json_schema", {"type": "array", "items": {"type": "string"}},
                                 tok).start()
    _walk(strings, tok, '["' + "1" * 40)
    assert _digits_allowed(strings, tok, n_vocab) == set("0123456789")

    big = compile_constraint("json_schema", {"type": "integer", "minimum": 10**17}, tok).start()
    _walk(big, tok, "1" * 16)
    assert _digits_allowed(big, tok, n_vocab) == set("0123456789")  # only digits may follow

    regex = compile_constraint("regex", "[0-9]+", tok).start()
    _walk(regex, tok, "1" * 40)
    assert _digits_allowed(regex, tok, n_vocab) == set("0123456789")
