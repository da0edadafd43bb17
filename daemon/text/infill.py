"""The prompt of a fill-in-the-middle request, laid out as llama.cpp's /infill lays it out.

With a vocabulary that has the repo-level tokens (Qwen2.5-Coder's `<|repo_name|>` and
`<|file_sep|>`), the extra files come first in the pattern the model was trained on
(arXiv 2409.12186), then the FIM part::

    <REPO>myproject\\n
    <SEP>{filename 0}\\n{text 0}
    <SEP>{filename 1}\\n{text 1}
    <SEP>filename\\n
    <PRE>{prefix}{prompt}<SUF>{suffix}<MID>

Without a file separator each extra text follows a plain "--- snippet ---" line; without
a repo token the first line is left out. "myproject" and "filename" are llama.cpp's
placeholders (its /infill takes neither a project nor the current file's name), kept so
that editor plugins written against llama.cpp get the prompts they were tuned with. The
request's `prompt` (llama.vim: the cursor line's text before the cursor) continues the
prefix, and the model writes after <MID>, as llama.cpp's format_prompt_infill lays it out.

When the whole does not fit the context less the completion's room, the FIM part keeps
the end of the prefix and the start of the suffix, and the extra context its newest
tokens (those nearest the FIM part), as llama.cpp trims.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tokenizer import Tokenizer

REPO_NAME = "myproject"
CURRENT_FILE = "filename"
DEFAULT_CHUNK_FILE = "tmp"
SNIPPET_LINE = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class ExtraChunk:
    """One file of `input_extra`: its name and the text given of it."""

    filename: str
    text: str


def has_fim(tok: Tokenizer) -> bool:
    return None not in (tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id)


def _encode(tok: Tokenizer, text: str) -> list[int]:
    """Plain text: no BOS, and special-token text stays text."""
    return tok.encode(text, add_bos=False, parse_special=False)


def extra_context(tok: Tokenizer, chunks: Sequence[ExtraChunk]) -> list[int]:
    """The tokens before the FIM part: the repo line, each chunk, the current file's line."""
    rep, sep = tok.fim_repo_id, tok.fim_sep_id
    out: list[int] = [rep, *_encode(tok, REPO_NAME + "\n")] if rep is not None else []
    for chunk in chunks:
        out += ([sep, *_encode(tok, chunk.filename + "\n")] if sep is not None
                else _encode(tok, SNIPPET_LINE))
        out += _encode(tok, chunk.text)
    if sep is not None:
        out += [sep, *_encode(tok, CURRENT_FILE + "\n")]
    return out


def infill_tokens(tok: Tokenizer, prefix: str, suffix: str, prompt: str,
                  chunks: Sequence[ExtraChunk], n_ctx: int, max_tokens: int) -> list[int]:
    """The whole prompt, trimmed to leave the completion `max_tokens` (at most half the
    context) of room. The vocabulary must have FIM tokens (`has_fim`)."""
    fim_pre, fim_suf, fim_mid = tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id
    if fim_pre is None or fim_suf is None or fim_mid is None:
        raise ValueError("this vocabulary has no FIM tokens")
    extra = extra_context(tok, chunks)
    pre, suf, mid = (_encode(tok, t) for t in (prefix, suffix, prompt))
    room = n_ctx - 1 - min(max(max_tokens, 0), n_ctx // 2)
    over = 3 + len(pre) + len(suf) + len(mid) - room
    if over > 0:
        cut = min(over, len(pre))
        pre, over = pre[cut:], over - cut
    if over > 0:
        suf = suf[: max(len(suf) - over, 0)]
    core = [fim_pre, *pre, *mid, fim_suf, *suf, fim_mid]
    keep = max(room - len(core), 0)
    return (extra[max(len(extra) - keep, 0):] if keep else []) + core
