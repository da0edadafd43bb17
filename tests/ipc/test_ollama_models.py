"""ipc/http/ollama_models.py: Ollama's model routes on a live server with a tiny model
(embeddings on), and /api/pull over a stand-in for the store's download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.models.catalog import CATALOG
from specd.daemon.models.store import ModelStoreError
from specd.daemon.serving.engine import EngineConfig
from specd.ipc.http import ollama_models

from live_server import LiveServer, live_server, live_server_in


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=256, slots=1,
                       embeddings=True)
    with live_server_in(tmp_path_factory, "ollama-models", cfg) as srv:
        yield srv


def test_tags_and_ps_list_the_served_model(server: LiveServer) -> None:
    engine = server.service.engine
    status, tags = server.request("GET", "/api/tags")
    assert status == 200
    [model] = tags["models"]
    assert model["name"] == model["model"] == engine.model_name + ":latest"
    assert model["size"] == engine.target.path.stat().st_size
    assert model["digest"] == engine.target.gguf.content_hash()
    assert model["details"]["format"] == "gguf" and model["details"]["family"] == "qwen2"
    assert model["details"]["quantization_level"] == "Q8_0"
    assert model["modified_at"].endswith("Z")
    status, ps = server.request("GET", "/api/ps")
    [loaded] = ps["models"]
    assert loaded["name"] == model["name"] and loaded["size_vram"] == 0  # on the CPU
    assert loaded["size"] > 0 and loaded["context_length"] == 256
    assert loaded["expires_at"] > "2100"  # never unloaded
    status, version = server.request("GET", "/api/version")
    assert status == 200 and version["version"].count(".") == 2


def test_show_gives_capabilities_and_the_context(server: LiveServer) -> None:
    name = server.service.engine.model_name
    status, out = server.request("POST", "/api/show", {"model": name + ":latest"})
    assert status == 200
    assert out["capabilities"] == ["completion", "embedding"]  # no tools in its template
    assert out["model_info"]["qwen2.context_length"] == 256
    assert out["model_info"]["general.parameter_count"] > 0
    assert out["template"] == server.service.engine.chat_template
    assert "num_ctx 256" in out["parameters"]
    status, out = server.request("POST", "/api/show", {"model": "llama3"})
    assert (status, out) == (404, {"error": "model 'llama3' not found"})


def test_embed_gives_unit_vectors_and_truncates(server: LiveServer) -> None:
    name = server.service.engine.model_name
    status, out = server.request("POST", "/api/embed", {"model": name,
                                                        "input": ["a cat", "a dog"]})
    assert status == 200 and out["model"] == name and len(out["embeddings"]) == 2
    for v in out["embeddings"]:
        assert abs(np.linalg.norm(v) - 1) < 1e-5
    assert out["prompt_eval_count"] > 0
    status, short = server.request("POST", "/api/embed", {"model": name, "input": "a cat",
                                                          "dimensions": 8})
    assert len(short["embeddings"][0]) == 8 and abs(np.linalg.norm(short["embeddings"][0])
                                                     - 1) < 1e-5
    long = "word " * 1000  # more tokens than the context, less text than it refuses
    status, out = server.request("POST", "/api/embed", {"model": name, "input": long})
    assert status == 200 and out["prompt_eval_count"] == 255  # cut to the context
    status, out = server.request("POST", "/api/embed", {"model": name, "input": long,
                                                        "truncate": False})
    assert status == 400 and "too large" in out["error"]
    status, old = server.request("POST", "/api/embeddings", {"model": name,
                                                             "prompt": "a cat"})
    assert status == 200 and len(old["embedding"]) > 8
    assert abs(np.linalg.norm(old["embedding"]) - 1) > 1e-3  # not normalized, as Ollama's


def test_embed_without_embeddings_is_a_400_naming_the_option(tiny_model_factory,
                                                              tmp_path) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=128, slots=1)
    with live_server(cfg, tmp_path) as srv:
        status, out = srv.request("POST", "/api/embed", {"model": "specd", "input": "x"})
    assert status == 400 and "--embeddings" in out["error"]


def _pull(server: LiveServer, body: dict[str, Any]) -> tuple[int, Any]:
    return server.request("POST", "/api/pull", body)


def test_pull_reports_progress_as_ollamas_status_lines(server: LiveServer, monkeypatch) -> None:
    pulled: list[str] = []

    def fake_pull(name: str, *, progress: Any = None) -> Path:
        pulled.append(name)
        for done in (0, 50, 100):
            if progress is not None:
                progress(done, 100, name)
        return Path("/nowhere") / name

    monkeypatch.setattr(ollama_models, "pull_model", fake_pull)
    name = next(iter(CATALOG))
    status, text = _pull(server, {"model": name + ":latest"})
    assert status == 200
    lines = [json.loads(x) for x in text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"}
    assert [x["completed"] for x in lines if "completed" in x] == [0, 50, 100]
    assert lines[1]["digest"] == "sha256:" + CATALOG[name].sha256
    assert [x["status"] for x in lines[-3:]] == ["verifying sha256 digest",
                                                 "writing manifest", "success"]
    assert _pull(server, {"model": name, "stream": False}) == (200, {"status": "success"})
    assert pulled == [name, name]


def test_a_failed_pull_and_an_unknown_name(server: LiveServer, monkeypatch) -> None:
    def failing(name: str, *, progress: Any = None) -> Path:
        raise ModelStoreError(f"{name}: no network")

    monkeypatch.setattr(ollama_models, "pull_model", failing)
    name = next(iter(CATALOG))
    status, text = _pull(server, {"model": name})
    assert status == 200 and text.splitlines()[-1] == f'{{"error":"{name}: no network"}}'
    assert _pull(server, {"model": name, "stream": False}) == (
        500, {"error": f"{name}: no network"})
    status, out = _pull(server, {"model": "llama3"})
    assert status == 404 and "not found in specd's catalog" in out["error"]
