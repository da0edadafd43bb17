"""/v1/embeddings and /embeddings on a live server (tiny model): pooling, normalising,
input shapes and formats; the vector is the output-normed last hidden state."""

from __future__ import annotations

import base64
from dataclasses import replace

import numpy as np
import pytest

from specd.daemon.models.building import build_options
from specd.daemon.serving.engine import EngineConfig
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from live_server import LiveServer, live_server
from numpy_reference import read_gguf


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)


def _server(tiny_path, tmp_path_factory, **cfg):
    tmp = tmp_path_factory.mktemp("emb")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
    config = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=1,
                          embeddings=True, **cfg)
    with live_server(config, tmp) as srv:
        yield srv
    mp.undo()


@pytest.fixture(scope="module")
def last(tiny_path, tmp_path_factory):
    yield from _server(tiny_path, tmp_path_factory, pooling="last")


@pytest.fixture(scope="module")
def mean(tiny_path, tmp_path_factory):
    yield from _server(tiny_path, tmp_path_factory)


def _post(srv: LiveServer, path: str, body: dict) -> object:
    status, out = srv.request("POST", path, body)
    assert status == 200, out
    return out


def test_the_last_tokens_embedding_gives_the_models_logits(last, tiny_path) -> None:
    """Unnormalised, the last token's embedding is the output-normed hidden state the
    logits head multiplies: times the output matrix it gives the target's logits."""
    _, weights, _ = read_gguf(tiny_path)
    out_w = weights.get("output.weight", weights["token_embd.weight"])  # [vocab, E]
    tok = last.service.tokenizer
    ids = tok.encode("one two three")
    [item] = _post(last, "/embeddings", {"content": "one two three", "embd_normalize": -1})
    h = np.asarray(item["embedding"][0])  # [E]
    runner = ModelRunner(last.service.engine.target.built, n_ctx=512)  # the server's is busy
    logits = runner.prefill(0, ids)  # [vocab]
    # (the graph's output matrix multiplies int8-quantized activations: ~1% apart)
    assert np.linalg.norm(out_w @ h - logits) < 0.02 * np.linalg.norm(logits)
    assert int(np.argmax(out_w @ h)) == int(np.argmax(logits))


def test_openai_embeddings_shapes_inputs_and_formats(mean) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=mean.base_url + "/v1", api_key="unused")
    n_embd = mean.service.engine.target.built.hparams.n_embd
    texts = ["hello world", "one two three", "x"]
    out = client.embeddings.create(model="any", input=texts)
    vecs = np.array([d.embedding for d in out.data])  # [3, E]
    assert vecs.shape == (3, n_embd) and [d.index for d in out.data] == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    tok = mean.service.tokenizer
    assert out.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    # one at a time, as token ids, base64: the same vectors
    alone = client.embeddings.create(model="any", input=texts[1]).data[0].embedding
    np.testing.assert_allclose(alone, vecs[1], atol=1e-6)
    by_ids = client.embeddings.create(model="any", input=[tok.encode(texts[1])])
    np.testing.assert_allclose(by_ids.data[0].embedding, vecs[1], atol=1e-6)
    raw = _post(mean, "/v1/embeddings", {"input": texts[:2], "encoding_format": "base64"})
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
               for d in raw["data"]]
    np.testing.assert_allclose(decoded, vecs[:2], atol=1e-6)
    # llama.cpp's input shapes: ids with text among them, prompt_string, text parts
    mixed = _post(mean, "/v1/embeddings", {"input": [
        {"prompt_string": "hello world"},
        {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
        "hello world"]})
    got = [d["embedding"] for d in mixed["data"]]
    assert got[0] == got[1] == got[2]
    assert len(_post(mean, "/v1/embeddings", {"input": [12, 34, "x", 56]})["data"]) == 1
    assert len(_post(mean, "/v1/embeddings", {"input": ""})["data"]) == 1
    for bad in ([], {"content": "string"}, {"content": [{"type": "image_url"}]}, [[1, -2]],
                True):
        status, err = mean.request("POST", "/v1/embeddings", {"input": bad})
        assert status == 400 and err["error"]["param"] == "input", (bad, err)
    status, err = mean.request("POST", "/v1/embeddings", {"input": "x" * 3000})
    assert status == 400 and "too large" in err["error"]["message"]
    status, err = mean.request("POST", "/v1/embeddings", {"input": "x",
                                                          "encoding_format": "hex"})
    assert status == 400 and err["error"]["param"] == "encoding_format"


def test_llama_cpp_embeddings_and_pooling(mean, last) -> None:
    m = _post(mean, "/embeddings", {"content": "hello world"})
    k = _post(last, "/embedding", {"content": "hello world"})
    assert len(m) == 1 and len(m[0]["embedding"]) == 1  # one input, one pooled vector
    assert m[0]["embedding"] != k[0]["embedding"]  # mean is not the last token's
    scaled = _post(mean, "/embeddings", {"content": "hello world", "embd_normalize": 0})
    assert max(abs(x) for x in scaled[0]["embedding"][0]) == pytest.approx(32760, rel=1e-6)


def test_embeddings_leave_generation_as_it_was(mean) -> None:
    """An embedding takes a slot's KV; the slot's cache then holds its tokens, and a
    completion after it is the one before."""
    body = {"prompt": "one two", "n_predict": 8, "ignore_eos": True}
    before = _post(mean, "/completion", body)["content"]
    _post(mean, "/v1/embeddings", {"input": "one two three four"})
    after = _post(mean, "/completion", body)
    assert after["content"] == before and after["tokens_cached"] > 0


def test_embeddings_off_is_501(tiny_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=256, slots=1)
    with live_server(cfg, tmp_path) as srv:
        status, out = srv.request("POST", "/v1/embeddings", {"input": "x"})
        assert status == 501 and "--embeddings" in out["error"]["message"]


@pytest.fixture(scope="module")
def apart(tiny_path, tiny_model_factory, tmp_path_factory):
    """The tiny qwen2 target, embeddings from another model (llama, its own vocabulary)."""
    other = tiny_model_factory(arch="llama", weight_type="Q8_0", seed=9, context_length=1024)
    yield from _server(tiny_path, tmp_path_factory, embedding_model=str(other),
                       pooling="mean")


def test_a_separate_embedding_model_embeds_with_its_own_tokenizer(apart, tiny_model_factory
                                                                   ) -> None:
    """--embedding-model: the vectors are that model's (its width, its tokenizer), each
    the mean of its output-normed last hidden states as the model alone computes them;
    generation still answers from the target."""
    other = tiny_model_factory(arch="llama", weight_type="Q8_0", seed=9, context_length=1024)
    engine = apart.service.engine
    assert engine.embedder is not None and engine.embedder.own
    tok = engine.embedder.tokenizer
    out = _post(apart, "/v1/embeddings", {"input": ["one two three", "four"],
                                          "encoding_format": "float"})
    vectors = [np.asarray(d["embedding"]) for d in out["data"]]
    _, weights, _ = read_gguf(other)
    width = weights["token_embd.weight"].shape[1]
    assert [v.shape for v in vectors] == [(width,), (width,)]
    layer = engine.embedder.head.layer
    runner = ModelRunner(load_or_build(other, replace(build_options("target"),
                                                      hidden_layers=(layer,))), n_ctx=512)
    for text, got in zip(["one two three", "four"], vectors, strict=True):
        _, feats = runner.prefill_with_features(0, tok.encode(text, parse_special=True), 0,
                                                [layer])
        h = feats[layer].astype(np.float64)
        h = h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + engine.embedder.head.eps)
        want = (h * engine.embedder.head.norm).mean(axis=0)
        np.testing.assert_allclose(got, want / np.linalg.norm(want), rtol=1e-5, atol=1e-6)
    status, gen = apart.request("POST", "/completion", {"prompt": "one", "n_predict": 2})
    assert status == 200 and gen["tokens_predicted"] == 2
