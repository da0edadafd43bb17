"""Images on the model list and on embeddings, as llama-server's test_vision_api.py asks:
a tiny random-weight Gemma 3 VLM (tests/support/tiny_vlm.py) served by a real specd
over loopback HTTP with --embeddings, beside the same text model without its projector.
/models and /v1/models list llama-server's `models` with their capabilities (the
official openai client still lists `data`); /embeddings takes {prompt_string,
multimodal_data} and /v1/embeddings OpenAI image_url parts (the official client), the
image encoded by the vision encoder and its rows run through the text model. Skipped
without torch and transformers (to make the checkpoint) or llama.cpp's source."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tiny_vlm
from image_files import data_url, png

from specd.daemon.serving.engine import EngineConfig
from specd.daemon.spec.media import MEDIA_MARKER

from live_server import LiveServer, live_server_in
from numpy_reference import read_gguf

PROMPT = f"What is this: {MEDIA_MARKER}\n"  # llama-server's test prompt


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


@pytest.fixture(scope="module")
def apart(vlm: tiny_vlm.TinyVlm, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LiveServer]:
    """The VLM with its projector, embedding with a model of its own (the same text
    model, which takes no images)."""
    cfg = EngineConfig(target=str(vlm.text), mmproj=str(vlm.mmproj), spec_type="none",
                       n_ctx=512, fetch=False, embeddings=True,
                       embedding_model=str(vlm.text))
    with live_server_in(tmp_path_factory, "apart-emb", cfg) as srv:
        yield srv


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _embed(server: LiveServer, content: Any, **kw: Any) -> list[np.ndarray]:
    status, out = server.request("POST", "/embeddings", {"content": content, **kw})
    assert status == 200, out
    return [np.asarray(item["embedding"][0]) for item in out]


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


def test_an_image_embedding_is_stable_and_tells_images_apart(server: LiveServer) -> None:
    """llama-server's test_vision_embeddings: the same image gives the same vector, the
    text without it another; another image another again. Each new image runs the
    vision encoder once."""
    prompter = server.service.engine.images
    one, two = _b64(png(seed=31)), _b64(png(seed=32))
    a, b, text, other = _embed(server, [
        {"prompt_string": PROMPT, "multimodal_data": [one]},
        {"prompt_string": PROMPT, "multimodal_data": [one]},
        {"prompt_string": PROMPT},
        {"prompt_string": PROMPT, "multimodal_data": [two]}])
    assert np.array_equal(a, b)
    assert not np.allclose(a, text) and not np.allclose(a, other)
    assert prompter is not None
    encoded = prompter.encoded
    [again] = _embed(server, [{"prompt_string": PROMPT, "multimodal_data": [one]}])
    assert np.array_equal(again, a) and prompter.encoded == encoded
    _embed(server, [{"prompt_string": PROMPT, "multimodal_data": [_b64(png(seed=33))]}])
    assert prompter.encoded == encoded + 1


def test_the_image_rows_go_through_the_text_model(server: LiveServer,
                                                  vlm: tiny_vlm.TinyVlm) -> None:
    """The last token's unnormalised embedding after an image, times the output matrix,
    gives the log-probabilities of /completion's first step after the same image (its
    top five): the image's rows reached the text model as a completion's prefill runs
    them. The completion reuses the slot's KV the embedding left (the same rows), and
    a fresh prefill of it gives the same."""
    _, weights, _ = read_gguf(vlm.text)
    out_w = weights.get("output.weight", weights["token_embd.weight"])  # [vocab, E]
    image = _b64(png(seed=34))
    prompt = {"prompt_string": f"Describe {MEDIA_MARKER} now:", "multimodal_data": [image]}
    [emb] = _embed(server, [prompt], embd_normalize=-1)  # [E]
    logits = out_w @ emb  # [vocab]
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "n_probs": 5}
    status, out = server.request("POST", "/completion", body)
    assert status == 200, out
    assert out["tokens_cached"] == out["tokens_evaluated"] - 1, out  # all but the last
    top = out["completion_probabilities"][0]["top_logprobs"]
    status, fresh = server.request("POST", "/completion", {**body, "cache_prompt": False})
    assert status == 200 and fresh["completion_probabilities"][0]["top_logprobs"] == top
    ours = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())  # [vocab]
    assert list(np.argsort(-ours)[:5]) == [t["id"] for t in top]
    np.testing.assert_allclose(ours[[t["id"] for t in top]], [t["logprob"] for t in top],
                               atol=1e-3)
    [no_image] = _embed(server, [{"prompt_string": "Describe  now:"}], embd_normalize=-1)
    assert not np.allclose(no_image, emb)


def test_the_official_client_embeds_image_url_parts(server: LiveServer) -> None:
    """llama-server's test_vision_embeddings_oai_content through the openai client: an
    input's content parts (text, image_url, text) are the same prompt as prompt_string
    with multimodal_data; the text alone is another."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "x")
    image = png(seed=35)
    inputs: Any = [
        {"content": [{"type": "text", "text": "What is this: "},
                     {"type": "image_url", "image_url": {"url": data_url(image)}},
                     {"type": "text", "text": "\n"}]},
        {"prompt_string": PROMPT, "multimodal_data": [_b64(image)]},
        "What is this: \n"]
    out = client.embeddings.create(model="specd", input=inputs)
    vectors = [np.asarray(d.embedding) for d in out.data]
    assert len(vectors) == 3 and np.array_equal(vectors[0], vectors[1])
    assert not np.allclose(vectors[0], vectors[2])
    assert out.usage.prompt_tokens > 3 * 4  # the images' rows are counted


@pytest.mark.parametrize("prompt, files, says", [
    (PROMPT, ["malformed"], "base64"),
    ("What is this:\n", ["base64"], "base64"),
    ("What is this:\n", [_b64(png())], "media markers"),
    (PROMPT, [_b64(b"<html>")], "not an image"),
])
def test_bad_image_inputs_are_400s(server: LiveServer, prompt: str, files: list[str],
                                   says: str) -> None:
    status, out = server.request("POST", "/embeddings", {
        "content": [{"prompt_string": prompt, "multimodal_data": files}]})
    assert status == 400 and says in out["error"]["message"], out
    status, out = server.request("POST", "/v1/embeddings", {"input": [{"content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]})
    assert status == 400 and "data URL" in out["error"]["message"], out


def test_a_model_without_a_projector_refuses_images(text_only: LiveServer) -> None:
    for path, body in (
            ("/embeddings", {"content": [{"prompt_string": PROMPT,
                                          "multimodal_data": [_b64(png())]}]}),
            ("/v1/embeddings", {"input": [{"content": [
                {"type": "image_url", "image_url": {"url": data_url(png())}}]}]})):
        status, out = text_only.request("POST", path, body)
        assert status == 400 and "--mmproj" in out["error"]["message"], (path, out)


def test_an_embedding_model_of_its_own_refuses_images(apart: LiveServer) -> None:
    status, out = apart.request("POST", "/embeddings", {"content": [
        {"prompt_string": PROMPT, "multimodal_data": [_b64(png())]}]})
    assert status == 400 and "--embedding-model" in out["error"]["message"], out
    status, out = apart.request("POST", "/embeddings", {"content": "What is this?"})
    assert status == 200, out
