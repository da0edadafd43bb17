"""llama-server's router routes /models/load and /models/unload (what `specd load`,
`specd unload` and the tray's item send) against a live server."""

from __future__ import annotations

import time

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server_in


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=2)
    with live_server_in(tmp_path_factory, "model-load-routes", cfg, keep_alive=300) as srv:
        yield srv


def _loaded(server: LiveServer, want: bool, within: float = 20.0) -> bool:
    """Whether /props reports the model's state as `want` within `within` seconds."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        status, props = server.request("GET", "/props")
        assert status == 200
        if props["loaded"] is want:
            return True
        time.sleep(0.1)
    return False


def _complete(server: LiveServer) -> list[int]:
    status, out = server.request("POST", "/completion", {
        "prompt": "hello there", "n_predict": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200, out
    return out["tokens"]


def test_unload_then_load_as_llama_servers_router(server: LiveServer) -> None:
    want = _complete(server)
    assert _loaded(server, True)
    assert server.request("POST", "/models/unload", {}) == (200, {"success": True})
    assert _loaded(server, False)
    status, out = server.request("POST", "/models/unload", {})
    assert status == 400 and out["error"]["message"] == "model is not running"
    status, models = server.request("GET", "/v1/models")
    assert models["data"][0]["status"] == {"value": "unloaded"}
    assert server.request("POST", "/models/load", {}) == (200, {"success": True})
    assert _loaded(server, True, within=1.0)  # loaded before the answer
    status, out = server.request("POST", "/models/load", {"model": ""})
    assert status == 400 and out["error"]["message"] == "model is already running"
    assert _complete(server) == want  # the reloaded model answers as before


def test_an_unknown_model_is_a_404(server: LiveServer) -> None:
    for route in ("/models/load", "/models/unload"):
        status, out = server.request("POST", route, {"model": "no-such-model"})
        assert status == 404, out
