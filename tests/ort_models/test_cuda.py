"""specd on ONNX Runtime's CUDA execution provider: the graphs, exact verify rows, the
speculative loop, the CLI and memory measuring on a GPU.

Skipped where there is no CUDA device or onnxruntime-gpu is not installed (CI has
neither); on a machine with both: `python -m pytest tests/ort_models/test_cuda.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.models.building import build_options
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import CUDA_ROW_BLOCK, ModelRunner

from numpy_reference import ReferenceModel
from speculation_checks import decode_all


def _why_no_cuda() -> str | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"{ort.__version__} has no CUDA execution provider (onnxruntime-gpu needed)"
    try:
        from specd.memory_fit.probes import CudaProbe

        CudaProbe(0).read()
    except Exception as exc:  # any failure means: no usable device
        return f"no CUDA device: {exc}"
    return None


NO_CUDA = _why_no_cuda()
pytestmark = pytest.mark.skipif(NO_CUDA is not None, reason=f"needs a GPU: {NO_CUDA}")

DEVICE = "cuda:0"
K_DIMS = {"n_embd": 256, "n_ff": 512}
CASES = [
    ("llama", "F32", {}), ("llama", "F16", {}), ("qwen2", "Q8_0", {}), ("qwen2", "Q4_0", {}),
    ("llama", "Q4_1", {}), ("qwen2", "Q5_0", {}), ("qwen2", "Q4_K", K_DIMS),
    ("qwen3", "Q5_K", K_DIMS), ("llama", "Q6_K", K_DIMS),
    ("llama", "F32", {"n_head_kv": 4}),  # group size 1: the padded-M attention path
]
IDS = [f"{a}-{w}{'-mha' if kw else ''}" for a, w, kw in CASES]
TOKENS = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]
EOG = {349}
PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]


def _runtime():
    from specd.ort_models.providers import choose_runtime

    return choose_runtime(DEVICE)


def _runner(built, n_ctx: int = 512, **kw) -> ModelRunner:
    r = ModelRunner(built, n_ctx=n_ctx, runtime=_runtime(), **kw)
    assert r.session.get_providers()[0] == "CUDAExecutionProvider"
    return r


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request, tiny_model_factory):
    arch, wt, kw = request.param
    path = tiny_model_factory(arch=arch, weight_type=wt, **kw)
    return path, wt, load_or_build(path, build_options("target", device=DEVICE))


def test_auto_chooses_cuda_and_the_exact_target_graph(monkeypatch) -> None:
    from specd.ort_models.providers import choose_runtime

    monkeypatch.delenv("SPECD_DEVICE", raising=False)  # conftest pins the rest to the CPU
    rt = choose_runtime("auto")
    assert (rt.provider, rt.device) == ("CUDAExecutionProvider", DEVICE)
    assert build_options("target", device=DEVICE) == BuildOptions()


def test_logits_match_reference(case) -> None:
    path, wt, built = case
    want = ReferenceModel(path).forward(TOKENS)  # [S, vocab] float64
    got = _runner(built).forward(0, TOKENS, 0, list(range(len(TOKENS))))
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 0.05, rel  # cuBLAS may multiply fp32 in TF32 (10-bit mantissa)
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.5
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_verify_rows_equal_single_steps_bitwise(case) -> None:
    """The promise greedy exactness rests on, with the runner's fixed call shape."""
    _, _, built = case
    singles_r = _runner(built)
    assert singles_r.row_block == CUDA_ROW_BLOCK
    singles = np.stack([singles_r.forward(0, [t], i)[0] for i, t in enumerate(TOKENS)])
    block_r = _runner(built)
    block_r.forward(0, TOKENS[:4], 0)
    n = CUDA_ROW_BLOCK
    block = block_r.forward(0, TOKENS[4:4 + n], 4, list(range(n)))
    assert np.array_equal(block, singles[4:4 + n])
    shorter = block_r.forward(0, TOKENS[6:9], 6, [0, 1, 2])  # rolled back, 3 rows
    assert np.array_equal(shorter, singles[6:9])


@pytest.fixture(scope="module")
def pair(tiny_model_factory):
    kw = {"arch": "qwen2", "weight_type": "Q8_0", "seed": 3, "context_length": 1024}
    target = tiny_model_factory(**kw)
    draft = tiny_model_factory(**kw, perturb=0.01)
    return (target, draft, load_or_build(target, build_options("target", device=DEVICE)),
            load_or_build(draft, build_options("draft", device=DEVICE)))


def _generate(target, drafter=None, **kw) -> tuple[list[int], Generation]:
    gen = Generation(_runner(target), 0, PROMPT, GenerationParams(**kw), eog=EOG,
                     drafter=drafter)
    return decode_all(gen), gen


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("n_max, adaptive", [(3, False), (7, False), (7, True)])
def test_speculation_is_exact_on_cuda(pair, temperature, n_max, adaptive) -> None:
    _, _, target, draft = pair
    assert draft.options.requant == "q4" and draft.options.attention == "exact"
    sp = SamplerParams(temperature=temperature, top_k=40, seed=11)
    want, _ = _generate(target, max_tokens=64, ignore_eos=True, sampling=sp)
    drafter = DraftModelDrafter(_runner(draft, row_block=1))
    got, gen = _generate(target, drafter, max_tokens=64, ignore_eos=True, sampling=sp,
                         draft=DraftParams(n_max=n_max), adaptive=adaptive)
    assert got == want
    assert gen.stats.rounds > 0
    if not (adaptive and temperature > 0):  # adaptive + sampled: few rounds, maybe none kept
        assert gen.stats.accepted > 0
    assert max(gen.stats.draft_lengths) < CUDA_ROW_BLOCK


def _specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd.daemon.cli", *args],
                          capture_output=True, text=True, timeout=600)


def test_cli_generate_on_cuda(pair) -> None:
    target, draft, _, _ = pair
    common = ["hello hello hello world", "-n", "32", "--ignore-eos", "--device", "cuda"]
    want = _specd("generate", "-m", str(target), *common)
    assert want.returncode == 0, want.stderr
    got = _specd("generate", "-m", str(target), "-md", str(draft), *common, "--json")
    assert got.returncode == 0, got.stderr
    stats = json.loads(got.stderr.strip().splitlines()[-1])
    assert stats["spec_type"] == "draft+ngram" and stats["generated_tokens"] == 32
    assert got.stdout == want.stdout
    assert "CUDAExecutionProvider on cuda:0" in got.stderr
    assert "No registered plugin EP" not in got.stderr  # ORT's warning per session


def test_memory_probe_and_measure_on_cuda(pair) -> None:
    from specd.memory_fit.measure import measure
    from specd.memory_fit.probes import probe_for

    mem = probe_for(DEVICE).read()
    assert 0 < mem.free_bytes <= mem.total_bytes
    _, _, target, _ = pair
    cost = measure(target, DEVICE, use_cache=False, points=(256, 512))
    assert cost.weights_bytes > 0 and cost.kv_bytes_per_token > 0
    assert cost.runtime_bytes > 0  # the CUDA context
