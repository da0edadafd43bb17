"""llama.cpp as the oracle of every head kind it runs: a tiny llama target (4 layers,
float32) and a tiny head of each kind, with the target's vocabulary and with a reduced one
(d2t), decoded greedily by llama.cpp's llama-speculative-simple and by specd's round,
compared round by round (tests/support/head_decode_oracle.py says how: the same rounds,
drafts, accepted counts and text; a near tie by a float64 reference the only difference).
Skipped where llama.cpp is not built (bench/build_llama_cpp.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import TokenType

import llama_cpp_oracle
from head_decode_oracle import compare_decodes
from tiny_gguf import build_vocab, write_tiny_gguf
from tiny_heads import gemma_features, write_tiny_head

pytestmark = pytest.mark.llama_cpp_oracle

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


@pytest.fixture(scope="module")
def cycling(tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A target whose greedy text follows a permutation of its normal tokens: its output
    rows are its embeddings permuted (row j = E[sigma(j)]) and its layers' outputs small,
    so the token after x is sigma^-1(x), by far. Returns it and `_chain_heads`."""
    voc = build_vocab("llama")
    n_vocab = len(voc.tokens)
    normal = [i for i, t in enumerate(voc.token_types) if t == TokenType.NORMAL]
    rng = np.random.default_rng(9)
    embd = rng.standard_normal((n_vocab, 64)).astype(np.float32)  # [V, E]
    sigma = np.arange(n_vocab)
    sigma[normal] = rng.permutation(normal)
    return write_tiny_gguf(
        tmp_path_factory.mktemp("cycling") / "target.gguf", arch="llama", weight_type="F32",
        seed=3, n_layer=4, context_length=512, tie_embeddings=False,
        tensors={"token_embd.weight": embd, "output.weight": embd[sigma],
                 **_small_outputs(rng, 4)}), _chain_heads(sigma, embd)


def _small_outputs(rng: np.random.Generator, n_layer: int) -> dict[str, np.ndarray]:
    """Layers' output matrices (attention, FFN) near zero: each layer adds little."""
    out = {}
    for i in range(n_layer):
        out[f"blk.{i}.attn_output.weight"] = (0.002 * rng.standard_normal((64, 64))
                                              ).astype(np.float32)
        out[f"blk.{i}.ffn_down.weight"] = (0.002 * rng.standard_normal((64, 128))
                                           ).astype(np.float32)
    return out


def _chain_heads(sigma: np.ndarray, embd: np.ndarray) -> dict[str, dict[str, Any]]:
    """Heads that draft the cycling target's text, in part:

    dspark: its rows near their embeddings (layers adding little), through the target's
    LM head: the anchor row drafts sigma^-1(last), the next; the Markov head (rank = the
    vocabulary, W1 = I) adds 200 to sigma^-1(prev) where prev is one of half the tokens,
    so a mask row drafts the next token only after one of those (else the mask token).
    eagle3: fc passes the stream entering the target's last layer (near the state that
    predicts the next token; llama.cpp reads the one after it from an output its llama
    graph does not fill) and
    its own LM head is the target's twice permuted (row j = E[sigma(sigma(j))]): the
    first step drafts the token after next, right; the next steps (g their row's, the
    same state) draft it again, wrong."""
    n_vocab = len(sigma)
    rng = np.random.default_rng(10)
    mapped = rng.random(n_vocab) < 0.5
    w2 = np.zeros((n_vocab, n_vocab), np.float32)  # [V, rank]: row j reads prev = sigma(j)
    rows = np.flatnonzero(mapped[sigma])
    w2[rows, sigma[rows]] = 200.0
    fc = np.zeros((64, 3 * 64), np.float32)
    fc[:, 128:] = np.eye(64)
    return {
        "dspark-chain": {"kind": "dspark", "target_layers": (1, 3), "markov_rank": n_vocab,
                         "tensors": {"markov_w1.weight": np.eye(n_vocab, dtype=np.float32),
                                     "markov_w2.weight": w2, **_small_outputs(rng, 2)}},
        "eagle3-chain": {"kind": "eagle3", "target_layers": (1, 2, 3), "own_output": True,
                         "tensors": {"fc.weight": fc, "output.weight": embd[sigma[sigma]],
                                     **_small_outputs(rng, 1)}},
    }


@pytest.mark.parametrize("name", ["dspark-chain", "eagle3-chain"])
def test_partial_acceptance_is_llama_cpps_round_by_round(
        tmp_path: Path, cycling: tuple[Path, dict[str, dict[str, Any]]], name: str) -> None:
    """Heads whose drafts the target accepts in part (`_chain_heads`): the accepted count
    of every round, 0 to all of it, as llama.cpp's."""
    if reason := llama_cpp_oracle.missing("llama-speculative-simple"):
        pytest.skip(reason)
    target, heads = cycling
    head = write_tiny_head(tmp_path / "head.gguf", seed=5, target_arch="llama",
                           weight_type="F32", **heads[name])
    result = compare_decodes(target, head, TEXT, n_predict=N_PREDICT, n_max=N_MAX)
    print(f"\n{name}: {result}")
    counts = set(result.accepted_counts)
    assert result.rounds >= 8 and result.drafts_compared == result.drafted
    # dspark: rounds accepting 1, 2 and all 3; eagle3: its first draft in every round
    assert counts >= {1, 2, 3} if name.startswith("dspark") else counts == {1}, counts


@pytest.mark.parametrize("vocab", list(VOCABS))
@pytest.mark.parametrize("name", list(HEADS))
def test_decodes_are_llama_cpps_round_by_round(tmp_path: Path, target: Path, name: str,
                                              vocab: str) -> None:
    if reason := llama_cpp_oracle.missing("llama-speculative-simple"):
        pytest.skip(reason)
    head = write_tiny_head(tmp_path / "head.gguf", seed=5, target_arch="llama",
                           weight_type="F32", **HEADS[name], **VOCABS[vocab])
    result = compare_decodes(target, head, TEXT, n_predict=N_PREDICT, n_max=N_MAX)
    print(f"\n{name}/{vocab}: {result}")
    assert result.rounds >= 8
    # llama.cpp logs every drafted token but DFlash2's (compare_decodes checks those
    # against the float64 reference)
    assert result.drafts_compared == (0 if HEADS[name]["kind"] == "dflash2"
                                      else result.drafted)
