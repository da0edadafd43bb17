"""A bigger engine behind the same address: llama-server (built from llama.cpp's source)
as the upstream of a live specd (`--upstream big=URL`, its token from a file), reached by
the official clients of three dialects; a down upstream is a 502 naming it, and the token
is in no log line and no answer."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import fetched_model

from specd.daemon.benchmark.llama_server import LlamaServer
from specd.daemon.cli.main import build_parser
from specd.daemon.cli.serve import upstreams
from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, free_port, live_server
from llama_cpp_oracle import missing

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.llama_cpp_oracle

TOKEN = "upstream-secret-4f1c9e"
MODEL = "smollm2-135m-instruct"  # a small chat model, fetched into the store
ASK = [{"role": "user", "content": "Name a colour."}]
N = 8


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def upstream() -> Iterator[LlamaServer]:
    if reason := missing("llama-server"):
        pytest.skip(reason)
    with LlamaServer(fetched_model(MODEL), threads=2, n_ctx=1024,
                     args=["--api-key", TOKEN, "-np", "1", "--no-warmup"]) as server:
        yield server


@pytest.fixture(scope="module")
def log() -> Iterator[_Records]:
    handler = _Records()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


@pytest.fixture(scope="module")
def server(upstream: LlamaServer, log: _Records, tiny_model_factory,
           tmp_path_factory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("upstream")
    token_file = tmp / "big.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    args = build_parser().parse_args([
        "serve", "--upstream", f"big={upstream.url}", "--upstream-token-file",
        f"big={token_file}", "--upstream", f"gone=http://127.0.0.1:{free_port()}"])
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server(cfg, tmp, upstreams=upstreams(args)) as srv:
        yield srv
    mp.undo()


@pytest.fixture(scope="module")
def expected(upstream: LlamaServer) -> str:
    """The upstream's own greedy answer to ASK."""
    req = urllib.request.Request(
        f"{upstream.url}/v1/chat/completions", data=json.dumps({
            "messages": ASK, "max_tokens": N, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        text = json.loads(r.read())["choices"][0]["message"]["content"]
    assert text
    return text


def _openai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "none",
                         max_retries=0)


def test_openai_chat_whole_and_streamed(server: LiveServer, expected: str) -> None:
    client = _openai(server)
    assert {"big", "gone"} <= {m.id for m in client.models.list()}
    r = client.chat.completions.create(model="big", messages=ASK, max_tokens=N,
                                       temperature=0)
    assert r.model == "big" and r.choices[0].message.content == expected
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= N
    chunks = list(client.chat.completions.create(
        model="big", messages=ASK, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected and len([c for c in chunks if c.choices]) > 2
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_ollama_client_chat(server: LiveServer, expected: str) -> None:
    client = ollama.Client(host=server.base_url,
                           headers={"Authorization": f"Bearer {server.token}"})
    assert "big:latest" in [m.model for m in client.list().models]
    options = {"num_predict": N, "temperature": 0}
    r = client.chat(model="big", messages=ASK, options=options)
    assert r.message.content == expected and r.prompt_eval_count > 0 and r.eval_count > 0
    parts = list(client.chat(model="big:latest", messages=ASK, options=options,
                             stream=True))
    assert "".join(p.message.content for p in parts) == expected and parts[-1].done


def test_openai_responses(server: LiveServer, expected: str) -> None:
    r = _openai(server).responses.create(model="big", input=ASK[0]["content"],
                                         max_output_tokens=N, temperature=0)
    assert r.output_text == expected and r.usage.input_tokens > 0
    assert r.usage.output_tokens > 0


def test_anthropic_messages_whole_and_streamed(server: LiveServer, expected: str) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=server.token or "none",
                                 max_retries=0)
    r = client.messages.create(model="big", messages=ASK, max_tokens=N,
                               extra_body={"temperature": 0})
    assert r.content[0].text == expected and r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= N
    with client.messages.stream(model="big", messages=ASK, max_tokens=N,
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected and final.usage.output_tokens == r.usage.output_tokens
    with pytest.raises(anthropic.BadRequestError, match="count_tokens is not supported"):
        client.messages.count_tokens(model="big", messages=ASK)


def test_refusals_and_a_down_upstream(server: LiveServer) -> None:
    status, body = server.request("POST", "/v1/chat/completions",
                                  {"model": "gone", "messages": ASK})
    assert status == 502 and "'gone' cannot be reached" in body["error"]["message"]
    status, body = server.request("POST", "/api/chat", {"model": "gone", "messages": ASK,
                                                        "stream": True})
    assert status == 502 and "'gone'" in body["error"]
    # what needs specd's own tokenizer or sampler: a 400 naming it
    status, body = server.request("POST", "/v1/completions", {"model": "big", "prompt": "x"})
    assert status == 400 and "upstream" in body["error"]["message"]
    status, body = server.request("POST", "/v1/chat/completions", {
        "model": "big", "messages": ASK, "logprobs": True})
    assert status == 400 and "logprobs is not supported" in body["error"]["message"]
    # the local model still answers its own names
    status, body = server.request("POST", "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 2})
    assert status == 200 and body["model"] != "big"


def test_token_in_no_log_and_no_answer(server: LiveServer, log: _Records) -> None:
    answers = [server.request("GET", path)[1] for path in ("/props", "/v1/models",
                                                            "/api/tags", "/metrics")]
    assert TOKEN not in json.dumps(answers)
    assert any("'gone' cannot be reached" in line for line in log.lines)
    assert not [line for line in log.lines if TOKEN in line]
