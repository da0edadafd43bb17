"""Images on the model list, as llama-server's test_vision_api.py asks: a tiny
random-weight Gemma 3 VLM (tests/support/tiny_vlm.py) served by a real specd over
loopback HTTP, beside the same text model without its projector. /models and /v1/models
list llama-server's `models` with their capabilities (the official openai client still
lists `data`). Skipped without torch and transformers (to make the checkpoint) or
llama.cpp's source."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tiny_vlm

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server_in


@pytest.fixture(scope="module")
def vlm() -> tiny_vlm.TinyVlm:
    return tiny_vlm.tiny_vlm_or_skip("gemma3")


@pytest.fixture(scope="module")
def server(vlm: tiny_vlm.TinyVlm, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LiveServer]:
    """The VLM with its projector, embedding with the last token's state (whose product
    with the output matrix is the model's logits there)."""
    cfg = EngineConfig(target=str(vlm.text), mmproj=str(vlm.mmproj), spec_type="none",
                       n_ctx=512, fetch=False, embeddings=True, pooling="last")
    with live_server_in(tmp_path_factory, "vision-emb", cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def text_only(vlm: tiny_vlm.TinyVlm, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[LiveServer]:
    """The same text model without its projector."""
    cfg = EngineConfig(target=str(vlm.text), spec_type="none", n_ctx=512, fetch=False,
                       embeddings=True)
    with live_server_in(tmp_path_factory, "text-emb", cfg) as srv:
        yield srv


@pytest.mark.parametrize("path", ["/models", "/v1/models"])
def test_the_model_list_says_multimodal_where_a_projector_is_loaded(
        server: LiveServer, text_only: LiveServer, path: str) -> None:
    status, out = server.request("GET", path)
    assert status == 200, out
    [model] = out["models"]
    assert model["capabilities"] == ["completion", "multimodal"]
    assert model["name"] == out["data"][0]["id"]
    assert out["data"][0]["architecture"]["input_modalities"] == ["text", "image"]
    status, out = text_only.request("GET", path)
    assert status == 200 and out["models"][0]["capabilities"] == ["completion"], out
    assert out["data"][0]["architecture"]["input_modalities"] == ["text"]


def test_ollama_show_says_vision_where_a_projector_is_loaded(server: LiveServer,
                                                             text_only: LiveServer) -> None:
    status, out = server.request("POST", "/api/show", {"model": "specd"})
    assert status == 200 and "vision" in out["capabilities"], out
    status, out = text_only.request("POST", "/api/show", {"model": "specd"})
    assert status == 200 and "vision" not in out["capabilities"], out


def test_the_official_client_still_lists_the_models(server: LiveServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "x")
    models = client.models.list().data
    assert [m.id for m in models] == [server.service.engine.model_name]
    assert models[0].object == "model" and models[0].owned_by == "specd"
