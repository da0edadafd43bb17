"""POST /v1/responses through the official `openai` SDK against a real server on loopback
with a tiny model: create and stream, a function tool round trip, JSON output, an
incomplete response, and stored responses that only their own caller can continue."""

from __future__ import annotations

import json

import pytest

from specd.daemon.serving.engine import EngineConfig
from specd.ipc import security
from specd.ipc.security import Access

from live_server import LiveServer, live_server

openai = pytest.importorskip("openai")

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "strict": True,
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
            "required": ["city"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
          "required": ["ok"], "additionalProperties": False}
OTHER_KEY = "another-callers-key"


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
    # the kernel names no peer (as off Linux): each key's holder is an identity of its own
    mp.setattr(security, "tcp_peer_uid", lambda local, remote: None)
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=1024, slots=2)
    with live_server(cfg, tmp, access=Access(token="owner-token",
                                             api_keys=frozenset({OTHER_KEY}))) as srv:
        yield srv
    mp.undo()


@pytest.fixture(scope="module")
def client(server: LiveServer):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="owner-token")


def test_create_with_a_string_and_with_instructions(client) -> None:
    out = client.responses.create(model="specd", input="Say hi", max_output_tokens=6,
                                  temperature=0)
    assert out.id.startswith("resp_") and out.object == "response"
    assert out.output[0].type == "message" and out.output[0].id.startswith("msg_")
    assert out.output_text == out.output[0].content[0].text
    assert out.usage.output_tokens <= 6
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    told = client.responses.create(model="specd", input="Say hi", instructions="Be brief.",
                                   max_output_tokens=6, temperature=0)
    assert told.instructions == "Be brief."
    assert told.usage.input_tokens > out.usage.input_tokens  # the system message


def test_max_output_tokens_leaves_it_incomplete(client) -> None:
    out = client.responses.create(model="specd", input="Tell a long story",
                                  max_output_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3


def test_stream_gives_typed_events_and_the_final_response(client) -> None:
    ask = {"model": "specd", "input": "Answer in JSON", "temperature": 0,
           "max_output_tokens": 40, "text": {"format": {
               "type": "json_schema", "name": "answer", "schema": SCHEMA}}}
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert kinds.count("response.output_text.delta") > 1
    assert final.output_text == text and final.status == "completed"
    assert isinstance(json.loads(text)["ok"], bool)
    assert client.responses.create(**ask).output_text == text  # whole, the same


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client) -> None:
    ask = {"model": "specd", "input": "Tell a story", "temperature": 0,
           "max_output_tokens": 5, "extra_body": {"ignore_eos": True}}
    events = list(client.responses.create(stream=True, **ask))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.response.output_text == text == client.responses.create(**ask).output_text


def test_a_function_tool_round_trip(client) -> None:
    ask = {"model": "specd", "tools": [TOOL], "max_output_tokens": 150, "temperature": 0,
           "parallel_tool_calls": False}
    out = client.responses.create(input="Weather in Paris?", store=True,
                                  tool_choice={"type": "function", "name": "get_weather"},
                                  **ask)
    [call] = [o for o in out.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    # the whole conversation sent back
    sent = client.responses.create(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments}, result], **{**ask, "max_output_tokens": 4})
    # or continued from the stored response
    followed = client.responses.create(input=[result], previous_response_id=out.id,
                                       **{**ask, "max_output_tokens": 4})
    assert followed.previous_response_id == out.id
    assert followed.usage.input_tokens == sent.usage.input_tokens
    assert followed.output_text == sent.output_text
    # streamed, the call comes as its own item with its arguments
    with client.responses.stream(input="Weather?", tool_choice="required", **ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments)["city"] in ("Paris", "Tokyo") for e in args] == [True]
    assert [o.type for o in final.output] == ["function_call"]


def test_json_schema_output_parses(client) -> None:
    out = client.responses.create(
        model="specd", input="Answer in JSON", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                         "strict": True}})
    assert isinstance(json.loads(out.output_text)["ok"], bool)
    assert out.text.format.type == "json_schema"


def test_a_stored_response_is_its_callers_alone(client, server: LiveServer) -> None:
    out = client.responses.create(model="specd", input="hi", max_output_tokens=2)
    other = openai.OpenAI(base_url=server.base_url + "/v1", api_key=OTHER_KEY)
    with pytest.raises(openai.NotFoundError, match="no response"):
        other.responses.create(model="specd", input="go on", max_output_tokens=2,
                               previous_response_id=out.id)
    assert client.responses.create(model="specd", input="go on", max_output_tokens=2,
                                   previous_response_id=out.id).status
    unstored = client.responses.create(model="specd", input="hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="specd", input="go on", max_output_tokens=2,
                                previous_response_id=unstored.id)


def test_bad_requests_name_their_field(client) -> None:
    image = {"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}
    for kw, param, match in (
            ({"input": [image]}, "input[0].content[0]", "needs an 'image_url'"),
            ({"input": 5}, "input", "must be a string"),
            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type",
             "function tools only"),
            ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type",
             "json_schema"),
            ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs 'tools'")):
        with pytest.raises(openai.BadRequestError, match=match) as caught:
            client.responses.create(model="specd", max_output_tokens=2, **kw)
        assert caught.value.body["param"] == param
