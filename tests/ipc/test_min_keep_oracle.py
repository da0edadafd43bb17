"""`min_keep` against llama-server built from llama.cpp's source, on Qwen2.5-Coder-0.5B:
the distribution the first token is drawn from (post-sampling probabilities) holds the same
tokens with the same probabilities on both servers, for each sampler that takes min_keep,
at settings where it binds (the filter alone would keep fewer).

The two implementations' logits differ by rounding, so probabilities are compared to
1e-3, and the settings are away from near ties at each filter's cut."""

from __future__ import annotations

from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig

import llama_cpp_oracle
from live_server import LiveServer, live_server_in

MODEL = "qwen2.5-coder-0.5b-instruct"
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
# (the chain's settings with min_keep, the filter alone would keep fewer than min_keep)
CASES = [
    pytest.param({"samplers": ["min_p", "temperature"], "min_p": 1.0, "min_keep": 5},
                 id="min_p"),
    pytest.param({"samplers": ["top_p", "temperature"], "top_p": 0.05, "min_keep": 6},
                 id="top_p"),
    pytest.param({"samplers": ["typ_p", "temperature"], "typical_p": 0.05, "min_keep": 4},
                 id="typical"),
    pytest.param({"samplers": ["top_k", "top_p", "min_p", "temperature"], "top_k": 40,
                  "top_p": 0.05, "min_p": 0.9, "min_keep": 3}, id="kpmt"),
]


def _request(settings: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": PROMPT, "n_predict": 1, "temperature": 1.0, "seed": 3,
            "n_probs": 10, "post_sampling_probs": True, "cache_prompt": False, **settings}


def _distribution(answer: dict[str, Any]) -> dict[int, float]:
    return {int(t["id"]): float(t["prob"])
            for t in answer["completion_probabilities"][0]["top_probs"]}


@pytest.fixture(scope="module")
def model_path() -> Any:
    return llama_cpp_oracle.served_model(MODEL)


@pytest.fixture(scope="module")
def theirs(model_path: Any) -> dict[str, dict[int, float]]:
    """llama-server's distributions, one per case (one server for the module), with and
    without min_keep."""
    from specd.daemon.benchmark.llama_server import LlamaServer

    out: dict[str, dict[int, float]] = {}
    with LlamaServer(model_path, threads=2, n_ctx=512,
                     args=["-np", "1", "--no-warmup"]) as server:
        for case in CASES:
            settings = case.values[0]
            out[case.id] = _distribution(server.post("/completion", _request(settings)))
            out[case.id + "-alone"] = _distribution(server.post(
                "/completion", _request({**settings, "min_keep": 0})))
    return out


@pytest.fixture(scope="module")
def ours(model_path: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = EngineConfig(target=str(model_path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server_in(tmp_path_factory, "min-keep-oracle", cfg) as srv:
        yield srv


@pytest.mark.llama_cpp_oracle
@pytest.mark.slow
@pytest.mark.parametrize("settings", CASES)
def test_min_keep_gives_llama_servers_distribution(settings: dict[str, Any],
                                                   theirs: dict[str, dict[int, float]],
                                                   ours: LiveServer,
                                                   request: pytest.FixtureRequest) -> None:
    case = request.node.callspec.id
    want, alone = theirs[case], theirs[case + "-alone"]
    assert len(alone) < settings["min_keep"] <= len(want)  # min_keep binds there
    status, answer = ours.request("POST", "/completion", _request(settings))
    assert status == 200, answer
    got = _distribution(answer)
    assert set(got) == set(want), (got, want)
    for token, p in want.items():
        assert got[token] == pytest.approx(p, abs=1e-3), (token, got, want)
