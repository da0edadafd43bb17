"""/metrics in llama-server's series and the per-request timings as llama-server gives
them (tiny model, real server on loopback)."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=1,
                       embeddings=True)
    with live_server(cfg, tmp) as srv:
        yield srv
    mp.undo()


def _metrics(srv: LiveServer) -> tuple[dict[str, str], dict[str, tuple[str, float]]]:
    """/metrics' headers, and {name: (type, value)} of its unlabelled llamacpp: series."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {srv.token}"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200
    types: dict[str, str] = {}
    out: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE llamacpp:"):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            assert f"# HELP {name} " in text
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            out[name] = (types[name], float(value))
    return dict(resp.getheaders()), out


def _events(payload: Any) -> list[dict[str, Any]]:
    assert isinstance(payload, str), payload
    return [json.loads(line[6:]) for line in payload.splitlines()
            if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_llamacpp_series_count_what_requests_report(server) -> None:
    headers, before = _metrics(server)
    assert int(headers["Process-Start-Time-Unix"]) == int(server.service.started)
    assert before["llamacpp:requests_processing"] == ("gauge", 0)
    prompt_n = cache_n = predicted_n = 0
    for n in (1, 6, 6):  # the third reuses the second's prompt from the slot's cache
        status, body = server.request("POST", "/completion", {
            "prompt": "one two three four five six", "n_predict": n, "ignore_eos": True})
        assert status == 200, body
        t = body["timings"]
        prompt_n, cache_n, predicted_n = (prompt_n + t["prompt_n"], cache_n + t["cache_n"],
                                          predicted_n + t["predicted_n"])
    assert cache_n > 0
    _, after = _metrics(server)
    assert after["llamacpp:prompt_tokens_total"] == (
        "counter", before["llamacpp:prompt_tokens_total"][1] + prompt_n)
    assert after["llamacpp:prompt_tokens_cached_total"][1] == (
        before["llamacpp:prompt_tokens_cached_total"][1] + cache_n)
    assert after["llamacpp:tokens_predicted_total"][1] == (
        before["llamacpp:tokens_predicted_total"][1] + predicted_n)
    assert after["llamacpp:n_decode_total"][1] > before["llamacpp:n_decode_total"][1]
    assert after["llamacpp:n_tokens_max"][1] >= 6 + 6
    assert after["llamacpp:n_busy_slots_per_decode"] == ("gauge", 1)
    for name in ("spec_decode_num_draft_tokens_total", "prompt_seconds_total",
                 "tokens_predicted_seconds_total"):
        assert after[f"llamacpp:{name}"][0] == "counter"


def test_rate_gauges_cover_the_time_since_the_last_scrape(server) -> None:
    """As llama-server's: a dashboard sees what runs now, not an average since start."""
    status, _ = server.request("POST", "/completion", {
        "prompt": "seven eight nine", "n_predict": 6, "ignore_eos": True})
    assert status == 200
    _, busy = _metrics(server)
    assert busy["llamacpp:predicted_tokens_seconds"][1] > 0
    assert busy["llamacpp:prompt_tokens_seconds"][1] > 0
    _, idle = _metrics(server)  # nothing ran since
    assert idle["llamacpp:predicted_tokens_seconds"] == ("gauge", 0)
    assert idle["llamacpp:prompt_tokens_seconds"] == ("gauge", 0)


def test_embeddings_count_as_prompt_work(server) -> None:
    _, before = _metrics(server)
    status, body = server.request("POST", "/v1/embeddings", {"input": ["hello world", "bye"]})
    assert status == 200, body
    _, after = _metrics(server)
    assert after["llamacpp:prompt_tokens_total"][1] > before["llamacpp:prompt_tokens_total"][1]
    assert after["llamacpp:n_decode_total"][1] >= before["llamacpp:n_decode_total"][1] + 2
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"]


def test_rates_are_over_the_tokens_after_the_first(server) -> None:
    """The first token comes out of the prompt's pass: generation's rate and time per
    token are over the others, computed from the milliseconds the response reports."""
    one = server.request("POST", "/completion", {"prompt": "a b", "n_predict": 1})[1]
    assert one["timings"]["predicted_per_second"] == 0.0
    assert one["timings"]["predicted_per_token_ms"] == 0.0
    t = server.request("POST", "/completion", {"prompt": "a b c", "n_predict": 8,
                                               "ignore_eos": True, "cache_prompt": False}
                       )[1]["timings"]
    assert t["predicted_n"] == 8
    assert t["predicted_per_second"] == pytest.approx(1e3 / t["predicted_ms"] * 7, abs=1e-9)
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 7, abs=1e-9)
    assert t["prompt_per_second"] == pytest.approx(1e3 / t["prompt_ms"] * t["prompt_n"],
                                                   abs=1e-9)


def test_timings_per_token_in_streams(server) -> None:
    status, payload = server.request("POST", "/completion", {
        "prompt": "one two three " * 20, "n_predict": 4, "ignore_eos": True, "stream": True,
        "timings_per_token": True, "return_progress": True, "cache_prompt": False})
    assert status == 200
    events = _events(payload)
    progress = [e for e in events if "prompt_progress" in e]
    assert progress[0]["timings"]["prompt_n"] == 0
    assert progress[0]["timings"]["prompt_ms"] == 0.0
    assert progress[-1]["timings"]["prompt_n"] == progress[-1]["prompt_progress"]["processed"]
    tokens = [e for e in events if e["tokens"]]
    assert [e["timings"]["predicted_n"] for e in tokens][-1] == 4
    assert all(v is not None and v >= 0 for e in events for v in e["timings"].values())
    # without timings_per_token only the final event has them
    plain = _events(server.request("POST", "/completion", {
        "prompt": "one", "n_predict": 2, "stream": True})[1])
    assert ["timings" in e for e in plain] == [False] * (len(plain) - 1) + [True]

    # OpenAI's chunks: per token where asked, and on the last chunk always
    chunks = _events(server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "timings_per_token": True, "stream_options": {"include_usage": True}})[1])
    assert "timings" not in chunks[0]  # the role's
    assert chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] <= 3
    assert all("timings" in c for c in chunks[1:] if c["choices"] and
               c["choices"][0]["delta"].get("content"))
    status, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert body["timings"]["predicted_n"] == body["usage"]["completion_tokens"]
