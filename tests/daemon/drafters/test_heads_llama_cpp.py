"""llama.cpp as the oracle of every head kind it runs: a tiny llama target (4 layers,
float32) and a tiny head of each kind, with the target's vocabulary and with a reduced one
(d2t), decoded greedily by llama.cpp's llama-speculative-simple and by specd's round,
compared round by round (tests/support/head_decode_oracle.py says how: the same rounds,
drafts, accepted counts and text; a near tie by a float64 reference the only difference).
Skipped where llama.cpp is not built (bench/build_llama_cpp.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import llama_cpp_oracle
from head_decode_oracle import compare_decodes
from tiny_gguf import write_tiny_gguf
from tiny_heads import gemma_features, write_tiny_head

TEXT = "hello world, this is a test"
N_PREDICT = 32
N_MAX = 3
HEADS: dict[str, dict[str, Any]] = {
    "dflash": {"kind": "dflash", "target_layers": (1, 3)},
    "dflash2": {"kind": "dflash2", "target_layers": (1, 3)},
    "dspark": {"kind": "dspark", "target_layers": (1, 3)},
    "dspark-bonus-anchor": {"kind": "dspark", "target_layers": (1, 3),
                            "sample_from_anchor": False, "confidence_head": False},
    "eagle3": {"kind": "eagle3", "target_layers": (1, 2, 3)},
    # what heads of Gemma targets use (llama.cpp cannot draft for a gemma3 target: its
    # gemma3 graph does not expose the layer inputs a head reads, so the target is llama)
    "dflash-gemma": {"kind": "dflash", "target_layers": (1, 3),
                     **gemma_features(sliding_window=5)},
    "dspark-gemma": {"kind": "dspark", "target_layers": (1, 3),
                     **gemma_features(sliding_window=5, gelu=True, post_norms=True,
                                      attention_scale=0.3, value_scale=0.7,
                                      output_scale=0.9)},
    "dflash2-gemma": {"kind": "dflash2", "target_layers": (1, 3),
                      **gemma_features(sliding_window=5, gelu=True, attention_scale=0.3,
                                       shared_kv=True, sinks=True)},
    "dflash-gemma4": {"kind": "dflash", "target_layers": (1, 3),
                      **gemma_features(sliding_window=5, shared_kv=True, sinks=True,
                                       post_norms=True, output_scale=0.9)},
    # linear rope scaling and rope frequency factors (Llama 3.1's, as rope_freqs.weight)
    "dflash-rope": {"kind": "dflash", "target_layers": (1, 3),
                    **gemma_features(embedding_scale=None, rope_linear=8.0, rope_freqs=True)},
    "eagle3-rope-freqs": {"kind": "eagle3", "target_layers": (1, 2, 3),
                          **gemma_features(embedding_scale=None, rope_freqs=True)},
}
VOCABS: dict[str, dict[str, Any]] = {"full": {}, "d2t": {"draft_vocab": 100}}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("target") / "target.gguf", arch="llama",
                           weight_type="F32", seed=3, n_layer=4, context_length=512)


@pytest.mark.parametrize("vocab", list(VOCABS))
@pytest.mark.parametrize("name", list(HEADS))
def test_decodes_are_llama_cpps_round_by_round(tmp_path: Path, target: Path, name: str,
                                              vocab: str) -> None:
    if reason := llama_cpp_oracle.missing("llama-speculative-simple"):
        pytest.skip(reason)
    head = write_tiny_head(tmp_path / "head.gguf", seed=5, target_arch="llama",
                           weight_type="F32", **HEADS[name], **VOCABS[vocab])
    result = compare_decodes(target, head, TEXT, n_predict=N_PREDICT, n_max=N_MAX)
    print(result)
    assert result.rounds >= 8
