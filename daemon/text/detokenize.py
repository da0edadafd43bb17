"""Streaming detokenization: text out as tokens come in, never half a UTF-8 character.

A character can span tokens (an emoji split over byte-fallback `<0xF0><0x9F>...` tokens, or over
byte-level BPE tokens), so bytes of an unfinished sequence are held until the rest arrives.
The pieces joined equal `Tokenizer.decode(ids)` (same bytes, same U+FFFD for invalid ones).
"""

from __future__ import annotations

import codecs
from typing import Protocol


class _Vocabulary(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def is_control(self, token_id: int) -> bool: ...

    @property
    def strips_leading_space(self) -> bool: ...


class IncrementalDetokenizer:
    """`push(id)` per generated token, `flush()` at the end.

    skip_special: control tokens (`<|im_end|>`, EOS, ...) add no text, like
    `decode(ids, skip_special=True)`, but for those in `keep` (a chat format's preserved
    tokens, which its reply parser reads).
    """

    def __init__(self, tokenizer: _Vocabulary, *, skip_special: bool = False,
                 keep: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._keep = keep
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer.strips_leading_space
        self._started = False
        self._ids: list[int] = []

    def push(self, token_id: int) -> str:
        """The text that token `token_id` completes ('' while a character is unfinished)."""
        self._ids.append(token_id)
        if (self._skip_special and self._tokenizer.is_control(token_id)
                and token_id not in self._keep):
            return ""
        data = self._tokenizer.token_bytes(token_id)
        if not data:
            return ""
        if not self._started:
            self._started = True
            if self._strip_space and data.startswith(b" "):
                data = data[1:]
        return self._decoder.decode(data)

    def push_many(self, token_ids: list[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """What is left: U+FFFD for a tail that never became a whole character."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """Bytes are held back, waiting for the rest of a character."""
        buffered, _ = self._decoder.getstate()
        return bool(buffered)

    @property
    def ids(self) -> list[int]:
        """Every id pushed so far."""
        return list(self._ids)
