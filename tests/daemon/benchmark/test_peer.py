"""The benchmark's peer: llama-server on tiny models in each mode, as `specd bench --peer`
runs it. Skipped where llama.cpp is not built (daemon/benchmark/llama_cpp.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specd.daemon.benchmark import llama_cpp
from specd.daemon.benchmark.llama_server import LlamaServer, LlamaServerError
from specd.daemon.benchmark.peer import MODES, LlamaServerPeer

from tiny_heads import write_tiny_head

pytestmark = pytest.mark.llama_cpp_oracle

PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 5, 17, 42, 100, 7, 3, 99, 12]


@pytest.fixture
def built() -> None:
    if reason := llama_cpp.missing("llama-server"):
        pytest.skip(reason)


def test_every_mode_runs_and_reports(built: None, tiny_model_factory: Callable[..., Path],
                                     tmp_path: Path) -> None:
    target = tiny_model_factory(arch="llama", weight_type="Q8_0", seed=3)
    draft = tiny_model_factory(arch="llama", weight_type="Q8_0", seed=3, perturb=0.05)
    head = write_tiny_head(tmp_path / "head.gguf", seed=5, target_arch="llama",
                           target_layers=(1,))  # llama.cpp aborts on id N (after the last layer)
    peer = LlamaServerPeer(target, threads=2, n_ctx=256, draft_path=draft, head_path=head)
    try:
        for mode in MODES:
            r = peer.run(PROMPT, mode, temperature=0.0, max_tokens=24, seed=1)
            assert r.tokens == 24 and r.decode_tps > 0 and r.prefill_tps > 0, mode
            assert r.peak_bytes > 0 and r.ttft_s > 0
            if mode.startswith("draft-simple"):  # the perturbed copy agrees often
                assert r.mean_acceptance_length > 1.0, mode
            else:
                assert r.mean_acceptance_length >= 1.0, mode
    finally:
        peer.close()
    with pytest.raises(ValueError, match="unknown peer mode 'eagle'"):
        LlamaServerPeer(target, 2, 256).run(PROMPT, "eagle", 0.0, 8, 1)
    with pytest.raises(ValueError, match="needs a drafter head"):
        LlamaServerPeer(target, 2, 256).run(PROMPT, "draft-dflash", 0.0, 8, 1)


def test_a_server_that_cannot_start_says_why(built: None, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(LlamaServerError, match="llama-server exited"):
        LlamaServer(bad, threads=1, n_ctx=64)
