"""Grammar-constrained generation: llguidance matchers over specd's tokenizer.

One request with a constraint::

    grammar = compile_constraint("json_schema", schema, tokenizer)   # GrammarError -> 400
    state = grammar.start()                                           # one per request
    mask = state.allowed(n_vocab)        # [n_vocab] bool: tokens that may come next
    token = sampler.sample(logits, mask)
    state.consume(token)

Under speculation the draft advances ``state.fork()`` along its own proposals (sampling
each under the fork's mask), and the verifier advances the request's state only over the
tokens it emits (``verify_greedy`` / ``verify_rejection`` with ``grammar=state``).

The llguidance tokenizer is built from :meth:`Tokenizer.token_bytes` (the bytes each id
stands for, the same table specd decodes with), so the grammar sees exactly the text the
client will get.  Control, unknown and unused tokens are special to llguidance: they never
match grammar text, and a grammar names them as ``<|im_start|>`` or ``<[id]>``.
User-defined tokens (Qwen's ``<tool_call>``, Gemma's ``<table>``) are text: the tokenizer
makes them of that text even without special parsing, so a grammar's literal
``"<tool_call>"`` must be able to match them (as special tokens it was a dead end after
their first token); ``<tool_call>`` in a grammar names them too.  Every
end-of-generation id (``Tokenizer.eot_ids``) is an EOS for llguidance: those are allowed
exactly when the text so far is a complete match.  Ids at or past the tokenizer's size
(logits rows that pad the vocabulary, e.g. Qwen2.5's) are never allowed.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark, gbnf_to_lark
from tokenizers import Tokenizer as _Backend
from tokenizers import normalizers

from .reasoning_budget import BudgetPosition, ReasoningBudget
from .tokenizer import CONTROL, SPIECE_SPACE, UNKNOWN, UNUSED, USER_DEFINED, Tokenizer

if TYPE_CHECKING:  # a TypedDict of the extension's stub only
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "CONSTRAINT_KINDS",
    "JSON_WHITESPACE",
    "Grammar",
    "GrammarError",
    "GrammarState",
    "GrammarViolation",
    "compile_constraint",
    "lltokenizer_for",
]

CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "lark", "gbnf")

# Whitespace a JSON constraint allows between tokens: none, one space, or one or two
# newlines and an indent of at most 20 (llama.cpp's json-schema-to-grammar `space` rule).
# llguidance's own default allows any amount, which lets a model loop on whitespace.
# A schema's "x-guidance" options override this.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"

_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_pattern": JSON_WHITESPACE}
_COMPILED_CACHE_SIZE = 64  # compiled constraints kept per tokenizer


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the problem."""


class GrammarViolation(ValueError):
    """A token the grammar does not allow at this point was consumed."""


# --- the llguidance tokenizer, one per specd Tokenizer -------------------------------------


class _TokenizerView:
    """What ``llguidance.TokenizerWrapper`` needs: token bytes, EOS, special ids, encode."""

    def __init__(self, tok: Tokenizer) -> None:
        eog = sorted(tok.eot_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        if not eog:
            raise GrammarError(
                "the model's vocabulary has no end-of-generation token, so a constrained "
                "output could never end"
            )
        self.eog_ids: list[int] = eog
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else eog[0]
        self.bos_token_id = tok.bos_id
        n = tok.vocab_size
        self.tokens: list[bytes] = [tok.token_bytes(i) for i in range(n)]
        self.special_token_ids: list[int] = [
            i for i in range(n) if tok.token_type(i) in (CONTROL, UNKNOWN, UNUSED)
        ]
        # user-defined tokens spelled <...>, which a grammar may name as special ones
        self.named_text_tokens: dict[str, int] = {
            text: i for i in range(n) if tok.token_type(i) == USER_DEFINED
            and _TOKEN_NAME.fullmatch(text := self.tokens[i].decode("utf-8", "replace"))}
        self._tok = tok
        self._plain: _Backend | None = None
        if tok.strips_leading_space:
            # encode() puts "▁" in front of the text; llguidance wants the text's own tokens
            plain = _Backend(tok.backend.model)
            plain.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
            self._plain = plain

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes: say we take str
            raise TypeError("text must be str")
        if self._plain is not None:
            return list(self._plain.encode(text, add_special_tokens=False).ids)
        return self._tok.encode(text, add_bos=False, add_eos=False, parse_special=False)


NUMBER_DIGITS = 16  # llama.cpp's json-schema-to-grammar: [1-9][0-9]{0,15}, [0-9]{1,16}
_DIGITS = frozenset(b"0123456789")


class _TokenDigits:
    """What bounding JSON numbers' digit runs needs of a vocabulary: each token's bytes
    and how many ASCII digits it begins with."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens
        lead = np.zeros(len(tokens), dtype=np.int32)  # [n_tokens]
        for i, data in enumerate(tokens):
            n = 0
            while n < len(data) and data[n] in _DIGITS:
                n += 1
            lead[i] = n
        self.lead = lead


@dataclass(frozen=True)
class _JsonScan:
    """Where JSON text stands for digit runs: inside a string (after a backslash), and
    the length of the run of digits outside strings that it ends with."""

    in_string: bool = False
    escaped: bool = False
    run: int = 0

    def after(self, data: bytes) -> _JsonScan:
        in_string, escaped, run = self.in_string, self.escaped, self.run
        for b in data:
            if in_string:
                if escaped:
                    escaped = False
                elif b == 0x5C:  # backslash
                    escaped = True
                elif b == 0x22:  # quote
                    in_string = False
            elif b == 0x22:
                in_string, run = True, 0
            else:
                run = run + 1 if b in _DIGITS else 0
        return _JsonScan(in_string, escaped, run)


# what llguidance's Lark syntax takes as a token's name: <...> without space or quotes
_TOKEN_NAME = re.compile(r'<[^\s<>"]+>')


@dataclass
class _TokenizerEntry:
    lltok: llg.LLTokenizer
    n_tokens: int
    eog_ids: tuple[int, ...]
    compiled: OrderedDict[tuple[str, str], Grammar]
    named_text_tokens: dict[str, int]  # <name> -> id of a user-defined (text) token
    digits: _TokenDigits


_entries: weakref.WeakKeyDictionary[Tokenizer, _TokenizerEntry] = weakref.WeakKeyDictionary()
_entries_lock = threading.Lock()
_copy_lock = threading.Lock()  # LLMatcher.deep_copy of a template shared between requests


def _entry(tok: Tokenizer) -> _TokenizerEntry:
    with _entries_lock:
        entry = _entries.get(tok)
        if entry is None:
            view = _TokenizerView(tok)
            lltok = llg.LLTokenizer(llg.TokenizerWrapper(view), eos_token=view.eog_ids)
            entry = _TokenizerEntry(lltok, len(view.tokens), tuple(view.eog_ids), OrderedDict(),
                                    view.named_text_tokens, _TokenDigits(view.tokens))
            _entries[tok] = entry
        return entry


def lltokenizer_for(tok: Tokenizer) -> llg.LLTokenizer:
    """The llguidance tokenizer for ``tok`` (slow to build: once per Tokenizer object)."""
    return _entry(tok).lltok


# --- compiling ------------------------------------------------------------------------------


def compile_constraint(kind: str, spec: Any, tokenizer: Tokenizer, *,
                       bound_numbers: bool | None = None) -> Grammar:
    """Compile a constraint for ``tokenizer``'s vocabulary.

    kind:
      * ``json_object``: any JSON object (``spec`` ignored; may be None).
      * ``json_schema``: ``spec`` is a JSON Schema, as a dict or a JSON string.
      * ``regex``: ``spec`` is a regular expression (Rust ``regex`` syntax) the whole
        output must match.
      * ``lark``: llguidance's Lark-like grammar text (a GBNF grammar, with ``name ::=``
        rule lines, is converted).
      * ``gbnf``: llama.cpp GBNF grammar text (Lark text is accepted as is).

    bound_numbers: JSON numbers' digit runs (integral part, fraction, exponent) are at most
    NUMBER_DIGITS long, as llama.cpp's JSON-schema converter bounds them (a small model
    otherwise writes "1111..." to the token limit). Default: for the JSON kinds; a Lark
    grammar whose digits outside strings are all JSON numbers' (tool calls) may ask too.

    Raises GrammarError with llguidance's message when the constraint does not compile.
    Compiled constraints are cached per tokenizer (the result is immutable: call
    :meth:`Grammar.start` for each request).
    """
    entry = _entry(tokenizer)
    key_text, source = _grammar_source(kind, spec, entry.named_text_tokens)
    if bound_numbers is None:
        bound_numbers = kind in ("json_object", "json_schema")
    key = (kind + ("+bounded" if bound_numbers else ""), key_text)
    with _entries_lock:
        cached = entry.compiled.get(key)
        if cached is not None:
            entry.compiled.move_to_end(key)
            return cached
    matcher = llg.LLMatcher(entry.lltok, source, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {kind} constraint: {_clean_error(matcher.get_error())}")
    grammar = Grammar(kind, source, matcher, entry.n_tokens, entry.eog_ids,
                      entry.digits if bound_numbers else None)
    with _entries_lock:
        entry.compiled[key] = grammar
        while len(entry.compiled) > _COMPILED_CACHE_SIZE:
            entry.compiled.popitem(last=False)
    return grammar


def _grammar_source(kind: str, spec: Any, named_text_tokens: dict[str, int]
                    ) -> tuple[str, str]:
    """(cache key text, llguidance grammar definition) for one constraint;
    `named_text_tokens`: the vocabulary's user-defined tokens a Lark grammar may name."""
    if kind == "json_object":
        return "", llg.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_DEFAULTS)
    if kind == "json_schema":
        schema = _schema_dict(spec)
        try:  # the schema's own key order: properties are generated in it
            text = json.dumps(schema)
            return text, llg.LLMatcher.grammar_from_json_schema(text, _JSON_DEFAULTS)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"invalid json_schema constraint: {e}") from None
    if not isinstance(spec, str):
        raise GrammarError(f"a {kind} constraint must be a string, got {type(spec).__name__}")
    try:
        spec.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in the request's JSON)
        raise GrammarError(f"invalid {kind} constraint: not valid Unicode text "
                           f"({e.reason} at character {e.start})") from None
    if kind == "regex":
        return spec, llg.LLMatcher.grammar_from_regex(spec)
    if kind in ("lark", "gbnf"):
        text = spec
        try:
            if _GBNF_RULE.search(text):
                text = gbnf_to_lark(text)
            elif kind == "gbnf":
                text = any_to_lark(text)  # Lark text as it is
        except Exception as e:  # the converter raises assorted errors
            # (a rule named "start" too: the converter renames root to start)
            raise GrammarError(f"invalid {kind} grammar (GBNF): {e}") from None
        return spec, llg.LLMatcher.grammar_from_lark(_name_text_tokens(text,
                                                                        named_text_tokens))
    raise GrammarError(
        f"unknown constraint kind {kind!r}; supported: {', '.join(CONSTRAINT_KINDS)}"
    )


def _schema_dict(spec: Any) -> dict[str, Any]:
    if isinstance(spec, str | bytes):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise GrammarError(f"invalid json_schema constraint: not JSON: {e}") from None
    if spec is False:  # JSON Schema's "nothing validates": no output could satisfy it
        raise GrammarError("invalid json_schema constraint: the schema false allows no "
                           "value, so nothing could be generated")
    if spec is True:  # anything
        spec = {}
    if not isinstance(spec, dict):
        raise GrammarError(
            f"invalid json_schema constraint: a schema is a JSON object, got {type(spec).__name__}"
        )
    return spec


def _name_text_tokens(lark: str, named: dict[str, int]) -> str:
    """Lark text with each `<name>` of a user-defined token (outside strings, regexes and
    comments) as `<[id]>`: llguidance resolves names among special tokens only."""
    if not named or "<" not in lark:
        return lark
    out: list[str] = []
    i, n = 0, len(lark)
    while i < n:
        c = lark[i]
        if c == '"' or (c == "/" and lark[i + 1:i + 2] != "/"):  # a string or a regex
            j = i + 1
            while j < n and lark[j] != c:
                j += 2 if lark[j] == "\\" else 1
            out.append(lark[i:j + 1])
            i = j + 1
        elif c == "/":  # a // comment, to the end of the line
            j = lark.find("\n", i)
            j = n if j < 0 else j
            out.append(lark[i:j])
            i = j
        elif c == "<" and (m := _TOKEN_NAME.match(lark, i)) and m.group(0) in named:
            out.append(f"<[{named[m.group(0)]}]>")
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


_STATE_DUMP = re.compile(r"\n<state>.*", re.DOTALL)
# llguidance's list of every special token after an unknown one's name (thousands)
_SPECIAL_LIST = re.compile(r"; following special tokens are available: ⟦.*?⟧", re.DOTALL)
# a GBNF rule line (`name ::= ...`; llguidance's is_lark_syntax takes `start ::=` for Lark)
_GBNF_RULE = re.compile(r"(?m)^\s*[\w-]+\s*::=")


def _clean_error(message: str) -> str:
    """llguidance's message without the parser-state dump it may append."""
    message = _SPECIAL_LIST.sub("", _STATE_DUMP.sub("", message))
    return message.strip() or "unknown grammar error"


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint for one vocabulary; :meth:`start` one state per request."""

    kind: str
    source: str  # the llguidance grammar definition (JSON text)
    _template: llg.LLMatcher
    n_tokens: int  # the tokenizer's vocabulary size: ids >= this are never allowed
    eog_ids: tuple[int, ...]  # the ids llguidance treats as EOS
    digits: _TokenDigits | None = None  # JSON numbers' digit runs are bounded (if given)
    budget: ReasoningBudget | None = None  # a reasoning budget kept beside the grammar

    def start(self) -> GrammarState:
        """A fresh matcher at the start of the output."""
        with _copy_lock:
            matcher = self._template.deep_copy()
        return GrammarState(matcher, self.n_tokens, digits=self.digits, budget=self.budget)

    def with_budget(self, budget: ReasoningBudget) -> Grammar:
        """This constraint with a reasoning budget kept beside it (a copy)."""
        return replace(self, budget=budget)


# --- per-request state ------------------------------------------------------------------------


class GrammarState:
    """Where one output stands in its grammar.

    ``allowed(n)`` is the mask of tokens that may come next (EOS ids included once the text
    is a complete match); ``consume`` advances by one token, ``rollback`` undoes tokens,
    ``fork`` gives an independent copy (for a draft to advance along its proposals).

    With ``digits`` (a bounded-numbers grammar) the mask also leaves out tokens that would
    make a run of digits outside JSON strings longer than NUMBER_DIGITS, unless nothing
    else is allowed (a schema's own bound may need more digits). With ``budget`` (a
    reasoning budget, reasoning_budget.py) the mask is the end tag's next token alone
    while the budget forces it.
    """

    def __init__(self, matcher: llg.LLMatcher, n_tokens: int, counted: Sequence[bool] = (),
                 *, digits: _TokenDigits | None = None,
                 scans: Sequence[_JsonScan] = (), budget: ReasoningBudget | None = None,
                 positions: Sequence[BudgetPosition] = ()) -> None:
        self._m = matcher
        self._n_tokens = n_tokens
        # one entry per consumed token: did llguidance record it?  (A token consumed once
        # the matcher is stopped, i.e. an EOS, is not in its history and must not be
        # rolled back there.)
        self._counted: list[bool] = list(counted)
        self._digits = digits
        # with digits: where the JSON text stands, at the start and after each consumed token
        self._scans: list[_JsonScan] = list(scans) or [_JsonScan()]
        # with a budget: where the reply stands in it, at the start and after each token
        self._budget = budget
        self._positions: list[BudgetPosition] = list(positions) or (
            [] if budget is None else [budget.begin()])
        self._mask: np.ndarray | None = None  # [n_tokens] bool for the current state
        self._padded: dict[int, np.ndarray] = {}  # n_vocab -> [n_vocab] read-only

    # -- the mask ------------------------------------------------------------------------

    def allowed(self, n_vocab: int) -> np.ndarray:
        """[n_vocab] bool (read-only): which tokens may come next.

        Ids at or past the tokenizer's vocabulary are False (the logits may have more rows).
        After a violation or a dead end every entry is False.
        """
        out = self._padded.get(n_vocab)
        if out is None:
            base = self._base_mask()  # [n_tokens]
            out = np.zeros(n_vocab, dtype=bool)  # [n_vocab]
            width = min(n_vocab, base.shape[0])
            out[:width] = base[:width]
            out.setflags(write=False)
            self._padded[n_vocab] = out
        return out

    def _base_mask(self) -> np.ndarray:
        if self._mask is None:
            if self._m.is_error():
                mask = np.zeros(self._n_tokens, dtype=bool)
            else:
                bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
                mask = np.unpackbits(bits, bitorder="little")[: self._n_tokens].astype(bool)
                if self._m.is_error():  # the mask computation itself can hit a limit
                    mask[:] = False
                mask = self._force_budget(self._bound_digits(mask))
            mask.setflags(write=False)
            self._mask = mask
        return self._mask

    def _bound_digits(self, mask: np.ndarray) -> np.ndarray:
        """mask [n_tokens] without the tokens whose leading digits would run past
        NUMBER_DIGITS outside a string (the mask as it was if that leaves nothing)."""
        scan = self._scans[-1]
        if self._digits is None or scan.in_string:
            return mask
        bounded = mask & (self._digits.lead[: mask.shape[0]] <= NUMBER_DIGITS - scan.run)
        return bounded if bounded.any() else mask

    def _forced(self) -> int | None:
        """The token the reasoning budget forces next (None: none)."""
        if self._budget is None:
            return None
        return self._positions[-1].forced_token(self._budget)

    def _force_budget(self, mask: np.ndarray) -> np.ndarray:
        """mask [n_tokens], or the forced token alone while the budget forces one."""
        forced = self._forced()
        if forced is None:
            return mask
        only = np.zeros_like(mask)
        if forced < only.shape[0]:
            only[forced] = True
        return only

    def is_allowed(self, token: int) -> bool:
        token = int(token)
        return 0 <= token < self._n_tokens and bool(self._base_mask()[token])

    # -- moving ---------------------------------------------------------------------------

    def consume(self, token: int) -> None:
        """Advance by ``token``; GrammarViolation (state unchanged) if it is not allowed."""
        token = int(token)
        if not self.is_allowed(token):
            raise GrammarViolation(f"token {token} is not allowed by the grammar here")
        counted = not self._m.is_stopped()
        # False although the mask allowed it: llguidance failed inside (e.g. its lexer's
        # limit on expressions). The matcher keeps the error: dead_end is then true, every
        # mask empty, and the request ends with "grammar_dead_end" instead of failing.
        self._m.consume_token(token)
        self._changed()
        self._counted.append(counted)
        if self._digits is not None:
            self._scans.append(self._scans[-1].after(self._digits.tokens[token]))
        if self._budget is not None:
            self._positions.append(self._positions[-1].after(self._budget, token))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar would accept in turn (state unchanged)."""
        ids = [int(t) for t in tokens]
        n_ok = next((i for i, t in enumerate(ids) if not 0 <= t < self._n_tokens), len(ids))
        if n_ok == 0 or self._m.is_error():
            return 0
        n_ok = int(self._m.validate_tokens(ids[:n_ok]))
        if self._digits is not None:  # and within the digit bound, token by token
            scan = self._scans[-1]
            for i, t in enumerate(ids[:n_ok]):
                if not scan.in_string and self._digits.lead[t] > NUMBER_DIGITS - scan.run:
                    return i
                scan = scan.after(self._digits.tokens[t])
        if self._budget is not None:  # and the tokens the budget forces, in turn
            at = self._positions[-1]
            for i, t in enumerate(ids[:n_ok]):
                forced = at.forced_token(self._budget)
                if forced is not None and forced != t:
                    return i
                at = at.after(self._budget, t)
        return n_ok

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n < 0 or n > len(self._counted):
            raise ValueError(f"cannot roll back {n} of {len(self._counted)} consumed tokens")
        if n == 0:
            return
        k = sum(self._counted[-n:])
        if k and not self._m.rollback(k):
            raise GrammarViolation(f"rollback failed: {_clean_error(self._m.get_error())}")
        del self._counted[-n:]
        if self._digits is not None:
            del self._scans[-n:]
        if self._budget is not None:
            del self._positions[-n:]
        self._changed()

    def fork(self) -> GrammarState:
        """An independent copy (same position); advancing it leaves this state alone."""
        other = GrammarState(self._m.deep_copy(), self._n_tokens, self._counted,
                             digits=self._digits, scans=self._scans, budget=self._budget,
                             positions=self._positions)
        other._mask, other._padded = self._mask, dict(self._padded)  # immutable arrays
        return other

    def _changed(self) -> None:
        self._mask = None
        self._padded = {}

    # -- where it stands ------------------------------------------------------------------------

    @property
    def n_consumed(self) -> int:
        return len(self._counted)

    def is_accepting(self) -> bool:
        """The text so far is a complete match (the output may end here: EOS is allowed)."""
        return not self._m.is_error() and self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but EOS can follow (or the grammar is dead): the request should end."""
        return self._m.is_stopped() or self.dead_end

    @property
    def dead_end(self) -> bool:
        """No token can continue and the text is not a complete match (or the grammar
        failed): the request must stop (finish reason "grammar_dead_end")."""
        if self._m.is_error():
            return True
        if self._m.is_accepting():
            return False
        return bool(self._m.is_stopped()) or not self._base_mask().any()

    @property
    def stop_reason(self) -> str | None:
        """None while the output can go on; otherwise why not (llguidance's reason:
        "EndOfSentence", "NoExtension", ..., "error: <message>" or "no allowed token")."""
        if self._m.is_error():
            return f"error: {_clean_error(self._m.get_error())}"
        if self._m.is_stopped():
            return str(self._m.stop_reason())
        if not self._m.is_accepting() and not self._base_mask().any():
            return "no allowed token"
        return None
