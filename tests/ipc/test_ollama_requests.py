"""ipc/http/ollama_requests.py: Ollama's requests read into the shared layer's terms."""

from __future__ import annotations

from typing import Any, cast

import pytest

from specd.daemon.serving.facade import ServiceFacade
from specd.ipc.http.ollama_requests import (
    chat_body,
    keep_alive,
    sampling_fields,
    served_model,
    timestamp,
)
from specd.ipc.validation import BadRequest


def test_options_become_the_shared_parsers_fields() -> None:
    fields = sampling_fields({"options": {
        "temperature": 0.2, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "seed": 3,
        "num_predict": 12, "stop": ["\n"], "repeat_penalty": 1.1, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "num_ctx": 8192, "num_thread": 4, "mirostat": 0}})
    assert fields == {"temperature": 0.2, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
                      "seed": 3, "num_predict": 12, "stop": ["\n"], "repeat_penalty": 1.1,
                      "presence_penalty": 0.5, "frequency_penalty": 0.25}
    assert sampling_fields({"options": {"num_predict": -2}}) == {"num_predict": -1}
    assert sampling_fields({}) == {}


@pytest.mark.parametrize("options, name", [
    ({"mirostat": 2}, "mirostat"), ({"typical_p": 0.5}, "typical_p"),
    ({"num_ctx": "big"}, "num_ctx"), ({"num_ctx": 0}, "num_ctx")])
def test_options_specd_cannot_honour_are_refused(options: dict[str, Any], name: str) -> None:
    with pytest.raises(BadRequest) as exc:
        sampling_fields({"options": options})
    assert exc.value.param == name and exc.value.status == 400


def test_format_becomes_response_format() -> None:
    assert sampling_fields({"format": "json"})["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert sampling_fields({"format": schema})["response_format"] == {
        "type": "json_schema", "json_schema": {"schema": schema}}
    assert "response_format" not in sampling_fields({"format": ""})
    with pytest.raises(BadRequest, match="'format'"):
        sampling_fields({"format": "yaml"})


def test_a_chat_becomes_the_openai_shaped_one_chat_inputs_reads() -> None:
    call = {"function": {"name": "get_time", "arguments": {"city": "Oslo"}}}
    body = chat_body({"think": False, "tools": [{"type": "function"}], "messages": [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "tool_calls": [call], "thinking": "hm"},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"}]})
    assert body["messages"] == [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", **call}],
         "reasoning_content": "hm"},
        {"role": "tool", "content": "12:00", "name": "get_time"}]
    assert body["tools"] == [{"type": "function"}]
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat_body({"messages": [], "think": "high"})["reasoning_effort"] == "high"


def test_images_become_image_parts_before_the_text() -> None:
    chat = chat_body({"messages": [{"role": "user", "content": "x", "images": ["iVBOR"]}]})
    assert chat["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
        {"type": "text", "text": "x"}]
    with pytest.raises(BadRequest, match="'images' must be an array"):
        chat_body({"messages": [{"role": "user", "content": "x", "images": "iVBOR"}]})


@pytest.mark.parametrize("value, seconds", [
    (None, None), (0, 0.0), ("0", 0.0), (300, 300.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("-1", -1.0), ("-1m", -60.0), ("250ms", 0.25)])
def test_keep_alive_reads_seconds_and_go_durations(value: Any, seconds: float | None) -> None:
    assert keep_alive({"keep_alive": value}) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", True, [1], "NaN", float("inf")])
def test_a_bad_keep_alive_is_refused(value: Any) -> None:
    with pytest.raises(BadRequest, match="keep_alive"):
        keep_alive({"keep_alive": value})


class _Svc:
    served_names = frozenset({"tiny", "specd"})  # every local model's names


def test_the_model_name_is_the_served_one_or_a_404_in_ollamas_words() -> None:
    svc = cast(ServiceFacade, _Svc())
    assert served_model(svc, {"model": "tiny"}) == "tiny"
    assert served_model(svc, {"model": "tiny:latest"}) == "tiny:latest"
    assert served_model(svc, {"name": "tiny"}) == "tiny"  # older clients' field
    with pytest.raises(BadRequest) as exc:
        served_model(svc, {"model": "llama3:8b"})
    assert (exc.value.status, str(exc.value)) == (404, "model 'llama3:8b' not found")
    with pytest.raises(BadRequest, match="model is required"):
        served_model(svc, {})


def test_timestamps_are_rfc3339_in_utc() -> None:
    assert timestamp(0) == "1970-01-01T00:00:00Z"
