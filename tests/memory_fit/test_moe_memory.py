"""Memory fit on a mixture-of-experts target: every expert's bytes count as weights, the
experts no row has woken yet too (a request's rows may wake any of them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from gguf import GGUFReader

from specd.memory_fit.measure import measure
from specd.ort_models import native_ops
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import MODEL_FILE, load_or_build
from specd.ort_models.runner import Call, ModelRunner

from tiny_moe import write_tiny_qwen3moe

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")


def _expert_bytes(folder: Path) -> int:
    """Bytes of the graph's expert initializers (GgufExperts' W) in weights.bin."""
    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    return sum(int(e.value) for t in model.graph.initializer if t.name.endswith(".experts")
               for e in t.external_data if e.key == "length")


N_LAYER, N_EXPERT, ASLEEP = 2, 64, 32


def _silence_experts(path: Path, first: int) -> None:
    """Zero the routers' rows of experts `first`.. in place: their logit is 0, below the
    top 2 of the other 32 experts' random logits, so no row wakes them."""
    reader = GGUFReader(path, "r+")
    for t in reader.tensors:
        if t.name.endswith("ffn_gate_inp.weight"):
            rows = t.data.reshape(N_EXPERT, -1)  # [n_expert, n_embd]
            rows[first:] = 0
    reader.data.flush()


def test_every_experts_bytes_count_as_weights(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    # 2 layers of 64 Q8_0 experts, ~27 MB: far above the RSS deltas' noise; half of them
    # never woken by the rows memory fit measures with (nor any other)
    path = write_tiny_qwen3moe(tmp_path / "m.gguf", expert_type="Q8_0", n_layer=N_LAYER,
                               n_embd=256, n_expert=N_EXPERT, n_used=2, n_ff_exp=512)
    _silence_experts(path, ASLEEP)
    built = load_or_build(path, BuildOptions(kernels="gguf", attention="native"))
    experts = _expert_bytes(built.folder)
    assert experts > 0.9 * built.weights_bytes  # the experts are the model's bulk
    ids = np.random.default_rng(0).integers(0, built.hparams.n_vocab, 256).tolist()
    woken = ModelRunner(built, n_ctx=512).forward_batch([Call(0, ids, 0)])[0].experts_woken
    assert N_LAYER * 2 < woken <= N_LAYER * ASLEEP  # the silenced half sleeps
    cost = measure(built, "cpu", threads=1, use_cache=False)
    assert cost.weights_bytes >= experts, (cost.weights_bytes, experts)
    assert cost.weights_bytes < 2 * built.weights_bytes
