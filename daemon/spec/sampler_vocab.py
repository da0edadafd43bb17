"""What the vocabulary-reading samplers (infill, DRY) need of a model's tokenizer: which
tokens end generation, each token's text, and DRY's sequence breakers as token sequences."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specd.daemon.text.tokenizer import Tokenizer

# llama.cpp's DRY limits: a breaker's first 40 bytes, and tails of at most 20 tokens
_MAX_BREAKER_BYTES = 40
_MAX_TAIL_TOKENS = 20
# the end-of-text token llama.cpp's vocabulary names when the GGUF names none (its list)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<end_of_utterance>")


@dataclass(frozen=True)
class SamplerVocab:
    """eog: the ids that end generation (llama.cpp's is_eog); eot: the end-of-text token
    the infill sampler answers with when no text token is left; piece(id): the token's
    text as llama.cpp's token_to_piece without specials (a control token: empty);
    text(id): its text with specials written out; encode(text): token ids, specials not
    parsed; size: the number of ids."""

    eog: frozenset[int]
    eot: int
    piece: Callable[[int], bytes]
    text: Callable[[int], bytes]
    encode: Callable[[str], list[int]]
    size: int
    _breakers: dict[tuple[str, ...], dict[int, list[tuple[int, ...]]]] = field(
        default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> SamplerVocab:
        eot = next((i for i in (tok.token_to_id(t) for t in _EOT_TEXTS) if i is not None),
                   tok.eos_id)
        if eot is None:
            eot = min(tok.eot_ids) if tok.eot_ids else 0
        return cls(eog=frozenset(tok.eot_ids), eot=eot,
                   piece=lambda i: b"" if tok.is_control(i) else tok.token_bytes(i),
                   text=tok.token_bytes,
                   encode=lambda s: tok.encode(s, add_bos=False, parse_special=False),
                   size=tok.vocab_size)

    def dry_breakers(self, breakers: Sequence[str]) -> dict[int, list[tuple[int, ...]]]:
        """DRY's sequence breakers as llama.cpp processes them: for every token whose text
        contains a breaker, an empty tail; for every token whose text ends with the start
        of a breaker, the rest of the breaker tokenized (at most 20 tokens). Head token
        -> its tails; computed once per breaker list."""
        key = tuple(breakers)
        found = self._breakers.get(key)
        if found is None:
            found = {}
            for breaker in key:
                raw = breaker.encode("utf-8")[:_MAX_BREAKER_BYTES]
                if raw:
                    self._overlapping(raw, found)
            self._breakers[key] = found
        return found

    def _overlapping(self, breaker: bytes, out: dict[int, list[tuple[int, ...]]]) -> None:
        """llama.cpp's get_overlapping_token_sequences for one breaker, into `out`."""
        first = breaker[:1]
        for token in range(self.size):
            word = self.text(token)
            if breaker in word:
                _add_tail(out, token, ())
                continue
            pos = word.find(first)
            while pos >= 0:
                i = 1
                while i < len(breaker) and pos + i < len(word) and word[pos + i] == breaker[i]:
                    i += 1
                if pos + i >= len(word):  # the word ends inside the breaker
                    rest = breaker[i:].decode("utf-8", errors="ignore")
                    _add_tail(out, token, tuple(self.encode(rest)[:_MAX_TAIL_TOKENS]))
                pos = word.find(first, pos + 1)


def _add_tail(out: dict[int, list[tuple[int, ...]]], token: int, tail: tuple[int, ...]) -> None:
    tails = out.setdefault(token, [])
    if tail not in tails:
        tails.append(tail)
