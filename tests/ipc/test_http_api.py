"""The real daemon on loopback and a Unix socket, with a tiny model."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import socket
import threading
import time

import pytest

from specd.daemon.serving.engine import EngineConfig
from specd.ipc.client import AsyncClient, Client, DaemonError

from live_server import live_server


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("srv")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=4)
    with live_server(cfg, tmp) as srv:
        yield srv
    mp.undo()


def _alone(tiny_path, tmp_path, prompt: str, n: int) -> str:
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        status, body = srv.request("POST", "/completion",
                                   {"prompt": prompt, "n_predict": n, "ignore_eos": True})
        assert status == 200
        return body["content"]


def test_health_models_props_slots_metrics(server) -> None:
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    status, models = server.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["object"] == "model"
    status, props = server.request("GET", "/props")
    assert props["spec_type"] == "ngram" and props["total_slots"] == 4 and props["n_ctx"] == 512
    status, slots = server.request("GET", "/slots")
    assert [s["state"] for s in slots] == ["idle"] * 4
    status, text = server.request("GET", "/metrics")
    assert status == 200 and "specd_requests_total" in text and "specd_queue_length" in text


def test_completion_and_timings(server) -> None:
    status, body = server.request("POST", "/completion",
                                  {"prompt": "hello world", "n_predict": 12, "ignore_eos": True})
    assert status == 200, body
    assert body["tokens_predicted"] == 12 and body["stop"] is True
    t = body["timings"]
    assert {"draft_n", "draft_n_accepted", "predicted_per_second"} <= set(t)
    for adaptive in (True, False):  # per request: the controller, or n_max every round
        status, other = server.request("POST", "/completion", {
            "prompt": "hello world", "n_predict": 12, "ignore_eos": True,
            "speculative": {"n_max": 4, "adaptive": adaptive}})
        assert status == 200 and other["content"] == body["content"], other


def test_openai_client_chat_and_completions(server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model=server.service.engine.target.name, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 10
    comp = client.completions.create(model="specd", prompt="hello", max_tokens=8, seed=1,
                                     temperature=0.7)
    assert comp.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(
        model="specd", max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "hi"}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # any name, or "" (llama.vim), is the loaded model, as llama-server serves it
    for name in ("gpt-3.5-turbo", ""):
        other = client.completions.create(model=name, prompt="x", max_tokens=2)
        assert other.model == server.service.engine.target.name
    # what the client asks for and specd does not do is a 400 naming it, not ignored
    with pytest.raises(openai.BadRequestError, match="'echo' is not supported"):
        client.completions.create(model="specd", prompt="x", max_tokens=2, echo=True)
    # OpenAI's usage chunk: last, with no choices, when asked for
    chunks = list(client.chat.completions.create(
        model="specd", max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 4
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # once only: LangChain adds up every usage it sees
    assert [c.usage is not None for c in chunks].count(True) == 1
    chunks = list(client.completions.create(model="specd", prompt="x", max_tokens=4,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and [c.usage is not None for c in chunks].count(True) == 1
    # OpenAI's finish reasons only; specd's own reason beside them
    out = client.completions.create(model="specd", prompt="x", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].model_extra["finish_detail"] == "length"
    # llguidance's lexer gives up on this regex at the first token: a grammar dead end
    out = client.completions.create(model="specd", prompt="x", max_tokens=4,
                                    extra_body={"regex": "(a{1000}){1000}"})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["finish_detail"] == "grammar_dead_end"
    served = server.service.engine.target.name
    assert client.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_logprobs_of_every_token_streamed_or_not(server) -> None:
    """OpenAI's logprobs / top_logprobs (chat), logprobs: k (completions) and llama.cpp's
    n_probs, for each generated token, from the target's logits: greedy picks the most
    likely token, so its logprob is the first of the top ones; streamed as returned."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    ask = {"model": "specd", "max_tokens": 8, "temperature": 0, "logprobs": True,
           "top_logprobs": 3, "messages": [{"role": "user", "content": "one two one two"}],
           "extra_body": {"ignore_eos": True}}
    out = client.chat.completions.create(**ask)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for t in content:
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True) and len(t.top_logprobs) == 3
        assert t.logprob == t.top_logprobs[0].logprob <= 0
        assert sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1 + 1e-9
        assert bytes(t.bytes).decode("utf-8", "ignore") == t.token
    chunks = list(client.chat.completions.create(stream=True, **ask))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs'"):
        client.chat.completions.create(**{**ask, "logprobs": False})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**{**ask, "top_logprobs": 21})
    # the completions API's own shape
    comp = client.completions.create(model="specd", prompt="one two", max_tokens=6, logprobs=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    # llama.cpp's n_probs: completion_probabilities, one token per streamed event
    body = {"prompt": "one two", "n_predict": 6, "n_probs": 4, "ignore_eos": True,
            "temperature": 0}
    c = Client(port=server.port)
    whole = c.post("/completion", body)["completion_probabilities"]
    assert len(whole) == 6 and all(len(t["top_logprobs"]) == 4 for t in whole)
    assert all(t["id"] == t["top_logprobs"][0]["id"] for t in whole)
    events = list(c.stream("/completion", body))
    assert all(len(e["completion_probabilities"]) == 1 for e in events if not e["stop"])
    assert [e["completion_probabilities"][0] for e in events if not e["stop"]] == whole
    assert "".join(e["content"] for e in events) == c.post("/completion", body)["content"]


def test_post_sampling_probs_are_the_sampled_distribution(server) -> None:
    """post_sampling_probs: each token's `prob` and `top_probs` are the distribution it
    was drawn from: with top_k 3, the model's three most likely renormalised (seeded, the
    same tokens as without post_sampling_probs); greedy, the one token with 1.0; under a
    grammar, allowed tokens only."""
    c = Client(port=server.port)
    body = {"prompt": "one two", "n_predict": 8, "n_probs": 5, "ignore_eos": True,
            "temperature": 1.0, "top_k": 3, "seed": 11}
    pre = c.post("/completion", body)
    post = c.post("/completion", {**body, "post_sampling_probs": True})
    assert post["content"] == pre["content"]
    assert post["generation_settings"]["post_sampling_probs"] is True
    for a, b in zip(pre["completion_probabilities"], post["completion_probabilities"],
                    strict=True):
        assert "logprob" not in b and "top_logprobs" not in b and b["id"] == a["id"]
        top3 = a["top_logprobs"][:3]
        total = sum(math.exp(x["logprob"]) for x in top3)
        assert [x["id"] for x in b["top_probs"]] == [x["id"] for x in top3]
        for x, y in zip(top3, b["top_probs"], strict=True):
            assert y["prob"] == pytest.approx(math.exp(x["logprob"]) / total, rel=1e-6)
            assert set(y) == {"id", "token", "bytes", "prob"}
        assert b["prob"] == next(y["prob"] for y in b["top_probs"] if y["id"] == b["id"])
        assert sum(y["prob"] for y in b["top_probs"]) == pytest.approx(1.0)
    events = list(c.stream("/completion", {**body, "post_sampling_probs": True,
                                           "stream": True}))
    assert [e["completion_probabilities"][0] for e in events if not e["stop"]] == \
        post["completion_probabilities"]
    greedy = c.post("/completion", {**body, "temperature": 0, "post_sampling_probs": True})
    assert all(t["prob"] == 1.0 and [x["id"] for x in t["top_probs"]] == [t["id"]]
               for t in greedy["completion_probabilities"])
    ab = c.post("/completion", {**body, "top_k": 0, "regex": "[ab ]{8}",
                                "post_sampling_probs": True})
    for t in ab["completion_probabilities"]:
        assert 0 < t["prob"] <= 1 and all(set(x["token"]) <= set("ab ")
                                          for x in t["top_probs"])


def test_post_sampling_probs_on_the_openai_routes(server) -> None:
    """With post_sampling_probs the OpenAI routes answer as llama-server does: each choice's
    `logprobs.content` holds llama.cpp's entries with `prob` and `top_probs`, the same as
    /completion's for the same prompt and seed; streamed chunks carry them too."""
    c = Client(port=server.port)
    settings = {"temperature": 1.0, "top_k": 3, "seed": 11, "ignore_eos": True,
                "post_sampling_probs": True}
    want = c.post("/completion", {"prompt": "one two", "n_predict": 6, "n_probs": 3,
                                  **settings})["completion_probabilities"]
    comp = c.post("/v1/completions", {"prompt": "one two", "max_tokens": 6, "logprobs": 3,
                                      **settings})
    assert comp["choices"][0]["logprobs"] == {"content": want}
    chat = {"messages": [{"role": "user", "content": "one two"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 3, **settings}
    out = c.post("/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    assert len(out) == 6 and all(set(t) == {"id", "token", "bytes", "prob", "top_probs"}
                                 for t in out)
    assert all(sum(x["prob"] for x in t["top_probs"]) == pytest.approx(1.0) for t in out)
    events = list(c.stream("/v1/chat/completions", {**chat, "stream": True}))
    streamed = [t for e in events if e.get("choices") and e["choices"][0].get("logprobs")
                for t in e["choices"][0]["logprobs"]["content"]]
    assert streamed == out
    plain = c.post("/v1/chat/completions", {**chat, "post_sampling_probs": False})
    assert "logprob" in plain["choices"][0]["logprobs"]["content"][0]


def test_n_choices_each_as_its_own_seed_gives_it(server) -> None:
    """n > 1: choice i is what one request seeded seed + i generates; streamed, the
    choices interleave by index; the usage counts the prompt once."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    ask = {"model": "", "max_tokens": 10, "temperature": 1.0,
           "messages": [{"role": "user", "content": "one two"}],
           "extra_body": {"ignore_eos": True}}
    out = client.chat.completions.create(n=3, seed=40, **ask)
    texts = [c.message.content for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) > 1
    alone = [client.chat.completions.create(seed=40 + i, **ask) for i in range(3)]
    assert texts == [a.choices[0].message.content for a in alone]
    assert out.usage.completion_tokens == 30
    assert out.usage.prompt_tokens == alone[0].usage.prompt_tokens
    chunks = list(client.chat.completions.create(n=2, seed=40, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **ask))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks
                        if c.choices and c.choices[0].index == i) for i in range(2)]
    assert streamed == texts[:2]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 20
    comp = client.completions.create(model="", prompt="one two", n=2, max_tokens=4, seed=1,
                                     temperature=1.0)
    assert [c.index for c in comp.choices] == [0, 1]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# the reply a Hermes-format model gives, forced by a grammar (the tiny model cannot choose it)
TOOL_REPLY = ('start: "Checking.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", '
              '\\"arguments\\": {\\"city\\": \\"Paris\\"}}\\n</tool_call>"')


def test_openai_client_gets_tool_calls(server) -> None:
    """A reply's <tool_call> blocks come back as message.tool_calls (finish_reason
    tool_calls), whole or streamed, as the official client reads them."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    ask = {"model": "specd", "max_tokens": 200, "temperature": 0, "tools": TOOLS,
           "messages": [{"role": "user", "content": "Weather in Paris?"}],
           "extra_body": {"grammar": TOOL_REPLY}}
    out = client.chat.completions.create(**ask)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls
            ] == [("function", "get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(stream=True, **ask))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert text.strip() == "Checking."
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call answered: the conversation goes on through the template
    follow = client.chat.completions.create(
        model="specd", max_tokens=4, tools=TOOLS, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [msg.tool_calls[0].model_dump()]},
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(**{**ask, "tool_choice": "none"})
    assert plain.choices[0].message.tool_calls is None  # not parsed: the text as it came
    assert "<tool_call>" in plain.choices[0].message.content
    # tool_choice required / a named function: a grammar makes the reply calls
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    forced = {"model": "specd", "max_tokens": 120, "temperature": 0,
              "messages": [{"role": "user", "content": "What time is it?"}]}
    for tools, choice in (([time_tool], "required"),
                          (TOOLS + [time_tool], {"type": "function",
                                                 "function": {"name": "get_time"}})):
        out = client.chat.completions.create(tools=tools, tool_choice=choice, **forced)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls][0] == (
            "get_time", {})
    for tools, choice, match in ((TOOLS, {"type": "function", "function": {"name": "nope"}},
                                  "not among the tools"),
                                 (None, "required", "needs 'tools'"),
                                 (TOOLS, {"type": "function", "function": {"name": {}}},
                                  "must be"),
                                 (TOOLS, "always", "must be")):
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(tool_choice=choice, **forced,
                                           **({"tools": tools} if tools else {}))
    with pytest.raises(openai.BadRequestError, match="combined"):
        client.chat.completions.create(**{**ask, "tool_choice": "required"})


def test_strict_model_name_keeps_the_404(tiny_path, tmp_path, monkeypatch) -> None:
    openai = pytest.importorskip("openai")
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=256, slots=1)
    with live_server(cfg, tmp_path, strict_model_name=True) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
        with pytest.raises(openai.NotFoundError, match="unknown model"):  # as OpenAI answers
            client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
        served = srv.service.engine.target.name
        assert client.completions.create(model=served, prompt="x", max_tokens=2).model == served


def test_unix_socket_sync_and_async_clients(server) -> None:
    c = Client(server.socket_path)
    assert c.health()
    out = c.post("/completion", {"prompt": "abc", "n_predict": 5, "ignore_eos": True})
    assert out["tokens_predicted"] == 5
    pieces = list(c.stream("/completion", {"prompt": "abc", "n_predict": 5,
                                           "ignore_eos": True}))
    assert pieces[-1]["stop"] is True
    assert "".join(p["content"] for p in pieces[:-1]) == out["content"]

    async def go() -> dict:
        async with AsyncClient(server.socket_path) as ac:
            return await ac.post("/tokenize", {"content": "hello world"})

    toks = asyncio.run(go())["tokens"]
    assert c.post("/detokenize", {"tokens": toks})["content"] == "hello world"
    assert server.socket_path.stat().st_mode & 0o777 == 0o600


def test_tokenize_pieces_and_special_parsing(server) -> None:
    c = Client(port=server.port)
    text = "日<|im_start|>"
    pieces = [p["piece"] for p in c.post("/tokenize", {"content": text, "with_pieces": True})
              ["tokens"]]
    # a piece that is part of a character comes back as its bytes, as llama.cpp gives them
    assert any(isinstance(p, list) for p in pieces), pieces
    assert b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces) == (
        text.encode())
    special = c.post("/tokenize", {"content": "<|im_start|>"})["tokens"]
    assert len(special) == 1
    plain = c.post("/tokenize", {"content": "<|im_start|>", "parse_special": False})["tokens"]
    assert special[0] not in plain
    assert c.post("/tokenize", {"content": "a\ud800"})["tokens"] == c.post(
        "/tokenize", {"content": "a\ufffd"})["tokens"]  # a lone surrogate: U+FFFD, no 500
    # add_special: the start the vocabulary adds (this one adds no BOS), as llama.cpp's:
    # the very prompt a completion of the text evaluates
    tok = server.service.tokenizer
    with_special = c.post("/tokenize", {"content": "hello", "add_special": True})["tokens"]
    assert with_special == tok.encode("hello") == c.post("/tokenize", {"content": "hello"})[
        "tokens"] and tok.bos_id not in with_special


def test_control_tokens_add_no_text(server) -> None:
    """A reply holding a control token (forced by a grammar here) streams and returns
    without its text, as llama.cpp's server does; the tokens still count."""
    c = Client(port=server.port)
    body = {"prompt": "x", "n_predict": 8, "grammar": 'start: "a" <|im_start|> "b"'}
    out = c.post("/completion", body)
    assert out["content"] == "ab" and out["tokens_predicted"] >= 3, out
    pieces = list(c.stream("/completion", body))
    assert "".join(p["content"] for p in pieces) == "ab"


def test_eight_concurrent_streams_equal_their_solo_runs(server, tiny_path, tmp_path) -> None:
    prompts = [f"prompt number {i} says" + " word" * i for i in range(8)]
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        c = Client(port=server.port)
        pieces = list(c.stream("/completion", {"prompt": prompts[i], "n_predict": 16,
                                               "ignore_eos": True}))
        results[i] = "".join(p["content"] for p in pieces)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8
    for i in (0, 3, 7):
        assert results[i] == _alone(tiny_path, tmp_path / f"a{i}", prompts[i], 16)


def test_disconnect_mid_stream_frees_the_slot(server) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "go on", "n_predict": 480, "ignore_eos": True,
                       "stream": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    got = b""
    while b"data:" not in got:  # headers, then the first streamed chunk
        got += sock.recv(4096)
    busy = [s for s in server.request("GET", "/slots")[1] if s["state"] != "idle"]
    assert busy
    other = Client(port=server.port).post("/completion", {"prompt": "x", "n_predict": 4,
                                                          "ignore_eos": True})
    sock.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        if all(s["state"] == "idle" for s in server.request("GET", "/slots")[1]):
            break
        time.sleep(0.05)
    slots = server.request("GET", "/slots")[1]
    assert all(s["state"] == "idle" for s in slots), slots
    assert all(s["n_generated"] == 0 for s in slots)
    assert other["tokens_predicted"] == 4


@pytest.mark.parametrize("kind", ["bad_json", "wrong_type", "huge_prompt", "unknown_route",
                                  "wrong_method", "bad_host", "foreign_origin", "not_object",
                                  "bad_tokens", "n_two", "bad_adaptive", "empty_prompt",
                                  "huge_number", "deep_json", "nameless_tool"])
def test_bad_requests_get_4xx_and_server_survives(server, kind) -> None:
    req = {
        "bad_json": ("POST", "/v1/completions", None, {}, b"{not json", 400, "malformed JSON"),
        "wrong_type": ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, {},
                       None, 400, "'max_tokens' must be an integer"),
        "huge_prompt": ("POST", "/v1/completions", {"prompt": list(range(3, 340)) * 3}, {},
                        None, 400, "at most 511 prompt tokens fit"),
        "unknown_route": ("GET", "/v2/nothing", None, {}, None, 404, "no route"),
        "wrong_method": ("GET", "/v1/completions", None, {}, None, 405, "not allowed"),
        "bad_host": ("GET", "/health", None, {"Host": "evil.example.com"}, None, 403,
                     "loopback"),
        "foreign_origin": ("GET", "/props", None, {"Origin": "http://evil.example.com"}, None,
                           403, "cross-origin"),
        "not_object": ("POST", "/completion", [1, 2], {}, None, 400, "must be an object"),
        "bad_tokens": ("POST", "/completion", {"prompt": [1, 999999]}, {}, None, 400,
                       "outside the vocabulary"),
        "n_two": ("POST", "/v1/completions", {"prompt": "x", "n": 0}, {}, None, 400,
                  "'n' must be between 1"),
        "bad_adaptive": ("POST", "/completion",
                         {"prompt": "x", "speculative": {"adaptive": "yes"}}, {}, None, 400,
                         "'adaptive' must be a boolean"),
        "empty_prompt": ("POST", "/completion", {"prompt": []}, {}, None, 400,
                         "the prompt is empty"),
        "huge_number": ("POST", "/completion", {"prompt": "x", "temperature": 10**400}, {},
                        None, 400, "'temperature' is out of range"),
        "deep_json": ("POST", "/completion", None, {}, b"[" * 100_000, 400,
                      "nested too deeply"),
        "nameless_tool": ("POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "x"}],
                           "tools": [{"type": "function", "function": {"name": ""}}]}, {},
                          None, 400, "tools[0]: a function needs a 'name'"),
    }[kind]
    method, path, body, headers, raw, want_status, want_text = req
    status, out = server.request(method, path, body, headers=headers, raw=raw)
    assert status == want_status, out
    assert want_text in json.dumps(out)
    assert "error" in out and "message" in out["error"]
    assert server.request("GET", "/health")[0] == 200


def test_token_required_when_configured(tiny_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=256, slots=1)
    with live_server(cfg, tmp_path, require_token=True) as srv:
        assert srv.token and (tmp_path / "state" / "token").stat().st_mode & 0o777 == 0o600
        token, srv.token = srv.token, None
        status, out = srv.request("GET", "/props")
        assert status == 401 and "bearer token" in out["error"]["message"]
        srv.token = token
        assert srv.request("GET", "/props")[0] == 200
        # the Unix socket relies on its file mode, not the token
        assert Client(srv.socket_path).get("/props")["total_slots"] == 1


def test_infill_and_prefix_cache(tmp_path, monkeypatch, tiny_model_factory) -> None:
    """llama.vim-shaped /infill; a request extending the first one's prefix reuses its KV."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=6, fim=True)
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        req = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
               "input_extra": [{"filename": "util.py", "text": "x = 1\n"}], "prompt": "",
               "n_predict": 8, "cache_prompt": True, "t_max_predict_ms": 5000,
               "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99}
        status, first = srv.request("POST", "/infill", req)
        assert status == 200, first
        assert first["tokens_predicted"] >= 1 and first["tokens_cached"] == 0
        # the user typed more: the new prompt extends the first one's prefix part
        req2 = dict(req, input_prefix=req["input_prefix"] + "return a")
        status, second = srv.request("POST", "/infill", req2)
        assert status == 200, second
        assert second["tokens_cached"] > 0
        assert second["timings"]["prompt_n"] == second["tokens_evaluated"] - \
            second["tokens_cached"]


def test_queue_full_is_503(tiny_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path, max_queue=1) as srv:
        codes: list[int] = []

        def hit() -> None:
            codes.append(srv.request("POST", "/completion", {
                "prompt": "a", "n_predict": 450, "ignore_eos": True})[0])

        threads = [threading.Thread(target=hit) for _ in range(6)]
        for t in threads:  # one runs, one waits in the queue, the rest are refused
            t.start()
        for t in threads:
            t.join(120)
        assert 503 in codes and 200 in codes


def test_body_size_limit(tiny_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=256, slots=1)
    with live_server(cfg, tmp_path, max_body=1024) as srv:
        status, out = srv.request("POST", "/completion", {"prompt": "x" * 5000})
        assert status == 413, out
        assert srv.request("GET", "/health")[0] == 200


def test_client_errors_are_typed(server) -> None:
    with pytest.raises(DaemonError) as info:
        Client(server.socket_path).post("/v1/completions", {"prompt": 5})
    assert info.value.status == 400


def test_http_conn_keepalive_survives(server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for _ in range(3):
        conn.request("GET", "/health", headers={"Host": "localhost:1"})
        assert conn.getresponse().read()
    conn.close()


def test_return_progress_reports_each_prompt_chunk(server) -> None:
    """return_progress: before the first chunk (cached = processed) and after each one,
    the prompt's progress, then the tokens; a repeated prompt starts from its cache."""
    c = Client(port=server.port)
    scheduler = server.service.scheduler
    chunk, scheduler.prefill_chunk = scheduler.prefill_chunk, 64
    try:
        prompt = " ".join(f"w{i}" for i in range(90))
        body = {"prompt": prompt, "n_predict": 3, "ignore_eos": True, "return_progress": True,
                "cache_key": "progress"}
        for run in range(2):
            events = list(c.stream("/completion", body))
            progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
            total = events[-1]["tokens_evaluated"]
            assert total > 3 * 64
            first = progress[0]
            assert first["cache"] == first["processed"] and (first["cache"] > 0) == (run == 1)
            assert all(p["total"] == total and p["cache"] == first["cache"] for p in progress)
            done = [p["processed"] for p in progress]
            assert done == sorted(set(done)) and done[-1] == total
            assert len(progress) == (2 if run else 1 + -(-total // 64))
            assert all(e["content"] == "" and not e["tokens"] for e in events
                       if "prompt_progress" in e)
            assert events.index(next(e for e in events if e["tokens"])) == len(progress)
        chat = list(c.stream("/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
            "return_progress": True}))
        progress = [e["prompt_progress"] for e in chat if "prompt_progress" in e]
        assert len(progress) >= 2 and progress[-1]["processed"] == progress[-1]["total"]
        assert all(e["choices"][0]["finish_reason"] is None for e in chat
                   if "prompt_progress" in e)
        plain = list(c.stream("/completion", {**body, "return_progress": False}))
        assert not any("prompt_progress" in e for e in plain)
    finally:
        scheduler.prefill_chunk = chunk


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    "{% if flavour is defined %} {{ flavour }}{% endif %}{% endif %}")


def test_chat_template_file_and_kwargs(tiny_path, tmp_path) -> None:
    """--chat-template-file's template replaces the GGUF's; --reasoning off and
    --chat-template-kwargs give it variables, which a request's chat_template_kwargs
    override (llama-server's and vLLM's field; the render's own variables stay)."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1,
                       chat_template=THINKING_TEMPLATE,
                       template_kwargs={"enable_thinking": False, "flavour": "mint"})
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with live_server(cfg, tmp_path) as srv:
        status, out = srv.request("POST", "/apply-template", chat)
        assert status == 200 and out["prompt"] == "user: hi\nassistant: /no_think mint"
        status, out = srv.request("POST", "/apply-template", {
            **chat, "chat_template_kwargs": {"enable_thinking": True, "flavour": "lime",
                                             "add_generation_prompt": False}})
        assert out["prompt"] == "user: hi\nassistant: lime"
        status, out = srv.request("POST", "/apply-template", {
            **chat, "chat_template_kwargs": ["enable_thinking"]})
        assert status == 400 and out["error"]["param"] == "chat_template_kwargs"
        status, out = srv.request("POST", "/v1/chat/completions", {
            **chat, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": True}})
        assert status == 200, out


def test_chat_templates_get_llama_servers_variables(tiny_path, tmp_path) -> None:
    """As llama-server renders: thinking on unless turned off (reasoning_effort "none"
    too), OpenAI's reasoning_effort passed on, today's date as Llama 3's templates read
    it."""
    from datetime import date

    template = ("{{ enable_thinking }}|{{ reasoning_effort | default('-') }}|"
                "{{ date_string }}|{{ datetime }}")
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1,
                       chat_template=template)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with live_server(cfg, tmp_path) as srv:
        today = date.today()
        dates = f"{today.strftime('%d %b %Y')}|{today.strftime('%b %d %Y')}"
        assert srv.request("POST", "/apply-template", chat)[1]["prompt"] == (
            f"True|-|{dates}")
        assert srv.request("POST", "/apply-template", {**chat, "reasoning_effort": "none"}
                           )[1]["prompt"].startswith("False|-|")
        assert srv.request("POST", "/apply-template", {
            **chat, "reasoning_effort": "high", "chat_template_kwargs": {"date_string": "x"}}
                           )[1]["prompt"] == f"True|high|x|{today.strftime('%b %d %Y')}"
