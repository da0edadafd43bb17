"""ipc/http/ollama_routes.py: /api/chat and /api/generate, their answer whole and as an
NDJSON stream, on a live server with a tiny model."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig
from specd.daemon.serving.service import Piece, Result
from specd.daemon.spec.stats import SpecStats
from specd.ipc.http.ollama_routes import OllamaReply

from live_server import LiveServer, live_server

# an enum and no other properties, so that the random model's call ends (a free string
# would run on)
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}}}


def _result(text: str = "ab", reason: str = "stop", tokens: list[int] | None = None) -> Result:
    return Result(text=text, finish_reason=reason, prompt_tokens=5, completion_tokens=2,
                  cached_tokens=0, stats=SpecStats(), tokens=tokens or [7, 8],
                  timings={"prompt_ms": 1.5, "predicted_ms": 2.25, "total_ms": 4.0})


def test_a_streamed_chat_is_deltas_then_one_done_object_with_the_counts() -> None:
    reply = OllamaReply("m", chat=True)
    lines = reply.opening() + reply.event(0, Piece("a", [1])) + reply.event(0, Piece("", []))
    lines += reply.finished(0, _result(reason="time_limit")) + reply.closing()
    assert [x["message"] for x in lines] == [{"role": "assistant", "content": "a"},
                                             {"role": "assistant", "content": ""}]
    assert [x["done"] for x in lines] == [False, True]
    done = lines[-1]
    assert {k: done[k] for k in ("model", "done_reason", "total_duration", "load_duration",
                                 "prompt_eval_count", "prompt_eval_duration", "eval_count",
                                 "eval_duration")} == {
        "model": "m", "done_reason": "length", "total_duration": 4_000_000,
        "load_duration": 0, "prompt_eval_count": 5, "prompt_eval_duration": 1_500_000,
        "eval_count": 2, "eval_duration": 2_250_000}
    assert done["created_at"].endswith("Z") and "context" not in done


def test_generate_answers_with_response_and_its_context() -> None:
    reply = OllamaReply("m", chat=False, context=[1, 2])
    [piece] = reply.event(0, Piece("x", [3]))
    assert piece == {"model": "m", "created_at": piece["created_at"], "response": "x",
                     "done": False}
    whole = reply.whole(_result("xy", tokens=[3, 4]))
    assert whole["response"] == "xy" and whole["context"] == [1, 2, 3, 4]
    assert whole["done"] is True and whole["done_reason"] == "stop"


def test_tool_calls_are_held_back_and_given_as_ollamas_objects() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    reply = OllamaReply("m", chat=True, names={"get_time"})
    assert reply.event(0, Piece(text, [1])) == []
    calls, done = reply.finished(0, _result(text))
    assert calls["message"]["tool_calls"] == [
        {"function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]
    assert calls["done"] is False and done["done"] is True
    whole = OllamaReply("m", chat=True, names={"get_time"}).whole(_result(text))
    assert whole["message"]["content"] == ""
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


# -- on a live server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024,
                              fim=True)
    tmp = tmp_path_factory.mktemp("ollama")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=2)
    with live_server(cfg, tmp) as srv:
        yield srv
    mp.undo()


def _name(server: LiveServer) -> str:
    return server.service.engine.model_name


def _ndjson(server: LiveServer, path: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """(content type, the lines as JSON) of a streamed answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    auth = {"Authorization": f"Bearer {server.token}"} if server.token else {}
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **auth})
    resp = conn.getresponse()
    assert resp.status == 200
    data = resp.read().decode()
    conn.close()
    return resp.getheader("Content-Type", ""), [json.loads(x) for x in data.splitlines()]


def test_chat_streams_ndjson_by_default(server: LiveServer) -> None:
    ctype, lines = _ndjson(server, "/api/chat", {
        "model": _name(server), "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 6, "temperature": 0}})
    assert ctype.startswith("application/x-ndjson")
    assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"] is True
    assert lines[-1]["eval_count"] == 6 and lines[-1]["done_reason"] == "length"
    streamed = "".join(x["message"]["content"] for x in lines)
    status, whole = server.request("POST", "/api/chat", {
        "model": _name(server), "stream": False, "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 6, "temperature": 0}})
    assert status == 200 and whole["message"]["content"] == streamed


def test_generate_raw_and_templated_and_fim(server: LiveServer) -> None:
    ask = {"model": _name(server), "stream": False, "options": {"num_predict": 4}}
    status, raw = server.request("POST", "/api/generate", {**ask, "prompt": "hi", "raw": True})
    assert status == 200 and raw["prompt_eval_count"] < 4  # no template around it
    status, chat = server.request("POST", "/api/generate", {**ask, "prompt": "hi",
                                                            "system": "be brief"})
    assert status == 200 and chat["prompt_eval_count"] > raw["prompt_eval_count"]
    assert chat["context"][-chat["eval_count"]:] and len(chat["context"]) == (
        chat["prompt_eval_count"] + chat["eval_count"])
    status, fim = server.request("POST", "/api/generate", {**ask, "prompt": "def f(",
                                                           "suffix": "return 1"})
    assert status == 200 and fim["eval_count"] == 4
    _, lines = _ndjson(server, "/api/generate", {**ask, "stream": True, "prompt": "hi"})
    assert "response" in lines[0] and lines[-1]["done"] is True


def test_format_constrains_the_reply_to_json(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    status, out = server.request("POST", "/api/generate", {
        "model": _name(server), "stream": False, "prompt": "x", "format": schema,
        "options": {"num_predict": 300}})
    assert status == 200 and isinstance(json.loads(out["response"])["n"], int), out


def test_a_forced_tool_call_comes_as_ollamas_tool_calls(server: LiveServer) -> None:
    # tool_choice is specd's own field (Ollama has no way to force a call)
    ask = {"model": _name(server), "stream": False, "tools": [TIME_TOOL],
           "tool_choice": {"type": "function", "function": {"name": "get_time"}},
           "options": {"num_predict": 300, "temperature": 0},
           "messages": [{"role": "user", "content": "time in Oslo?"}]}
    status, out = server.request("POST", "/api/chat", ask)
    assert status == 200 and "tool_calls" in out["message"], out
    call = out["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_time" and call["arguments"]["city"] in ("Oslo", "Lima")
    _, lines = _ndjson(server, "/api/chat", {**ask, "stream": True})
    calls = [c for x in lines for c in x["message"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_time"] and lines[-1]["done"]


def test_load_requests_and_refusals_in_ollamas_shape(server: LiveServer) -> None:
    name = _name(server)
    status, out = server.request("POST", "/api/generate", {"model": name})
    assert status == 200 and (out["done"], out["done_reason"]) == (True, "load")
    status, out = server.request("POST", "/api/chat", {"model": name, "messages": []})
    assert status == 200 and out["done_reason"] == "load" and out["message"]["content"] == ""
    for path, body, code, words in (
            ("/api/chat", {"model": "gpt-9", "messages": []}, 404, "model 'gpt-9' not found"),
            ("/api/generate", {"model": name, "prompt": "x", "template": "{{ .Prompt }}"},
             400, "'template' is not supported"),
            ("/api/generate", {"model": name, "prompt": "x", "images": ["iVBORw0KGgo="]}, 400,
             "takes no images"),
            ("/api/chat", {"model": name, "messages": [{"role": "user", "content": "x"}],
                           "options": {"temperature": "hot"}}, 400, "temperature")):
        status, out = server.request("POST", path, body)
        assert status == code and list(out) == ["error"] and words in out["error"], out
