"""/metrics in llama-server's series (tiny model, real server on loopback)."""

from __future__ import annotations

import http.client

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


def test_embeddings_count_as_prompt_work(server) -> None:
    _, before = _metrics(server)
    status, body = server.request("POST", "/v1/embeddings", {"input": ["hello world", "bye"]})
    assert status == 200, body
    _, after = _metrics(server)
    assert after["llamacpp:prompt_tokens_total"][1] > before["llamacpp:prompt_tokens_total"][1]
    assert after["llamacpp:n_decode_total"][1] >= before["llamacpp:n_decode_total"][1] + 2
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"]
