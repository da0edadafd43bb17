"""Anthropic's dialect: /v1/messages and /v1/messages/count_tokens, as Claude Code
(through ANTHROPIC_BASE_URL) and the anthropic SDK speak it. The request is read as a
chat request (anthropic_inputs) and runs as one; the answer is Anthropic's message
object, or its stream of named events, and errors come in Anthropic's shape.

Where the template's chat format tells the model's reasoning apart (reply_reading), the
reasoning comes first as a `thinking` block, its `signature` empty (nothing local signs
it; a client passes it back and it is read as the assistant's reasoning)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Piece, ProgressEvent, Result
from specd.daemon.serving.upstream_facade import UpstreamFacade
from specd.daemon.text.reply_delta import ReplyDelta
from specd.daemon.text.reply_stream import ReplyStream
from specd.daemon.text.tool_calls import ToolCall

from ..jsonout import json_response
from ..validation import get, json_body, stop_list
from .anthropic_inputs import chat_body, max_tokens, sampling_body, stop_body
from .chat_inputs import chat_inputs, chat_prompt
from .parsing import check_fits, check_model, constraint, generation_params
from .reply_reading import ReplyReading
from .state import off_loop, served
from .streaming import Named, collect, stream_events, submit_all

# Anthropic's error types by HTTP status (a 4xx not named: invalid_request_error)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    """An error as Anthropic's API sends it (security.ErrorShape)."""
    etype = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": message}}


async def messages(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    svc = await served(request, body)
    check_model(request, body)
    limit = max_tokens(body)
    translated = chat_body(body)
    chat = chat_inputs(translated)
    prompt, images = await off_loop(request, chat_prompt, svc, chat)
    params = await off_loop(request, generation_params, svc,
                            sampling_body(body, max_tokens=limit), max_key="max_tokens")
    stop = stop_list(stop_body(body))
    # llama.cpp's own constraint fields (grammar, json_schema, ...) as its routes take them
    reading = ReplyReading.for_chat(svc, body, chat.tools, prompt)
    grammar = await reading.budgeted(svc, translated,
                                     await constraint(svc, body, chat.forced))
    check_fits(svc, prompt, "messages")
    # an upstream's model counts its prompt itself: known once it answers
    reply = _Reply(svc, names=chat.names, reading=reading,
                   prompt_tokens=len(prompt) if isinstance(prompt, list) else 0)
    if not get(body, "stream", bool, False):
        results = await collect(request, svc, prompt, [params], stop=stop, grammar=grammar,
                                images=images)
        return json_response(reply.whole(results[0]))
    streams = submit_all(svc, prompt, [params], stop=stop, grammar=grammar, images=images)
    return await stream_events(request, streams, reply)


async def count_tokens(request: web.Request) -> web.Response:
    """How many tokens the request's prompt is, rendered as /v1/messages renders it."""
    body = await json_body(request)
    svc = await served(request, body, wake=True)
    check_model(request, body)
    if isinstance(svc, UpstreamFacade):
        svc.unsupported("count_tokens")
    chat = chat_inputs(chat_body(body))
    prompt, _ = await off_loop(request, chat_prompt, svc, chat)
    return json_response({"input_tokens": len(prompt)})


def _stop(r: Result, called: bool) -> dict[str, Any]:
    """The message's stop_reason and stop_sequence."""
    if called:
        reason = "tool_use"
    elif r.stopping_word:
        reason = "stop_sequence"
    elif r.finish_reason in ("length", "time_limit"):
        reason = "max_tokens"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": r.stopping_word or None}


def _usage(r: Result) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache
    (a slot's cached prefix counts as cache_read_input_tokens)."""
    return {"input_tokens": r.prompt_tokens - r.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": r.cached_tokens,
            "output_tokens": r.completion_tokens}


def _thinking(reasoning: str) -> dict[str, Any]:
    """A thinking block (its signature empty: nothing local signs it)."""
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def _tool_id(call_id: str) -> str:
    """A call's id as a tool_use block's."""
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a tool_use block: its input an object (arguments that are not one, as
    models rarely write them, under "value")."""
    args = json.loads(call.arguments)
    return {"type": "tool_use", "id": _tool_id(call.id),
            "name": call.name, "input": args if isinstance(args, dict) else {"value": args}}


class _Reply:
    """One request's message, whole or as Anthropic streams it (streaming.EventWriter):
    message_start; each block's content_block_start, its deltas and content_block_stop
    (thinking and text as they come, each a block of its own, then each tool_use with its
    input as input_json_delta pieces as the format streams them, else as one);
    message_delta with the stop reason and usage; message_stop. The reply is read by the
    template's reader (reply_reading): with tool `names`, text that may be a call is held
    back and the calls come at the end."""

    def __init__(self, svc: ServiceFacade, *, names: set[str] | None, prompt_tokens: int,
                 reading: ReplyReading | None = None):
        self.names, self.prompt_tokens = names, prompt_tokens
        self.reading = reading or ReplyReading(None, None)
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = svc.model_name
        self._reader: ReplyStream | None = None
        self._open: int | None = None  # the index of the block being streamed
        self._open_kind = ""  # its type: "thinking", "text" or "tool_use"
        self._streamed: set[str] = set()  # the ids of the calls streamed piece by piece
        self._blocks = 0  # blocks started so far

    def _message(self, content: list[dict[str, Any]], stop: dict[str, Any],
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, **stop, "usage": usage}

    # -- whole ----------------------------------------------------------------------------
    def whole(self, r: Result) -> dict[str, Any]:
        parsed = self.reading.parse(r.text, self.names)
        blocks = [_thinking(parsed.reasoning)] if parsed.reasoning else []
        blocks += [{"type": "text", "text": parsed.content}] if parsed.content else []
        return self._message(blocks + [_tool_use(c) for c in parsed.calls],
                             _stop(r, bool(parsed.calls)), _usage(r))

    # -- streamed -------------------------------------------------------------------------
    @staticmethod
    def _event(name: str, **fields: Any) -> Named:
        return Named(name, {"type": name, **fields})

    def _start(self, block: dict[str, Any]) -> tuple[int, Named]:
        """A new block's index and its content_block_start."""
        index, self._blocks = self._blocks, self._blocks + 1
        return index, self._event("content_block_start", index=index, content_block=block)

    def _text(self, text: str, kind: str = "text") -> list[Any]:
        """The events carrying `text` in a block of type `kind` ("text" or "thinking"):
        the block opened first, if it is not (closing another that is)."""
        if not text:
            return []
        out = []
        if self._open is not None and self._open_kind != kind:
            out += self._close_text()
        if self._open is None:
            block = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
            self._open, start = self._start(block)
            self._open_kind = kind
            out.append(start)
        delta = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                 else {"type": "text_delta", "text": text})
        return out + [self._event("content_block_delta", index=self._open, delta=delta)]

    def _close_text(self) -> list[Any]:
        """The open block's end (a thinking block's signature, as a signature_delta just
        before its content_block_stop, as Anthropic streams one)."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        out = [self._event("content_block_delta", index=index,
                           delta={"type": "signature_delta", "signature": ""})
               ] if self._open_kind == "thinking" else []
        return out + [self._event("content_block_stop", index=index)]

    def _delta(self, delta: ReplyDelta) -> list[Any]:
        out = self._text(delta.reasoning, "thinking") + self._text(delta.content)
        for c in delta.calls:  # a call streamed: its tool_use block, its input in pieces
            if c.id is not None and c.name is not None:
                out += self._close_text()
                self._streamed.add(c.id)
                self._open, start = self._start({"type": "tool_use", "id": _tool_id(c.id),
                                                 "name": c.name, "input": {}})
                self._open_kind = "tool_use"
                out.append(start)
            if c.arguments and self._open is not None:
                out.append(self._event("content_block_delta", index=self._open, delta={
                    "type": "input_json_delta", "partial_json": c.arguments}))
        return out

    def opening(self) -> list[Any]:
        self._reader = self.reading.stream(self.names)
        start = self._message([], {"stop_reason": None, "stop_sequence": None},
                              {"input_tokens": self.prompt_tokens, "output_tokens": 0})
        return [self._event("message_start", message=start)]

    def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
        if isinstance(ev, ProgressEvent) or self._reader is None:
            return []
        return self._delta(self._reader.feed(ev.text))

    def failing(self, index: int) -> list[Any]:
        return self._text(self._reader.held() if self._reader is not None else "") + (
            self._close_text())

    def finished(self, index: int, result: Result) -> list[Any]:
        rest, calls = self._reader.finish() if self._reader is not None else (ReplyDelta(), [])
        out = self._delta(rest) + self._close_text()
        for call in (c for c in calls if c.id not in self._streamed):
            block = _tool_use(call)
            i, start = self._start({**block, "input": {}})
            out += [start,
                    self._event("content_block_delta", index=i, delta={
                        "type": "input_json_delta",
                        "partial_json": json.dumps(block["input"], ensure_ascii=False)}),
                    self._event("content_block_stop", index=i)]
        return out + [self._event("message_delta", delta=_stop(result, bool(calls)),
                                  usage=_usage(result)),
                      self._event("message_stop")]

    def closing(self) -> list[Any]:
        return []

    def error(self, message: str, status: int) -> list[Any]:
        return [Named("error", error_body(status, message, "", None))]
