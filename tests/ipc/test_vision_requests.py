"""Images end to end: a tiny random-weight Gemma 3 VLM (text model and mmproj, converted
by llama.cpp's own convert_hf_to_gguf.py: tests/support/tiny_vlm.py) served by a real
specd over loopback HTTP. Images go in as OpenAI image_url data URLs (the official
client), llama-server's multimodal_data, Anthropic image blocks, Ollama's images and
Responses' input_image parts; the engine encodes them with its vision encoder, the
prefix cache reuses the same image, bad images are a 400 and the daemon goes on serving,
and greedy output after an image is llama-server's (--mmproj) up to the first near tie.
Skipped without torch and transformers (to make the checkpoint) or llama.cpp's source."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
import tiny_vlm
from image_files import data_url, png
from PIL import Image

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.media import MEDIA_MARKER

from live_server import LiveServer, live_server_in
from llama_cpp_oracle import missing, mtmd_greedy

N_IMAGE = 4  # the tiny gemma3's tokens per image (mm_tokens_per_image)
BOI, EOI = 255999, 256000  # <start_of_image>, <end_of_image>
NEAR_TIE = 0.25  # top-two logit margin two implementations' rounding may flip


@pytest.fixture(scope="module")
def vlm() -> tiny_vlm.TinyVlm:
    return tiny_vlm.tiny_vlm_or_skip("gemma3")


@pytest.fixture(scope="module")
def server(vlm: tiny_vlm.TinyVlm, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LiveServer]:
    cfg = EngineConfig(target=str(vlm.text), mmproj=str(vlm.mmproj), spec_type="none",
                       n_ctx=512, fetch=False)
    with live_server_in(tmp_path_factory, "vision", cfg) as srv:
        yield srv


def _engine(server: LiveServer) -> Engine:
    return server.service.engine


def _chat(server: LiveServer, content: list[dict[str, Any]], **kw: Any) -> tuple[int, Any]:
    return server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": 8,
        "temperature": 0, **kw})


def test_the_engine_splits_the_prompt_at_the_marker(server: LiveServer) -> None:
    """BOS once, the text before the image, <start_of_image>, the image's rows,
    <end_of_image>, the text after it: mtmd's chunks for gemma3."""
    engine = _engine(server)
    tok = engine.tokenizer
    prompt, images = engine.image_prompt(f"look: {MEDIA_MARKER} what?", [png()])
    before, after = tok.encode("look: ", add_bos=True), tok.encode(" what?", add_bos=False)
    assert prompt[:len(before)] == before and prompt[-len(after):] == after
    (im,) = images
    assert im.start == len(before) + 1 and im.chunk.n_tokens == N_IMAGE
    assert prompt[im.start - 1] == BOI and prompt[im.end] == EOI
    assert im.embeddings.shape == (N_IMAGE, engine.target.built.hparams.n_embd)


def test_the_official_openai_client_sends_an_image(server: LiveServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "x")
    r = client.chat.completions.create(model="specd", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": [
                                           {"type": "text", "text": "What is this?"},
                                           {"type": "image_url",
                                            "image_url": {"url": data_url(png(seed=7))}}]}])
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.prompt_tokens > N_IMAGE + 2


def test_a_follow_up_about_the_same_image_reuses_it(server: LiveServer) -> None:
    """The second question about the same screenshot reuses the image's KV (cached
    tokens past it) and is not encoded again; another image is."""
    image = {"type": "image_url", "image_url": {"url": data_url(png(seed=11))}}
    prompter = _engine(server).images
    assert prompter is not None
    status, first = _chat(server, [image, {"type": "text", "text": "What is it?"}])
    assert status == 200, first
    encoded = prompter.encoded
    status, follow = _chat(server, [image, {"type": "text", "text": "What colour?"}])
    assert status == 200, follow
    assert prompter.encoded == encoded
    cached = follow["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= N_IMAGE + 2, follow["usage"]
    other = {"type": "image_url", "image_url": {"url": data_url(png(seed=12))}}
    status, third = _chat(server, [other, {"type": "text", "text": "What colour?"}])
    assert status == 200 and prompter.encoded == encoded + 1
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] < cached


def _bomb() -> bytes:
    """A PNG whose header says 60000 x 60000 pixels (a decompression bomb: its data is
    a few bytes)."""
    buf = io.BytesIO()
    Image.new("L", (60000, 60000)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name, data, says", [
    ("truncated", png()[:200], "truncated"),
    ("bomb", None, "pixels"),
    ("wrong type", b"GIF89a" + bytes(64), "image"),
    ("text", b"hello, not an image", "not an image"),
])
def test_bad_images_are_refused_and_the_daemon_goes_on(server: LiveServer, name: str,
                                                       data: bytes | None, says: str) -> None:
    data = _bomb() if data is None else data
    status, body = _chat(server, [{"type": "text", "text": "What is this?"},
                                  {"type": "image_url", "image_url": {"url": data_url(data)}}])
    assert status == 400, body
    assert says in body["error"]["message"], body
    status, body = _chat(server, [{"type": "text", "text": "still there?"},
                                  {"type": "image_url", "image_url": {"url": data_url(png())}}])
    assert status == 200, body


def test_remote_image_urls_are_refused(server: LiveServer) -> None:
    status, body = _chat(server, [{"type": "image_url",
                                   "image_url": {"url": "https://example.com/cat.png"}}])
    assert status == 400 and "data URL" in body["error"]["message"]


@pytest.mark.llama_cpp_oracle
def test_greedy_after_an_image_is_llama_servers(server: LiveServer, vlm: tiny_vlm.TinyVlm
                                                ) -> None:
    """The same prompt string and image on /completion (llama-server's multimodal_data):
    specd's greedy tokens are llama-server's (--mmproj), parting (if at all) only where
    llama-server's top two are within NEAR_TIE."""
    if why := missing("llama-server"):
        pytest.skip(why)

    image = png(120, 80, seed=3)
    prompt = f"Describe {MEDIA_MARKER} in words:"
    n = 24
    theirs, margins = mtmd_greedy(vlm.text, vlm.mmproj, prompt, [image], n)
    status, ours = server.request("POST", "/completion", {
        "prompt": {"prompt_string": prompt,
                   "multimodal_data": [base64.b64encode(image).decode()]},
        "n_predict": n, "temperature": 0, "ignore_eos": True, "return_tokens": True,
        "cache_prompt": False})
    assert status == 200, ours
    # the random model's top two are often close: the texts may part only at a near tie
    got = ours["tokens"]
    parted = next((i for i, (a, b) in enumerate(zip(got, theirs, strict=True)) if a != b), n)
    assert parted == n or margins[parted] < NEAR_TIE, (parted, margins, got, theirs)
    assert parted >= 8, (parted, got, theirs)


def test_every_dialect_takes_an_image(server: LiveServer) -> None:
    """The same image through Anthropic's base64 block, Ollama's images (chat and
    generate), Responses' input_image and /completion's multimodal_data: each answers,
    counting the image's tokens; /props says vision."""
    data = png(seed=21)
    b64 = base64.b64encode(data).decode()
    status, out = server.request("POST", "/v1/messages", {
        "model": "specd", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64}},
            {"type": "text", "text": "What is this?"}]}]})
    assert status == 200 and out["usage"]["input_tokens"] > N_IMAGE + 2, out
    status, out = server.request("POST", "/v1/messages", {
        "model": "specd", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x.org/a.png"}}]}]})
    assert status == 400 and "data URL" in out["error"]["message"], out
    for path, body in (("/api/chat", {"messages": [
            {"role": "user", "content": "What is this?", "images": [b64]}]}),
            ("/api/generate", {"prompt": "What is this?", "images": [b64]}),
            ("/api/generate", {"prompt": "What is this?", "images": [b64], "raw": True})):
        status, out = server.request("POST", path, {"model": "specd", "stream": False,
                                                    "options": {"num_predict": 4}, **body})
        assert status == 200 and out["prompt_eval_count"] > N_IMAGE + 2, (path, out)
    status, out = server.request("POST", "/v1/responses", {
        "model": "specd", "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": data_url(data)}]}]})
    assert status == 200 and out["usage"]["input_tokens"] > N_IMAGE + 2, out
    status, out = server.request("POST", "/completion", {
        "prompt": {"prompt_string": f"What is this: {MEDIA_MARKER}\n",
                   "multimodal_data": [b64]}, "n_predict": 4})
    assert status == 200 and out["tokens_evaluated"] > N_IMAGE + 2, out
    assert MEDIA_MARKER in out["prompt"]
    status, props = server.request("GET", "/props")
    assert status == 200 and props["modalities"]["vision"] is True


@pytest.mark.parametrize("prompt, files, says", [
    (f"What is this: {MEDIA_MARKER}\n", ["malformed"], "base64"),
    ("What is this:\n", [""], "empty"),
    ("What is this:\n", [base64.b64encode(png()).decode()], "media markers"),
    (f"{MEDIA_MARKER}{MEDIA_MARKER}", [base64.b64encode(png()).decode()], "media markers"),
    (f"What is this: {MEDIA_MARKER}\n", [base64.b64encode(b"<html>").decode()],
     "not an image"),
])
def test_multimodal_data_errors_are_400s(server: LiveServer, prompt: str, files: list[str],
                                         says: str) -> None:
    """llama-server's test_vision_completion error cases (malformed data, an empty
    string, markers that do not match the files, data that is not an image)."""
    status, out = server.request("POST", "/completion", {
        "prompt": {"prompt_string": prompt, "multimodal_data": files}, "n_predict": 2})
    assert status == 400 and says in out["error"]["message"], out


@pytest.mark.parametrize("spec_type, draft", [("ngram", False), ("draft", True)])
def test_speculation_after_an_image_is_the_targets(vlm: tiny_vlm.TinyVlm, spec_type: str,
                                                   draft: bool) -> None:
    """Greedy output of an image prompt through the engine is byte-identical with and
    without prompt lookup and with a draft model (the text model itself, without
    vision: it gets the text around the image), and rounds were drafted."""
    from specd.daemon.spec.drafter import DraftParams
    from specd.daemon.spec.generation import GenerationParams

    from speculation_checks import assert_drafted, decode_all

    def run(spec: str, md: str | None) -> tuple[list[int], Any]:
        engine = Engine(EngineConfig(target=str(vlm.text), mmproj=str(vlm.mmproj),
                                     spec_type=spec, draft=md, n_ctx=512, fetch=False))
        text = "Say it again and again: red blue red blue red blue " + MEDIA_MARKER
        prompt, images = engine.image_prompt(text * 2, [png(seed=5), png(seed=6)])
        gen = engine.start(0, prompt, GenerationParams(max_tokens=48, ignore_eos=True,
                                                       draft=DraftParams(n_max=3),
                                                       adaptive=False),
                           images=images)
        return decode_all(gen), gen.stats

    want, _ = run("none", None)
    got, stats = run(spec_type, str(vlm.text) if draft else None)
    assert got == want
    assert_drafted(stats)


def test_chat_input_tokens_count_the_image(server: LiveServer) -> None:
    """llama-server's test_vision_chat_completion_token_count with a data URL: the
    count is the image prompt's, the image's tokens and its begin and end among them."""
    image = png(seed=41)
    content = [{"type": "text", "text": "What is this:"},
               {"type": "image_url", "image_url": {"url": data_url(image)}}]
    status, out = server.request("POST", "/chat/completions/input_tokens",
                                 {"messages": [{"role": "user", "content": content}]})
    assert status == 200, out
    engine = _engine(server)
    rendered = engine.render_chat([{"role": "user", "content": f"What is this:{MEDIA_MARKER}"}])
    prompt, _ = engine.image_prompt(rendered, [image])
    assert out["input_tokens"] == len(prompt) > N_IMAGE + 2


def test_an_image_request_joins_the_history(vlm: tiny_vlm.TinyVlm,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """With history on (specd serve's default), a finished request holding an image
    joins its caller's history (the image as a separator) and ends; the next is served."""
    cfg = EngineConfig(target=str(vlm.text), mmproj=str(vlm.mmproj), spec_type="none",
                       n_ctx=512, fetch=False, history=True)
    body = {"prompt": {"prompt_string": f"What is this: {MEDIA_MARKER}\n",
                       "multimodal_data": [base64.b64encode(png(seed=42)).decode()]},
            "n_predict": 4}
    with live_server_in(tmp_path_factory, "vision-history", cfg) as srv:
        status, out = srv.request("POST", "/completion", body)
        assert status == 200, out
        assert srv.service.engine.history.n_tokens >= out["tokens_evaluated"] - N_IMAGE
        status, out = srv.request("POST", "/completion", body)
        assert status == 200, out
