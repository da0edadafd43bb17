"""llama-server's sampler chain fields over the real HTTP API (tiny FIM model): `samplers`
as names or letters on /completion, /infill, /v1/completions and /v1/chat/completions,
reported back as llama-server reports them; unknown names and bad DRY settings are 400s
naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server_in


@pytest.fixture(scope="module")
def srv(tiny_model_factory, tmp_path_factory) -> Any:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=6, fim=True)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server_in(tmp_path_factory, "sampler-chain", cfg) as server:
        yield server


def test_samplers_are_taken_and_reported(srv: LiveServer) -> None:
    status, out = srv.request("POST", "/infill", {
        "input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    ",
        "n_predict": 8, "top_k": 40, "top_p": 0.9, "seed": 1,
        "samplers": ["top_k", "top_p", "infill"]})
    assert status == 200, out
    settings = out["generation_settings"]
    assert settings["samplers"] == ["top_k", "top_p", "infill"]
    status, out = srv.request("POST", "/completion", {
        "prompt": "a", "n_predict": 4, "samplers": "edkypmxt", "typical_p": 0.9,
        "xtc_probability": 0.3, "xtc_threshold": 0.2, "dry_multiplier": 0.8,
        "dry_base": 0.5, "dry_allowed_length": 3, "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n"], "top_n_sigma": 2.0, "dynatemp_range": 0})
    assert status == 200, out
    s = out["generation_settings"]
    assert s["samplers"] == ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
                             "temperature"]
    assert (s["typical_p"], s["xtc_probability"], s["xtc_threshold"]) == (0.9, 0.3, 0.2)
    assert (s["dry_multiplier"], s["dry_base"], s["dry_allowed_length"]) == (0.8, 1.75, 3)
    assert (s["dry_penalty_last_n"], s["dry_sequence_breakers"], s["top_n_sigma"]) == (
        -1, ["\n"], 2.0)
    status, props = srv.request("GET", "/props")
    assert props["default_generation_settings"]["params"]["samplers"] == [
        "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
        "temperature"]


@pytest.mark.parametrize("route, body", [
    ("/completion", {"prompt": "a", "n_predict": 2}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 2}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "max_tokens": 2}),
])
def test_every_route_takes_samplers_and_refuses_unknown_ones(srv: LiveServer, route: str,
                                                             body: dict) -> None:
    status, out = srv.request("POST", route, {**body, "samplers": ["top-k", "nucleus",
                                                                   "infill"]})
    assert status == 200, out
    for samplers, named in ((["top_k", "mirostat"], "'mirostat'"), ("kpz", "'z'"),
                            (["adaptive_p"], "adaptive_p"), (7, "samplers")):
        status, out = srv.request("POST", route, {**body, "samplers": samplers})
        assert status == 400, (samplers, out)
        assert named in out["error"]["message"], out


@pytest.mark.parametrize("field, value, named", [
    ("dry_sequence_breakers", [], "dry_sequence_breakers"),
    ("dry_sequence_breakers", ["a", 1], "dry_sequence_breakers"),
    ("dry_allowed_length", -1, "dry_allowed_length"),
    ("xtc_probability", 1.5, "xtc_probability"),
    ("typical_p", "high", "typical_p"),
    ("dynatemp_range", 0.5, "dynatemp_range"),
])
def test_bad_chain_settings_are_400s_naming_the_field(srv: LiveServer, field: str,
                                                      value: Any, named: str) -> None:
    status, out = srv.request("POST", "/completion", {"prompt": "a", "n_predict": 1,
                                                      field: value})
    assert status == 400 and named in out["error"]["message"], out


def _post_sampling_widths(srv: LiveServer, route: str, body: dict) -> list[int]:
    """How many tokens each emitted token's distribution held (post_sampling_probs' entries
    among the 8 asked for), on `route`."""
    status, out = srv.request("POST", route, body)
    assert status == 200, out
    if route == "/completion":
        rows = out["completion_probabilities"]
    else:
        rows = out["choices"][0]["logprobs"]["content"]
    return [len(t["top_probs"]) for t in rows]


@pytest.mark.parametrize("route, body", [
    ("/completion", {"prompt": "def add(a, b):", "n_predict": 6, "n_probs": 8}),
    ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 6, "logprobs": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}],
                              "max_tokens": 6, "logprobs": True, "top_logprobs": 8}),
])
def test_min_keep_widens_the_distribution_drawn_from(srv: LiveServer, route: str,
                                                     body: dict) -> None:
    """min_p 1 keeps the most likely token alone; with min_keep 4 (llama-server's field) the
    distribution each token is drawn from holds four, on every route and under speculation
    (the server drafts by n-gram lookup): the post-sampling probabilities show it."""
    settings = {**body, "temperature": 1.0, "min_p": 1.0, "seed": 3, "ignore_eos": True,
                "post_sampling_probs": True}
    assert _post_sampling_widths(srv, route, settings) == [1] * 6
    assert _post_sampling_widths(srv, route, {**settings, "min_keep": 4}) == [4] * 6
    status, out = srv.request("POST", route, {**settings, "min_keep": -1})
    assert status == 400 and "min_keep" in out["error"]["message"], out


def test_min_keep_is_reported(srv: LiveServer) -> None:
    status, out = srv.request("POST", "/completion", {"prompt": "a", "n_predict": 1,
                                                      "min_keep": 3})
    assert status == 200 and out["generation_settings"]["min_keep"] == 3, out
    status, props = srv.request("GET", "/props")
    assert props["default_generation_settings"]["params"]["min_keep"] == 0
