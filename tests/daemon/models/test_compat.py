"""Draft/target and head/target compatibility, explained."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import fetched_model

from specd.daemon.models.compat import draft_incompatibilities, head_incompatibilities
from specd.ort_models.arch import HParams, read_hparams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import HeadParams, read_head

from tiny_heads import draft_ids, write_tiny_head


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


# --- drafter heads ---------------------------------------------------------------------

HEAD_KINDS = [{"kind": "dflash"}, {"kind": "dflash", "causal": True}, {"kind": "dflash2"},
              {"kind": "dspark"}, {"kind": "dspark", "draft_vocab": 100},
              {"kind": "eagle3", "draft_vocab": 100}, {"kind": "eagle3"}]


def _target(factory, **kw) -> tuple[HParams, dict]:
    f = GGUFFile(factory(arch="qwen3", **kw))
    return read_hparams(f), f.metadata


def _tiny_head(tmp_path, **kw) -> tuple[HeadParams, dict]:
    f = GGUFFile(write_tiny_head(tmp_path / "head.gguf", **kw))
    return read_head(f), f.metadata


@pytest.mark.parametrize("kw", HEAD_KINDS)
def test_every_head_kind_fits_its_target(tiny_model_factory, tmp_path, kw) -> None:
    target, target_meta = _target(tiny_model_factory)
    head, head_meta = _tiny_head(tmp_path, **kw)
    assert head_incompatibilities(head, target) == []
    assert head_incompatibilities(head, target, target_meta, head_meta) == []


@pytest.mark.parametrize("name", ["dflash", "dspark", "eagle3"])
def test_llama_cpp_converted_heads_fit_the_tiny_target(tiny_model_factory, name) -> None:
    """tests/fixtures/heads: heads converted by llama.cpp for write_tiny_gguf's qwen3."""
    target, target_meta = _target(tiny_model_factory)
    f = GGUFFile(Path(__file__).resolve().parents[2] / "fixtures" / "heads" / f"{name}.gguf")
    assert head_incompatibilities(read_head(f), target, target_meta, f.metadata) == []


def test_head_hidden_size_mismatch(tiny_model_factory, tmp_path) -> None:
    target, _ = _target(tiny_model_factory)
    head, _ = _tiny_head(tmp_path, kind="eagle3", target_hidden_size=128, draft_vocab=100)
    assert head_incompatibilities(head, target) == [
        "target hidden size differs: the head reads features 128 wide, the target's n_embd "
        "is 64"]


def test_head_wider_than_the_target_cannot_share_its_tensors(tiny_model_factory,
                                                              tmp_path) -> None:
    target, _ = _target(tiny_model_factory)
    head, _ = _tiny_head(tmp_path, kind="dflash", n_embd=128, n_ff=256)
    assert head_incompatibilities(head, target) == [
        "target hidden size differs: the head reads features 128 wide, the target's n_embd "
        "is 64",
        "the head shares the target's token embedding (it has none of its own), but its "
        "n_embd 128 is not the target's 64",
        "the head shares the target's LM head (it has none of its own), but its n_embd 128 "
        "is not the target's 64"]
    # an EAGLE-3 head may be wider than the target's features, with its own tensors
    wide, _ = _tiny_head(tmp_path, kind="eagle3", n_embd=128, n_ff=256, draft_vocab=100,
                         own_embeddings=True)
    assert head_incompatibilities(wide, target) == []
    assert head_incompatibilities(dataclasses.replace(wide, has_token_embd=False), target) == [
        "the head shares the target's token embedding (it has none of its own), but its "
        "n_embd 128 is not the target's 64"]


def test_head_target_layers_past_the_target(tiny_model_factory, tmp_path) -> None:
    head, _ = _tiny_head(tmp_path, kind="dflash", target_layers=(1, 3, 4))
    target, _ = _target(tiny_model_factory)
    assert head_incompatibilities(head, target) == [
        f"target layer {n} in dflash.target_layers is past the target's depth: it has 2 "
        "layers (ids 1..2 can be read)" for n in (3, 4)]
    deeper, _ = _target(tiny_model_factory, n_layer=4)
    assert head_incompatibilities(head, deeper) == []
    embedding = dataclasses.replace(head, target_layers=(0, 2))
    assert head_incompatibilities(embedding, target) == [
        "target layer 0 in dflash.target_layers is the token embedding, which specd's "
        "target graph does not output"]


def test_head_vocabulary_mismatch(tiny_model_factory, tmp_path) -> None:
    """A head over a bigger vocabulary: its size, a d2t id and the mask token each past the
    target's 352 tokens."""
    target, target_meta = _target(tiny_model_factory)
    d2t = np.append(draft_ids(0, 352, 99), 380)
    head, head_meta = _tiny_head(tmp_path, kind="dspark", vocab_size=384, draft_vocab=100,
                                 mask_token_id=360, tensors={"d2t": d2t})
    problems = [
        "vocabulary size differs: target 352, head 384",
        "d2t maps a draft row to target id 380, past the target's vocabulary of 352",
        "mask token id 360 is past the target's vocabulary of 352"]
    assert head_incompatibilities(head, target) == problems
    # the tokenizers agree up to llama.cpp's padding allowance; the rows do not
    assert head_incompatibilities(head, target, target_meta, head_meta) == problems


def test_head_tokenizer_compared_with_the_targets(tiny_model_factory, tmp_path) -> None:
    target, target_meta = _target(tiny_model_factory)
    head, head_meta = _tiny_head(tmp_path, kind="eagle3", target_arch="llama")
    problems = head_incompatibilities(head, target, target_meta, head_meta)
    assert problems[:2] == ["head tokenizer: BOS token id differs: target 347, draft 1",
                            "head tokenizer: EOS token id differs: target 349, draft 2"]
    assert problems[2].startswith("head tokenizer: ") and "token texts differ" in problems[2]
    assert head_incompatibilities(head, target) == []  # sizes alone agree
