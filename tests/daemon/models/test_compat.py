"""Draft/target vocabulary compatibility, explained."""

from __future__ import annotations

import pytest
from conftest import fetched_model

from specd.daemon.models.compat import draft_incompatibilities
from specd.ort_models.gguf_file import GGUFFile


def _meta(factory, **kw):
    return GGUFFile(factory(**kw)).metadata


def test_same_vocab_is_compatible(tiny_model_factory) -> None:
    a = _meta(tiny_model_factory, arch="qwen2", seed=1)
    b = _meta(tiny_model_factory, arch="qwen2", seed=2)
    assert draft_incompatibilities(a, b) == []


def test_different_vocabs_name_every_difference(tiny_model_factory) -> None:
    qwen = _meta(tiny_model_factory, arch="qwen2")
    llama = _meta(tiny_model_factory, arch="llama")
    problems = " | ".join(draft_incompatibilities(qwen, llama))
    assert "BOS token id differs" in problems
    assert "EOS token id differs" in problems
    assert "token texts differ, first at id 0" in problems


def test_vocab_size_and_type(tiny_model_factory) -> None:
    a = dict(_meta(tiny_model_factory, arch="qwen2"))
    b = dict(a)
    b["tokenizer.ggml.tokens"] = a["tokenizer.ggml.tokens"] + ["x"] * 300
    b["tokenizer.ggml.model"] = "llama"
    problems = " | ".join(draft_incompatibilities(a, b))
    assert "vocab size differs by 300" in problems and "vocab type differs" in problems


def _real(name: str) -> dict:
    return GGUFFile(fetched_model(name)).metadata


@pytest.mark.real
def test_real_pairs() -> None:
    qwen_t = _real("qwen2.5-coder-1.5b-instruct")
    qwen_d = _real("qwen2.5-coder-0.5b-instruct")
    smol = _real("smollm2-135m-instruct")
    assert draft_incompatibilities(qwen_t, qwen_d) == []
    problems = draft_incompatibilities(qwen_t, smol)
    assert any("vocab size differs" in p for p in problems)
    assert any("token texts differ" in p for p in problems)
