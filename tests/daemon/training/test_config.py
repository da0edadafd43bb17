"""The head's shape from its target: the layers it reads (llama.cpp's ids), the mask token,
the draft vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specd.daemon.training import TrainError
from specd.daemon.training.config import default_target_layers, head_config, mask_token
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFFile


def test_target_layers_follow_z_labs_rule_plus_one() -> None:
    # HF ids of published configs, + 1: Qwen3-8B (36 layers) [1, 9, 17, 25, 33],
    # SpecForge's Qwen2.5-0.5B (24) [1, 6, 11, 16, 21]; Qwen2.5-Coder-1.5B has 28
    assert default_target_layers(36) == (2, 10, 18, 26, 34)
    assert default_target_layers(24) == (2, 7, 12, 17, 22)
    assert default_target_layers(28) == (2, 8, 14, 20, 26)
    assert default_target_layers(28, 3) == (2, 14, 26)
    # too shallow for the rule: spread over what llama.cpp reads (never id N)
    assert default_target_layers(3) == (1, 2)
    assert default_target_layers(2) == (1,)
    assert default_target_layers(5) == (1, 2, 3, 4)


def test_head_config_of_a_tiny_target(tiny_model_factory: Callable[..., Path]) -> None:
    f = GGUFFile(tiny_model_factory(arch="qwen3"))
    hp = read_hparams(f)
    cfg = head_config(f, hp, draft_vocab=100)
    assert (cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff) == (
        hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff)
    assert cfg.target_layers == (1,) and cfg.hidden_layers == (0,)
    assert cfg.feature_width == hp.n_embd
    assert cfg.reduced and cfg.draft_vocab == 100
    tokens = f.get("tokenizer.ggml.tokens")
    assert cfg.mask_token_id == mask_token(f, hp.n_vocab) and tokens[cfg.mask_token_id] \
        .startswith("[PAD")
    assert not head_config(f, hp, draft_vocab=0).reduced
    assert not head_config(f, hp, draft_vocab=10 ** 6).reduced
    with pytest.raises(TrainError, match=r"\[0\] are outside 1..1"):
        head_config(f, hp, target_layers=(0, 1))
    with pytest.raises(TrainError, match="no input to read after the last layer"):
        head_config(f, hp, target_layers=(1, 2))
    with pytest.raises(TrainError, match="block"):
        head_config(f, hp, block_size=1)
