"""The request lifecycle over the real HTTP API (tiny model): stop strings and usage,
time limits, the serve defaults, queueing before a stream starts, errors mid-stream,
CORS, /infill trimming."""

from __future__ import annotations

import base64
import http.client
import json
import re
import threading
import time
from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.ipc.client import Client, DaemonError

from live_server import LiveServer, live_server


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))


def _events(payload: Any) -> list[Any]:
    """The data: events of an SSE body."""
    assert isinstance(payload, str), payload
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in payload.splitlines() if line.startswith("data: ")]


def _raw(srv: LiveServer, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request(method, path, None if body is None else json.dumps(body).encode(),
                 {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def test_stop_string_ends_the_count_at_its_token(tiny_path, tmp_path) -> None:
    """Rounds of prompt lookup emit several tokens at once; the usage counts the tokens up
    to the one that completes the stop string, the same in every run."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        req = {"prompt": "one two one two one two", "n_predict": 40, "ignore_eos": True}
        status, body = srv.request("POST", "/completion", {**req, "stream": True})
        assert status == 200
        tokens = [t for ev in _events(body) if not ev["stop"] for t in ev["tokens"]]
        text = srv.service.tokenizer.decode(tokens)
        stop = text[12:15]
        assert len(stop) == 3 and text.find(stop) >= 6
        k = next(n for n in range(1, len(tokens) + 1)
                 if stop in srv.service.tokenizer.decode(tokens[:n]))
        for _ in range(4):
            status, out = srv.request("POST", "/completion", {**req, "stop": [stop]})
            assert status == 200, out
            assert out["content"] == text[: text.find(stop)]
            assert out["stop_type"] == "word" and out["stopping_word"] == stop
            assert out["tokens_predicted"] == k
        status, out = srv.request("POST", "/v1/completions", {
            "prompt": req["prompt"], "max_tokens": 40, "ignore_eos": True, "stop": stop})
        assert out["usage"]["completion_tokens"] == k
        status, body = srv.request("POST", "/completion", {**req, "stop": [stop],
                                                           "stream": True})
        streamed = [t for ev in _events(body) if not ev["stop"] for t in ev["tokens"]]
        assert streamed == tokens[:k]


def test_warm_up_request_caches_the_prompt_and_time_limit_starts_at_the_first_token(
        tiny_path, tmp_path) -> None:
    """llama.vim's cache warm-up: n_predict 0 and a 1 ms budget evaluate and keep the
    prompt; the budget never cuts prompt processing short."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        prompt = "lorem ipsum dolor sit amet " * 14
        warm = {"prompt": prompt, "n_predict": 0, "t_max_predict_ms": 1, "cache_prompt": True}
        status, out = srv.request("POST", "/completion", warm)
        assert status == 200, out
        assert out["tokens_predicted"] == 0 and out["content"] == ""
        assert srv.request("GET", "/slots")[1][0]["n_cached"] == out["tokens_evaluated"] > 100
        status, out = srv.request("POST", "/completion", {
            "prompt": prompt, "n_predict": 12, "ignore_eos": True, "t_max_predict_ms": 1})
        assert status == 200, out
        assert out["tokens_cached"] == out["tokens_evaluated"] - 1  # the last is evaluated
        assert out["tokens_predicted"] >= 1
        if "\n" not in out["content"]:  # the limit applies once a line is complete
            assert out["tokens_predicted"] == 12
        status, out = srv.request("POST", "/v1/completions", {"prompt": prompt,
                                                              "max_tokens": 0})
        assert status == 200 and out["usage"]["completion_tokens"] == 0


def test_serve_defaults_apply_to_requests(tiny_path, tmp_path) -> None:
    """`specd serve -n 5 --ignore-eos --temp 0.9 --seed 7`: what /props reports is what a
    request without those fields gets."""
    defaults = GenerationParams(max_tokens=5, ignore_eos=True,
                                sampling=SamplerParams(temperature=0.9, seed=7))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1,
                       defaults=defaults)
    with live_server(cfg, tmp_path) as srv:
        assert srv.request("GET", "/props")[1]["default_generation_settings"]["n_predict"] == 5
        outs = [srv.request("POST", "/completion", {"prompt": "tell me"})[1]
                for _ in range(2)]
        assert [o["tokens_predicted"] for o in outs] == [5, 5]
        assert outs[0]["content"] == outs[1]["content"]  # the default seed
        for route, key in (("/v1/completions", "prompt"), ("/infill", "input_prefix")):
            status, out = srv.request("POST", route, {key: "tell me"})
            if route == "/infill":
                assert status == 400  # this vocabulary has no FIM tokens
                continue
            assert out["usage"]["completion_tokens"] == 5
        out = srv.request("POST", "/completion", {"prompt": "tell me", "n_predict": 3,
                                                  "seed": 8})[1]
        assert out["tokens_predicted"] == 3


def test_full_queue_refuses_a_stream_before_it_starts(tiny_path, tmp_path,
                                                      monkeypatch) -> None:
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path, max_queue=1) as srv:
        runner = srv.service.engine.target.runner
        real, gate = runner.forward_batch, threading.Event()

        def held(*args: Any, **kw: Any) -> Any:  # the running request waits here
            gate.wait(60)
            return real(*args, **kw)

        monkeypatch.setattr(runner, "forward_batch", held)
        req = {"prompt": "a", "n_predict": 4, "ignore_eos": True}
        sched = srv.service.scheduler
        threads = [threading.Thread(target=srv.request, args=("POST", "/completion", req))
                   for _ in range(2)]
        try:
            for t, ready in zip(threads, (lambda: sched.slots[0].request is not None,
                                          lambda: sched.queue_length == 1), strict=True):
                t.start()  # the first runs (held), the second waits in the queue
                deadline = time.time() + 20
                while not ready() and time.time() < deadline:
                    time.sleep(0.02)
                assert ready()
            for path, body in (("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]}),
                               ("/v1/completions", {"prompt": "hi"}),
                               ("/completion", {"prompt": "hi"})):
                status, out = srv.request("POST", path, {**body, "stream": True})
                assert status == 503, out
                assert "queue is full" in out["error"]["message"]
        finally:
            gate.set()
            for t in threads:
                if t.ident is not None:  # started
                    t.join(60)


def test_failure_mid_stream_is_an_error_event(tiny_path, tmp_path, monkeypatch) -> None:
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        runner = srv.service.engine.target.runner
        real, calls = runner.forward_batch, []

        def failing(*args: Any, **kw: Any) -> Any:
            calls.append(1)
            if len(calls) > 4:
                raise RuntimeError("device lost")
            return real(*args, **kw)

        monkeypatch.setattr(runner, "forward_batch", failing)
        for path, body in (("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/completion", {"prompt": "hi"})):
            calls.clear()
            status, payload = srv.request("POST", path, {**body, "stream": True,
                                                         "n_predict": 20, "max_tokens": 20,
                                                         "ignore_eos": True})
            events = _events(payload)
            assert status == 200
            assert "device lost" in events[-1]["error"]["message"]
            assert "[DONE]" not in events
            assert not any(isinstance(e, dict) and e.get("choices") and
                           e["choices"][0]["finish_reason"] for e in events)
        calls.clear()
        with pytest.raises(DaemonError, match="device lost") as info:
            list(Client(srv.socket_path).stream("/completion", {
                "prompt": "hi", "n_predict": 20, "ignore_eos": True}))
        assert info.value.status == 500
        monkeypatch.setattr(runner, "forward_batch", real)
        assert srv.request("POST", "/completion", {"prompt": "hi", "n_predict": 2})[0] == 200


def test_cors_for_allowed_origins(tiny_path, tmp_path) -> None:
    origin = "http://app.localhost:5173"
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path, allowed_origins={origin}, require_token=True) as srv:
        status, headers, _ = _raw(srv, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 200
        assert headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        auth = {"Origin": origin, "Authorization": f"Bearer {srv.token}"}
        status, headers, _ = _raw(srv, "POST", "/completion", {"prompt": 5}, auth)
        assert status == 400 and headers["Access-Control-Allow-Origin"] == origin
        status, headers, body = _raw(srv, "POST", "/completion", {
            "prompt": "hi", "n_predict": 2, "stream": True}, auth)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
        assert b"data: " in body
        status, headers, _ = _raw(srv, "OPTIONS", "/completion", headers={
            "Origin": "http://evil.example.com", "Access-Control-Request-Method": "POST"})
        assert status in (401, 403) and "Access-Control-Allow-Origin" not in headers


def test_infill_trims_extra_context_to_fit(tmp_path, tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=6, fim=True)
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=256, slots=1)
    with live_server(cfg, tmp_path) as srv:
        extra = [{"filename": f"f{i}.py", "text": "value = compute(value) + 1\n" * 20}
                 for i in range(6)]
        status, out = srv.request("POST", "/infill", {
            "input_prefix": "def f():\n    ", "input_suffix": "\n", "input_extra": extra,
            "n_predict": 16, "ignore_eos": True})
        assert status == 200, out
        assert 256 - 1 - 16 - 20 < out["tokens_evaluated"] <= 256 - 1 - 16
        assert out["tokens_predicted"] == 16


def test_chat_prompts_get_one_bos_and_the_tools(tiny_path, tmp_path) -> None:
    """A template that writes `{{ bos_token }}` itself on a vocabulary that adds BOS gets
    one BOS, not two; `tools` reach the template; a non-text part is a 400."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        engine = srv.service.engine
        tok = engine.tokenizer
        assert tok.bos_id is not None
        engine.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                "{% endfor %}{% if tools %}|{{ tools[0].function.name }}"
                                "{% endif %}")
        tok._add_bos = True  # a vocabulary that adds BOS (llama-bpe, SentencePiece)
        ids = engine.chat_tokens([{"role": "user", "content": "hi"}])
        assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        status, out = srv.request("POST", "/v1/chat/completions", {**chat, "tools": [tool]})
        assert status == 200, out
        with_tools = out["usage"]["prompt_tokens"]
        status, out = srv.request("POST", "/v1/chat/completions", chat)
        assert with_tools == out["usage"]["prompt_tokens"] + len(
            tok.encode("|get_weather", add_bos=False))
        # an image for a model without a vision projector: a 400 naming --mmproj; a
        # remote URL: a 400 saying the daemon fetches nothing; the server stays up
        png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
        for url, why in ((png, "--mmproj"), ("https://example.com/a.png", "not fetched")):
            status, out = srv.request("POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": url}}]}]})
            assert status == 400 and why in out["error"]["message"], out
        status, _ = srv.request("POST", "/v1/chat/completions", chat)
        assert status == 200
        status, out = srv.request("POST", "/v1/chat/completions", {**chat, "tools": "no"})
        assert status == 400 and out["error"]["param"] == "tools"


def test_response_fields_as_llama_vim_asks(tiny_path, tmp_path) -> None:
    """llama.vim asks for "timings/prompt_n" and the like and reads them as flat keys (it
    showed zeros in its stats line); paths not found are left out, as llama.cpp does."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        fields = ["content", "timings/prompt_n", "timings/predicted_n", "tokens_cached",
                  "truncated", "no/such/field"]
        status, out = srv.request("POST", "/completion", {
            "prompt": "hello", "n_predict": 3, "ignore_eos": True, "response_fields": fields})
        assert status == 200, out
        assert set(out) == set(fields[:-1])
        assert out["timings/predicted_n"] == 3 and out["timings/prompt_n"] >= 1
        status, out = srv.request("POST", "/completion", {"prompt": "x",
                                                          "response_fields": "content"})
        assert status == 400 and "response_fields" in out["error"]["message"]


def test_indent_limit_ends_an_editor_completion_as_llama_cpp_does() -> None:
    """n_indent: the first later line indented less than n_indent (a blank one too) ends
    the completion before its first character; text in any token split is cut alike."""
    from specd.daemon.serving.service import IndentLimit

    def run(pieces: list[str], n: int) -> tuple[str, bool]:
        lim, out = IndentLimit(n), []
        for p in pieces:
            kept, stop = lim.feed(p)
            out.append(kept)
            if stop:
                return "".join(out), True
        return "".join(out), False

    body = " return math.pi * r ** 2\n\n\ndef circumference(r):\n    return 2\n"
    assert run([body], 4) == (" return math.pi * r ** 2\n", True)  # the blank line ends it
    assert run(list(body), 4) == (" return math.pi * r ** 2\n", True)  # one char at a time
    nested = "x = 1\n    if y:\n        z\n  w\n"
    assert run(list(nested), 4) == ("x = 1\n    if y:\n        z\n  ", True)
    assert run([nested], 2) == (nested, False)
    assert run(["first line only"], 4) == ("first line only", False)


def test_infill_n_indent_over_http(tmp_path, tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=6, fim=True,
                              context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=1024, slots=1)
    with live_server(cfg, tmp_path) as srv:
        req = {"input_prefix": "if a:\n    b\n", "input_suffix": "\n", "n_predict": 200,
               "ignore_eos": True}
        status, free = srv.request("POST", "/infill", req)
        assert status == 200, free
        text = free["content"]
        assert 0 < text.index("\n") < len(text) - 1  # this seed writes a second line
        status, out = srv.request("POST", "/infill", {**req, "n_indent": 1000})
        assert status == 200, out
        assert out["content"] == text[: text.index("\n") + 1]  # cut before it
        assert out["stop_type"] == "limit" and out["tokens_predicted"] < 200


def _compact(raw: bytes) -> bool:
    """Whether a JSON body is written as llama-server writes it: no space after ',' or
    ':', non-ASCII text as UTF-8."""
    text = raw.decode("utf-8")
    return text == json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))


def test_json_is_compact_as_llama_vim_reads_it(tmp_path, tiny_model_factory) -> None:
    """llama.vim keeps only /infill responses matching `"content"\\s*:"` (a space after
    the colon made it drop every suggestion); every route and SSE payload is compact."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=6, fim=True)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        # the request llama.vim's FIM sends (s:fim, llama.vim 2025)
        status, _, raw = _raw(srv, "POST", "/infill", {
            "id_slot": 0, "input_prefix": "def add(a, b):\n", "input_suffix": "\n",
            "input_extra": [{"filename": "util.py", "text": "x = 1\n"}],
            "prompt": "    ", "n_predict": 8, "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms",
                                "timings/prompt_per_token_ms", "timings/prompt_per_second",
                                "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms",
                                "timings/predicted_per_second", "truncated",
                                "tokens_cached"]})
        assert status == 200
        assert re.search(rb'"content"\s*:"', raw), raw
        assert _compact(raw), raw
        chat = {"messages": [{"role": "user", "content": "é"}], "max_tokens": 3}
        for method, path_, body in (("GET", "/health", None), ("GET", "/props", None),
                                    ("GET", "/slots", None), ("GET", "/v1/models", None),
                                    ("POST", "/tokenize", {"content": "日本"}),
                                    ("POST", "/v1/chat/completions", chat),
                                    ("POST", "/completion", {"prompt": 5})):  # an error
            status, _, raw = _raw(srv, method, path_, body)
            assert _compact(raw), (path_, raw)
        for path_, body in (("/v1/chat/completions", chat),
                            ("/completion", {"prompt": "a", "n_predict": 3})):
            status, _, raw = _raw(srv, "POST", path_, {**body, "stream": True})
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            assert len(events) > 1 and all(e == b"[DONE]" or _compact(e) for e in events), raw
        for extra in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "a"},
                      {"filename": 123, "text": 456}):  # llama.cpp's test_infill cases
            status, out = srv.request("POST", "/infill", {"input_extra": [extra],
                                                          "input_prefix": "x"})
            assert status == 400 and "input_extra" in out["error"]["message"], (extra, out)


def test_logit_bias_and_penalties_are_applied_and_checked(tiny_path, tmp_path) -> None:
    """logit_bias (OpenAI's map, llama.cpp's pairs, token text, false = never) changes
    what is generated; presence / frequency penalties too; a bad map is a 400."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        def tokens(**extra: Any) -> list[int]:
            status, body = srv.request("POST", "/completion", {
                "prompt": "one two one two", "n_predict": 12, "ignore_eos": True,
                "temperature": 0, "stream": True, **extra})
            assert status == 200, body
            return [t for ev in _events(body) if isinstance(ev, dict) and not ev["stop"]
                    for t in ev["tokens"]]

        plain = tokens()
        banned = sorted(set(plain))[:2]
        for bias in ({str(t): -100 for t in banned}, [[t, False] for t in banned]):
            out = tokens(logit_bias=bias)
            assert len(out) == 12 and not set(out) & set(banned), (bias, out)
        tok = srv.service.tokenizer
        word = next(t for t in plain  # one whose text is itself (not part of a character)
                    if tok.encode(tok.decode([t]), add_bos=False, parse_special=False) == [t])
        assert word not in tokens(logit_bias=[[tok.decode([word]), False]])  # given as text
        assert tokens(presence_penalty=1.5, frequency_penalty=1.0) != plain
        for bad, match in (({"1": "x"}, "finite number or false"), ({"999999": 1}, "outside"),
                           ([[1, 2, 3]], "pairs"), ("nope", "must be an object"),
                           ({"-3": 1}, "outside"), ([[None, 1]], "ids or text"),
                           ({"1": True}, "finite number")):
            status, out = srv.request("POST", "/v1/completions", {"prompt": "x",
                                                                  "logit_bias": bad})
            assert status == 400 and match in out["error"]["message"], (bad, out)
            assert out["error"]["param"] == "logit_bias"
        status, out = srv.request("POST", "/completion", {"prompt": "x",
                                                          "presence_penalty": "high"})
        assert status == 400 and "presence_penalty" in out["error"]["message"]


def test_json_schema_numbers_end(tiny_path, tmp_path) -> None:
    """A model that would write digits forever (this random one does) ends each JSON
    number within 16 digits per part, as llama.cpp's schema converter makes it."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=1)
    schema = {"type": "array", "items": {"type": "number"}}
    with live_server(cfg, tmp_path) as srv:
        status, out = srv.request("POST", "/completion", {
            "prompt": "1111111111", "n_predict": 120, "json_schema": schema,
            "logit_bias": [[str(d), 50] for d in range(1, 10)]})  # digits above all else
        assert status == 200, out
        runs = [len(r) for r in re.findall(r"[0-9]+", out["content"])]
        assert runs and max(runs) == 16, out["content"]


def test_a_final_assistant_message_is_continued(tiny_path, tmp_path) -> None:
    """Assistant prefill: a trailing assistant message is continued, not closed with a
    new turn after it; continue_final_message / add_generation_prompt say otherwise."""
    openai = pytest.importorskip("openai")
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        tok = srv.service.tokenizer
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, h"}]

        def prompt_tokens(**extra: Any) -> int:
            out = client.chat.completions.create(model="", messages=chat, max_tokens=1,
                                                 extra_body=extra)
            return out.usage.prompt_tokens

        def n(text: str) -> int:
            return len(tok.encode(text, parse_special=True))

        turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, h"
        assert prompt_tokens() == n(turn)
        assert prompt_tokens(continue_final_message=True) == n(turn)
        closed = turn + "<|im_end|>\n"
        assert prompt_tokens(continue_final_message=False) == n(closed + "<|im_start|>assistant\n")
        assert prompt_tokens(continue_final_message=False, add_generation_prompt=False) == n(
            closed)
        with pytest.raises(openai.BadRequestError, match="cannot both be set"):
            prompt_tokens(continue_final_message=True, add_generation_prompt=True)
        chat[-1]["role"] = "user"  # nothing to continue: a new turn, as always
        assert prompt_tokens() == n(closed.replace("assistant", "user")
                                    + "<|im_start|>assistant\n")


def test_llama_server_routes_and_fields(tiny_path, tmp_path) -> None:
    """What llama-server's clients read: the routes without /v1, /completion's fields,
    /props' and /slots' additions, system_fingerprint, response_fields: [] = all."""
    openai = pytest.importorskip("openai")
    cfg = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=2)
    with live_server(cfg, tmp_path) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused")  # no /v1
        assert [m.id for m in client.models.list()] == [srv.service.engine.target.name]
        chat = client.chat.completions.create(model="", max_tokens=3,
                                              messages=[{"role": "user", "content": "hi"}])
        # llama-server's form, b<build>-..., with specd's version after the build
        assert chat.system_fingerprint is not None
        assert re.fullmatch(r"b\d+-specd(-[\w.+]+)?", chat.system_fingerprint)
        chunks = list(client.chat.completions.create(
            model="", max_tokens=3, stream=True, messages=[{"role": "user", "content": "hi"}]))
        assert all(c.system_fingerprint == chat.system_fingerprint for c in chunks)

        req = {"prompt": "one two", "n_predict": 6, "ignore_eos": True, "temperature": 0,
               "logit_bias": [[7, -1.5]]}
        status, out = srv.request("POST", "/completion", {**req, "return_tokens": True})
        assert status == 200, out
        streamed = _events(srv.request("POST", "/completion", {**req, "stream": True})[1])
        assert out["tokens"] == [t for e in streamed if not e["stop"] for t in e["tokens"]]
        assert len(out["tokens"]) == 6 and out["index"] == 0 and out["id_slot"] in (0, 1)
        assert out["prompt"] == "one two" and out["has_new_line"] == ("\n" in out["content"])
        settings = out["generation_settings"]
        assert settings["temperature"] == 0 and settings["n_predict"] == 6
        eog = sorted(srv.service.engine.eog_ids)  # ignore_eos bans them, as llama.cpp shows
        assert settings["logit_bias"] == [{"token": 7, "bias": -1.5}] + [
            {"token": t, "bias": None} for t in eog]
        t = out["timings"]
        assert t["cache_n"] == out["tokens_cached"]
        assert t["predicted_per_token_ms"] == pytest.approx(  # after the first token
            t["predicted_ms"] / (t["predicted_n"] - 1), abs=1e-3)
        assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"],
                                                         abs=1e-3)
        assert [e["tokens_predicted"] for e in streamed if not e["stop"]][-1] == 6
        assert srv.request("POST", "/completion", req)[1]["tokens"] == []  # not asked for
        everything = srv.request("POST", "/completion", {**req, "response_fields": []})[1]
        assert set(everything) >= {"content", "timings", "generation_settings"}

        status, props = srv.request("GET", "/props")
        assert props["model_path"] == str(srv.service.engine.target.path)
        assert props["default_generation_settings"]["n_ctx"] == 512
        assert props["default_generation_settings"]["params"]["n_predict"] == (
            srv.service.engine.cfg.defaults.max_tokens)
        slots = srv.request("GET", "/slots")[1]
        assert [s["is_processing"] for s in slots] == [False, False]
        messages = [{"role": "user", "content": "hi"}]
        status, applied = srv.request("POST", "/apply-template", {"messages": messages})
        assert status == 200 and applied["prompt"] == srv.service.engine.render_chat(messages)
        status, counted = srv.request("POST", "/chat/completions/input_tokens",
                                      {"messages": messages})
        assert status == 200 and counted["input_tokens"] == chat.usage.prompt_tokens


def test_synthetic_speculation_drafts_a_request_the_same_way_each_time(tiny_path,
                                                                       tmp_path) -> None:
    cfg = EngineConfig(target=str(tiny_path), spec_type="synthetic", synthetic_mean=2.5,
                       n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        def accepted(prompt: str) -> int:
            status, out = srv.request("POST", "/completion", {
                "prompt": prompt, "n_predict": 40, "ignore_eos": True})
            assert status == 200, out
            return out["timings"]["draft_n_accepted"]

        first = accepted("one two")
        accepted("something else first")
        assert accepted("one two") == first


def test_completion_prompt_shapes_as_llama_server_reads_them(tiny_path, tmp_path) -> None:
    """Several prompts give a list of results; ids, text among ids, {"prompt_string"}
    are prompts; two trailing assistant messages are a 400."""
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        tok = srv.service.tokenizer
        ids = tok.encode("one two")
        base = {"n_predict": 4, "ignore_eos": True, "temperature": 0}
        status, one = srv.request("POST", "/completion", {**base, "prompt": "one two"})
        assert status == 200, one
        for prompt in (ids, {"prompt_string": "one two"}, [ids[:1], "two"] if len(ids) == 2
                       else ids):
            status, out = srv.request("POST", "/completion", {**base, "prompt": prompt})
            assert status == 200 and out["content"] == one["content"], (prompt, out)
        status, many = srv.request("POST", "/completion", {**base, "prompt": [ids, "one two"]})
        assert status == 200 and [m["index"] for m in many] == [0, 1]
        assert [m["content"] for m in many] == [one["content"]] * 2
        status, out = srv.request("POST", "/completion", {**base, "stream": True,
                                                          "prompt": [ids, ids]})
        assert status == 400 and "several prompts" in out["error"]["message"]
        status, out = srv.request("POST", "/completion", {
            **base, "prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}})
        assert status == 400 and "takes no images" in out["error"]["message"]
        status, out = srv.request("POST", "/v1/chat/completions", {"messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"}]})
        assert status == 400 and out["error"]["param"] == "messages"


def test_backend_sampling_per_request_and_by_default(tiny_path, tmp_path, monkeypatch) -> None:
    """Tokens are decided in the graph unless a request (or `--no-backend-sampling`) says
    otherwise; greedy text is the same either way, and a bad value is named."""
    from specd.ort_models import native_ops

    if native_ops.library() is None:
        pytest.skip("specd's kernels are off: no graph sampler")
    for default in (True, False):
        cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=1,
                           defaults=GenerationParams(backend_sampling=default))
        with live_server(cfg, tmp_path) as srv:
            runner = srv.service.engine.target.runner
            real, in_graph = runner.forward_batch, []

            def spy(calls, real=real, in_graph=in_graph):
                in_graph.extend(c.sample is not None for c in calls)
                return real(calls)

            monkeypatch.setattr(runner, "forward_batch", spy)
            req = {"prompt": "tell me", "n_predict": 8, "ignore_eos": True, "temperature": 0}
            texts = {}
            for choice in (None, True, False):
                in_graph.clear()
                body = req if choice is None else {**req, "backend_sampling": choice}
                status, out = srv.request("POST", "/completion", body)
                assert status == 200, out
                texts[choice] = out["content"]
                want = default if choice is None else choice
                assert any(in_graph) == want and all(in_graph) == want
            assert len(set(texts.values())) == 1
            status, out = srv.request("POST", "/completion", {**req, "backend_sampling": "yes"})
            assert status == 400 and "backend_sampling" in json.dumps(out)
