"""The muse-glimmer DFlash drafter: a tiny random transformers `MuseGlimmerAssistantModel`
for a tiny random `MuseGlimmerForConditionalGeneration` target, both converted by
llama.cpp's own convert_hf_to_gguf.py (build 11434), the head also by `specd
convert-draft` (from the target's GGUF):

* specd's file is llama.cpp's, key for key and byte for byte; the head's Q/K stay in
  transformers' rotate_half order (llama.cpp's NeoX rope for a dflash head), where the
  target's were un-permuted to NORM rope;
* specd drafts with it on the muse-glimmer target: every draft is the float64
  reference's (the target's raw token embeddings, without its embedding norm, as
  llama.cpp's dflash graph reads them), and the greedy text is the target's alone;
* llama-speculative-simple drafts with the same files, round by round as specd does
  (tests/support/head_decode_oracle.py);
* transformers' own drafting (its DFlash candidate generator's computation: raw target
  embeddings, the target's LM head without logit scale or softcap) gives the same logits
  while the context fits in the head's sliding window; beyond it transformers' sliding
  layers see one more key (|q - k| <= window, where llama.cpp's rule is q - k < window).

Skipped without torch and transformers (the converter's and the checkpoints' needs), or
without llama.cpp's source / binaries, with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specd.daemon.models.convert_draft import convert_draft
from specd.daemon.models.convert_draft.safetensors import read_checkpoint_tensors
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import read_head

import llama_cpp_convert
import llama_cpp_oracle
from gguf_layout import gguf_layout
from head_decode_oracle import (
    assert_drafts_follow_the_reference,
    compare_decodes,
    serving_decode,
    target_only,
    text_prompt,
)
from numpy_muse_glimmer import MuseGlimmerReference
from numpy_reference import ReferenceDFlash
from speculation_checks import assert_drafted

pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_transformers]

TEXT = "hello world, this is a test"
# the target's first token after it is whole text (head_decode_oracle's alignment)
ORACLE_TEXT = "a b c d e f"
N_TOKENS = 40


class Converted:
    """The checkpoints and their GGUFs."""

    def __init__(self, root: Path):
        from tiny_hf_muse_glimmer import write_assistant, write_checkpoint

        self.target_dir = write_checkpoint(root / "target-hf", seed=0)
        self.target = llama_cpp_convert.convert(self.target_dir, root / "target.gguf")
        n_vocab = GGUFFile(self.target).tensor("token_embd.weight").shape[0]
        self.head_dir = write_assistant(root / "muse-glimmer-assistant", n_vocab, seed=1)
        self.theirs = llama_cpp_convert.convert(self.head_dir, root / "theirs.gguf",
                                                target_model_dir=self.target_dir)
        self.ours = root / "ours.gguf"
        convert_draft(self.head_dir, self.target, self.ours, "f32")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    if reason := llama_cpp_convert.missing():
        pytest.skip(reason)
    return Converted(tmp_path_factory.mktemp("muse_head"))


def test_conversion_is_llama_cpps(converted: Converted) -> None:
    """Every key with its type and value in llama.cpp's order, every tensor's name, type,
    shape, offset and bytes: the same file."""
    ours, theirs = gguf_layout(converted.ours), gguf_layout(converted.theirs)
    assert ours["keys"] == theirs["keys"]
    assert ours["order"] == theirs["order"]
    assert ours["tensors"] == theirs["tensors"]
    assert ours["data"] == theirs["data"]
    assert ours["size"] == theirs["size"]
    head = read_head(GGUFFile(converted.ours))
    assert (head.kind, head.target_layers, head.block_size, head.rope_interleaved) == (
        "dflash", (1, 3), 4, False)
    assert (head.sliding_window, head.sliding_window_pattern) == (8, (True, False))
    assert not head.has_token_embd and not head.has_output  # the target's are shared


def test_q_and_k_keep_transformers_order(converted: Converted) -> None:
    """The head's Q/K and their norms are the checkpoint's as they are (NeoX rope), where
    the same converter un-permutes the target's to NORM rope."""
    ck = read_checkpoint_tensors(converted.head_dir)
    for hf_name, name in (("q_proj.weight", "attn_q.weight"), ("k_proj.weight", "attn_k.weight"),
                          ("q_norm.weight", "attn_q_norm.weight")):
        want = ck[f"layers.1.self_attn.{hf_name}"].read()
        np.testing.assert_array_equal(_f32(converted.ours, f"blk.1.{name}"), want)
    target_q = read_checkpoint_tensors(converted.target_dir)[
        "model.language_model.layers.0.self_attn.q_proj.weight"].read()
    assert not np.array_equal(_f32(converted.target, "blk.0.attn_q.weight"), target_q)


def _f32(path: Path, name: str) -> np.ndarray:
    """An F32 tensor of a GGUF file, in numpy order."""
    t = GGUFFile(path).tensor(name)
    assert t.type_name == "F32"
    return t.data.view("<f4").reshape(t.shape)


def test_specd_drafts_the_references_drafts(converted: Converted) -> None:
    """specd's float32 drafts are the float64 reference's at every round, and greedy
    decoding with the head drafting keeps the target's own text."""
    target, head = converted.target, converted.ours
    assert_drafts_follow_the_reference(target, head, TEXT, N_TOKENS)


def test_serving_path_keeps_the_target_text(converted: Converted) -> None:
    """specd's default head build (matrices re-quantized for its kernels): rounds drafted
    and verified, the greedy text the target's alone."""
    target, head = converted.target, converted.ours
    prompt, eog = text_prompt(target, TEXT)
    tokens, gen = serving_decode(target, head, prompt, eog, max_tokens=N_TOKENS)
    assert tokens == target_only(target, prompt, eog, N_TOKENS)
    assert_drafted(gen.stats)


def _reference_logits(c: Converted, context: list[int], *, window_extra: int = 0
                      ) -> np.ndarray:
    """The float64 reference's logits [block - 1, vocab] for the round drafted after
    context[-1] (the head's sliding window widened by window_extra)."""
    params = read_head(GGUFFile(c.ours))
    target = MuseGlimmerReference(c.target)
    inputs: dict[int, np.ndarray] = {}
    target.step(context[:-1], target.new_cache(), inputs)
    features = np.concatenate([inputs[i] for i in params.target_layers], -1)  # [pos, 2E]
    ref = ReferenceDFlash(c.ours, target, n_ctx=256)
    ref.window += window_extra
    pos = len(context) - 1
    ref.inject(features, np.arange(pos))
    assert params.mask_token_id is not None and params.block_size is not None
    block = [context[-1]] + [params.mask_token_id] * (params.block_size - 1)
    return ref.block(block, pos)[1:]


def _transformers_logits(c: Converted, context: list[int]) -> np.ndarray:
    """transformers' draft logits [block - 1, vocab] after context[-1], computed as its
    DFlash candidate generator does (float64)."""
    import torch
    from transformers import MuseGlimmerAssistantModel, MuseGlimmerForConditionalGeneration
    from transformers.cache_utils import DFlashCache

    target = MuseGlimmerForConditionalGeneration.from_pretrained(
        c.target_dir, dtype=torch.float64).eval()
    head = MuseGlimmerAssistantModel.from_pretrained(c.head_dir, dtype=torch.float64).eval()
    cfg, n = head.config, len(context) - 1
    embed = target.get_input_embeddings()
    with torch.no_grad():
        out = target(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in cfg.target_layer_ids], -1)
        norm, embed.embed_norm = embed.embed_norm, torch.nn.Identity()  # raw embeddings
        noise = embed(torch.tensor([[context[-1]] + [cfg.mask_token_id] * (cfg.block_size - 1)]))
        embed.embed_norm = norm
        cache = DFlashCache(config=cfg)
        cache.activate_past_recording(recurrent_states_to_keep=cfg.block_size)
        cache.set_previous_accepted_tokens(n)
        h = head(noise_embeds=noise, context_hidden_states=features,
                 position_ids=torch.arange(n + cfg.block_size)[None],
                 attention_mask=torch.ones(1, n + cfg.block_size, dtype=torch.long),
                 cache=cache).last_hidden_state
        return target.get_output_embeddings()(h[0, 1:]).numpy()  # [block - 1, vocab]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_drafts_are_transformers(converted: Converted) -> None:
    """Within the window (2 context positions + a block of 4 < 8) the converted head
    computes transformers' logits; with 12 context positions, transformers' logits are
    those of a window one wider than llama.cpp's (and specd's) reading of the file."""
    short = [5, 17, 42]
    assert _rel(_reference_logits(converted, short),
                _transformers_logits(converted, short)) < 1e-6
    long = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128, 9]
    want = _transformers_logits(converted, long)
    assert _rel(_reference_logits(converted, long, window_extra=1), want) < 1e-6
    assert _rel(_reference_logits(converted, long), want) > 1e-3


@pytest.mark.llama_cpp_oracle
def test_rounds_are_llama_cpps(converted: Converted) -> None:
    """llama-speculative-simple with llama.cpp's own conversion of the head on the same
    target: the same rounds, drafts, accepted counts and text as specd's with specd's."""
    if reason := llama_cpp_oracle.missing("llama-speculative-simple"):
        pytest.skip(reason)
    result = compare_decodes(converted.target, converted.theirs, ORACLE_TEXT, n_predict=32, n_max=3)
    assert result.rounds >= 6 and result.drafts_compared >= 18, result
