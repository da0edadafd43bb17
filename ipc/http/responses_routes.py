"""OpenAI's Responses API (/v1/responses), what OpenAI's Codex CLI speaks: the request
translated into a chat completion's (responses_inputs), generated through the shared
layer, answered whole or as typed events (responses_output); each response's
conversation kept for `previous_response_id`, per caller (responses_store)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..jsonout import json_response
from ..security import IDENTITY, is_own_user
from ..validation import BadRequest, get, json_body
from .chat_inputs import chat_inputs, chat_prompt
from .parsing import check_fits, check_model, constraint, generation_params, unsupported
from .reply_reading import ReplyReading
from .responses_inputs import chat_request, input_items, renamed
from .responses_output import ResponseReply, new_id
from .responses_store import RESPONSES
from .state import off_loop, served
from .streaming import collect, stream_events, submit_all


async def input_tokens(request: web.Request) -> web.Response:
    """/v1/responses/input_tokens (llama-server's): how many tokens the request's input
    is, rendered as /v1/responses renders it (with its previous response's)."""
    body = await json_body(request)
    svc = await served(request, body, wake=True)
    check_model(request, body)
    previous = get(body, "previous_response_id", str, None)
    history = [] if previous is None else request.app[RESPONSES].get(
        request.get(IDENTITY, ""), previous) or []
    try:
        chat_in = chat_inputs(chat_request(body, history)[0],
                              own_user=is_own_user(request.get(IDENTITY, "")))
        prompt, _ = await off_loop(request, chat_prompt, svc, chat_in)
    except BadRequest as exc:
        raise renamed(exc) from None
    return json_response({"object": "response.input_tokens", "input_tokens": len(prompt)})


async def responses(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    svc = await served(request, body)
    check_model(request, body)
    unsupported(body, ("background", "conversation", "prompt"))
    store = request.app[RESPONSES]
    identity = request.get(IDENTITY, "")
    previous = get(body, "previous_response_id", str, None)
    history: list[dict[str, Any]] = []
    if previous is not None:
        found = store.get(identity, previous)
        if found is None:
            raise BadRequest(f"no response {previous!r} is stored for you (it may have been "
                             "dropped, or stored with store: false)", status=404,
                             code="previous_response_not_found",
                             param="previous_response_id")
        history = found
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object", param="metadata")
    try:
        chat, items = chat_request(body, history)
        chat_in = chat_inputs(chat, own_user=is_own_user(identity))
        prompt, images = await off_loop(request, chat_prompt, svc, chat_in)
        grammar = await constraint(svc, chat, chat_in.forced)
    except BadRequest as exc:
        raise renamed(exc) from None
    reading = ReplyReading.for_chat(svc, body, chat_in.tools, prompt)
    grammar = await reading.budgeted(svc, body, grammar)
    params = await off_loop(request, generation_params, svc, body, max_key="max_output_tokens")
    check_fits(svc, prompt, "input")
    keep = get(body, "store", bool, True)
    rid = new_id("resp")
    conversation = history + items

    def kept(output: list[dict[str, Any]]) -> None:
        store.put(identity, rid, conversation + input_items(output))

    echo = {"instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata or {},
            "parallel_tool_calls": chat["parallel_tool_calls"],
            "previous_response_id": previous, "reasoning": body.get("reasoning"),
            "store": keep, "temperature": params.sampling.temperature,
            "top_p": params.sampling.top_p, "text": body.get("text") or {
                "format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "truncation": "disabled",
            "user": body.get("user")}
    reply = ResponseReply(rid, svc.model_name, echo, names=chat_in.names,
                          reading=reading,
                          keep=kept if keep else None)
    if not get(body, "stream", bool, False):
        [result] = await collect(request, svc, prompt, [params], grammar=grammar,
                                 images=images)
        return json_response(reply.whole(result))
    streams = submit_all(svc, prompt, [params], grammar=grammar, images=images,
                         progress=get(body, "return_progress", bool, False),
                         timings=get(body, "timings_per_token", bool, False))
    return await stream_events(request, streams, reply)
