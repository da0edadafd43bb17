"""The /infill prompt's layout: llama.cpp's repo-level pattern, its fallback, its trimming."""

from __future__ import annotations

import pytest

from specd.daemon.text.infill import ExtraChunk, extra_context, infill_tokens
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def tok(tiny_model_factory) -> Tokenizer:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=6, fim=True)
    return Tokenizer.from_metadata(GGUFFile(path).metadata)


CHUNKS = [ExtraChunk("util.py", "x = 1\n"), ExtraChunk("b.py", "y = 2\n")]


def test_repo_level_pattern(tok: Tokenizer) -> None:
    """Qwen2.5-Coder's pattern, as llama.cpp writes it: repo line, one separator line per
    file, the current file's line, then prefix and the prompt, suffix, middle."""
    ids = infill_tokens(tok, "def f():\n    ", "\n", "ret", CHUNKS, n_ctx=512, max_tokens=16)
    assert tok.decode(ids) == (
        "<|repo_name|>myproject\n<|file_sep|>util.py\nx = 1\n<|file_sep|>b.py\ny = 2\n"
        "<|file_sep|>filename\n<|fim_prefix|>def f():\n    ret<|fim_suffix|>\n<|fim_middle|>")
    # no extra files: still the repo and current-file lines
    assert tok.decode(infill_tokens(tok, "a", "b", "", [], n_ctx=512, max_tokens=16)) == (
        "<|repo_name|>myproject\n<|file_sep|>filename\n"
        "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>")


def test_without_repo_tokens_chunks_follow_a_snippet_line(tok: Tokenizer,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(Tokenizer, "fim_repo_id", property(lambda self: None))
    monkeypatch.setattr(Tokenizer, "fim_sep_id", property(lambda self: None))
    assert tok.decode(extra_context(tok, CHUNKS)) == (
        "\n\n--- snippet ---\n\nx = 1\n\n\n--- snippet ---\n\ny = 2\n")


def test_trimming_keeps_the_newest_extra_and_the_prefix_end(tok: Tokenizer) -> None:
    chunks = [ExtraChunk(f"f{i}.py", "value = compute(value) + 1\n" * 8) for i in range(6)]
    n_ctx, max_tokens = 256, 16
    extra = extra_context(tok, chunks)
    ids = infill_tokens(tok, "def f():\n    ", "\n", "", chunks, n_ctx, max_tokens)
    room = n_ctx - 1 - max_tokens
    assert len(extra) > room and len(ids) == room
    core = ids.index(tok.fim_prefix_id)
    assert ids[:core] == extra[len(extra) - core:]  # the end of the extra context
    assert tok.decode(ids[core:]) == "<|fim_prefix|>def f():\n    <|fim_suffix|>\n<|fim_middle|>"
    # a prefix longer than the room keeps its end, and the suffix gives way after it
    long_prefix = "a = 1\n" * 400
    ids = infill_tokens(tok, long_prefix, "tail\n", "", [], n_ctx, max_tokens)
    assert len(ids) == room and ids[0] == tok.fim_prefix_id
    body = tok.decode(ids)
    assert body.endswith("a = 1\n<|fim_suffix|>tail\n<|fim_middle|>")


def test_no_fim_tokens_is_refused(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=6)
    plain = Tokenizer.from_metadata(GGUFFile(path).metadata)
    with pytest.raises(ValueError, match="no FIM tokens"):
        infill_tokens(plain, "a", "b", "", [], n_ctx=64, max_tokens=4)
