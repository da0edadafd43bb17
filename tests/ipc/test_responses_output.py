"""ipc/http/responses_output.py: the response object, and the typed events that stream it
in OpenAI's order (text, function calls, an incomplete end, a failure)."""

from __future__ import annotations

import json
from typing import Any

from specd.daemon.serving.service import Piece, ProgressEvent, Result
from specd.daemon.spec.stats import SpecStats
from specd.ipc.http.responses_output import ResponseReply
from specd.ipc.http.streaming import Named

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _result(text: str, finish: str = "stop") -> Result:
    return Result(text=text, finish_reason=finish, prompt_tokens=5, completion_tokens=3,
                  cached_tokens=1, stats=SpecStats())


def _reply(names: set[str] | None = None, kept: list[Any] | None = None) -> ResponseReply:
    return ResponseReply("resp_1", "tiny", {"tools": []}, names=names,
                         keep=None if kept is None else kept.append)


def _stream(reply: ResponseReply, pieces: list[str], result: Result) -> list[dict[str, Any]]:
    events = reply.opening()
    for p in pieces:
        events += reply.event(0, Piece(p, [0]))
    events += reply.finished(0, result) + reply.closing()
    assert all(isinstance(e, Named) and e.event == e.data["type"] for e in events)
    return [e.data for e in events]


def test_text_streams_in_openais_order() -> None:
    kept: list[Any] = []
    events = _stream(_reply(kept=kept), ["Hel", "lo"], _result("Hello"))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    msg = events[2]["item"]["id"]
    assert msg.startswith("msg_") and events[2]["item"]["status"] == "in_progress"
    assert all(e["item_id"] == msg for e in events[3:8])
    assert [e["delta"] for e in events if "delta" in e] == ["Hel", "lo"]
    assert events[6]["text"] == events[7]["part"]["text"] == "Hello"
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["id"] == events[0]["response"]["id"]
    assert done["output"] == [events[8]["item"]] == kept[0]
    assert done["output"][0]["content"][0]["text"] == "Hello"
    assert done["usage"]["input_tokens"] == 5 and done["usage"]["total_tokens"] == 8
    assert events[0]["response"]["status"] == "in_progress"


def test_a_call_is_held_back_and_comes_as_its_own_item() -> None:
    events = _stream(_reply({"get_weather"}), ["Checking. ", CALL[:20], CALL[20:]],
                     _result("Checking. " + CALL))
    kinds = [e["type"] for e in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert "<tool_call>" not in "".join(e.get("delta", "") for e in events[:6])
    added, done = events[8]["item"], events[11]["item"]
    assert added["arguments"] == "" and added["status"] == "in_progress"
    assert done["id"] == added["id"] and done["id"].startswith("fc_")
    assert (done["name"], json.loads(done["arguments"])) == ("get_weather", {"city": "Paris"})
    assert events[10]["arguments"] == events[9]["delta"] == done["arguments"]
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["message",
                                                                      "function_call"]
    # a reply that is only a call has no message item
    only = _stream(_reply({"get_weather"}), [CALL], _result(CALL))
    assert [o["type"] for o in only[-1]["response"]["output"]] == ["function_call"]


def test_max_output_tokens_ends_it_incomplete_and_no_text_is_still_a_message() -> None:
    events = _stream(_reply(), [], _result("", "length"))
    assert events[-1]["type"] == "response.incomplete"
    done = events[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["content"][0]["text"] == ""


def test_progress_and_a_failure() -> None:
    reply = _reply({"get_weather"})
    reply.opening()
    progress = reply.event(0, ProgressEvent(total=10, cache=0, processed=4, time_ms=1))
    assert [e.data["type"] for e in progress] == ["response.in_progress"]
    assert progress[0].data["prompt_progress"]["processed"] == 4
    assert reply.event(0, Piece("<tool_", [0])) == []  # may begin a call: held
    failing = [e.data for e in reply.failing(0) + reply.error("boom", 500)]
    assert [e["type"] for e in failing][-2:] == ["response.output_text.delta",
                                                 "response.failed"]
    assert failing[-2]["delta"] == "<tool_"
    assert failing[-1]["response"]["status"] == "failed"
    assert failing[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}


def test_whole_response() -> None:
    kept: list[Any] = []
    out = _reply({"get_weather"}, kept).whole(_result("Checking. " + CALL))
    assert out["object"] == "response" and out["id"] == "resp_1"
    assert [o["type"] for o in out["output"]] == ["message", "function_call"]
    assert out["output"][0]["content"][0]["text"] == "Checking."
    assert kept == [out["output"]]
    assert _reply().whole(_result("x", "time_limit"))["status"] == "incomplete"
