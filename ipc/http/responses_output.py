"""The Responses API's answer: the response object, whole or as the typed `response.*`
events that stream it (each with its `event:` line and sequence_number)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from specd.daemon.serving.service import Piece, ProgressEvent, Result
from specd.daemon.text.reply_delta import ReplyDelta
from specd.daemon.text.reply_stream import ReplyStream
from specd.daemon.text.tool_calls import ToolCall

from .reply_reading import ReplyReading
from .reporting import spec_block
from .streaming import Named, timed

INCOMPLETE = ("length", "time_limit")  # finish reasons that leave a response incomplete


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _reasoning(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning item, its text as one reasoning_text part, as llama-server writes it."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}],
            "encrypted_content": ""}


def _call(item_id: str, call: ToolCall, status: str, arguments: str | None = None
          ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": status}


def usage(r: Result) -> dict[str, Any]:
    return {"input_tokens": r.prompt_tokens,
            "input_tokens_details": {"cached_tokens": r.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": r.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "speculative": spec_block(r)}


class ResponseReply:
    """One response: built whole from a result, or streamed as events (an EventWriter
    of one stream). `echo`: the request's settings the response repeats (instructions,
    tools, text, ...); `names`: the tools whose calls the reply is read for; `reading`:
    how (reply_reading: reasoning the template tells apart is a reasoning item before
    the message); `keep`: told the output items once the response is complete, before
    the client is."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], *,
                 names: set[str] | None, reading: ReplyReading | None = None,
                 keep: Callable[[list[dict[str, Any]]], None] | None = None):
        self.id, self.model, self.echo, self.names, self.keep = (response_id, model, echo,
                                                                 names, keep)
        self.reading = reading or ReplyReading(None, None)
        self.created_at = int(time.time())
        self._seq = 0
        self._reader: ReplyStream = self.reading.stream(names)
        self._output: list[dict[str, Any]] = []  # the items done
        self._thought: str | None = None  # the id of the reasoning item being streamed
        self._reasoning = ""  # its text so far
        self._msg_done = False  # the message's item is done
        self._fc: tuple[str, ToolCall] | None = None  # the streamed call's item id, call
        self._fc_args = ""  # its arguments so far
        self._streamed: set[str] = set()  # the ids of the calls streamed piece by piece
        self._msg: str | None = None  # the id of the message being streamed
        self._text = ""  # its text so far

    def response(self, status: str, output: list[dict[str, Any]],
                 result: Result | None = None, error: str | None = None) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output,
                "error": None if error is None else {"code": "server_error",
                                                     "message": error},
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": None if result is None else usage(result),
                **self.echo}

    # -- whole ----------------------------------------------------------------------------
    def whole(self, r: Result) -> dict[str, Any]:
        status = _status(r)
        parsed = self.reading.parse(r.text, self.names)
        content, calls = parsed.content, parsed.calls
        output = [] if parsed.reasoning is None else [
            _reasoning(new_id("rs"), parsed.reasoning, "completed")]
        output += [] if content is None and calls else [
            _message(new_id("msg"), content or "", status)]
        output += [_call(new_id("fc"), c, "completed") for c in calls]
        if self.keep is not None:
            self.keep(output)
        return {**self.response(status, output, r), "timings": r.timings}

    # -- streamed (streaming.EventWriter) -------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Named:
        ev = Named(kind, {"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return ev

    def opening(self) -> list[Any]:
        return [self._event(k, response=self.response("in_progress", []))
                for k in ("response.created", "response.in_progress")]

    def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
        if isinstance(ev, ProgressEvent):  # return_progress, as llama-server sends it
            return [self._event("response.in_progress",
                                response=self.response("in_progress", []),
                                prompt_progress=ev.as_json(), **timed(ev.timings))]
        return self._delta(self._reader.feed(ev.text), ev.timings)

    def _delta(self, delta: ReplyDelta, timings: dict[str, Any] | None = None
               ) -> list[Named]:
        out = self._thinking(delta.reasoning, timings) + self._text_delta(delta.content,
                                                                          timings)
        for c in delta.calls:  # a call streamed: its item, its arguments in pieces
            if c.id is not None and c.name is not None:
                out += self._start_call(ToolCall(c.name, "", c.id))
            if c.arguments and self._fc is not None:
                self._fc_args += c.arguments
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self._fc[0], output_index=len(self._output),
                                       delta=c.arguments))
        return out

    def _start_call(self, call: ToolCall) -> list[Named]:
        """A streamed call's item added (the items before it done)."""
        out = self._close_thinking() + self._close_call()
        if self._msg is not None and not self._msg_done:
            out += self._close_message("completed")
        self._fc, self._fc_args = (new_id("fc"), call), ""
        self._streamed.add(call.id)
        return out + [self._event("response.output_item.added",
                                  output_index=len(self._output),
                                  item=_call(self._fc[0], call, "in_progress", ""))]

    def _close_call(self) -> list[Named]:
        """The streamed call's item done, its arguments as they came."""
        if self._fc is None:
            return []
        (item_id, call), args, at = self._fc, self._fc_args, len(self._output)
        self._fc = None
        item = _call(item_id, call, "completed", args)
        self._output.append(item)
        return [self._event("response.function_call_arguments.done", item_id=item_id,
                            output_index=at, name=call.name, arguments=args),
                self._event("response.output_item.done", output_index=at, item=item)]

    def _thinking(self, text: str, timings: dict[str, Any] | None) -> list[Named]:
        """The reasoning item's events carrying `text` (the item added first)."""
        if not text:
            return []
        out: list[Named] = []
        if self._thought is None:
            self._thought = new_id("rs")
            out.append(self._event("response.output_item.added", output_index=len(self._output),
                                   item=_reasoning(self._thought, None, "in_progress")))
        self._reasoning += text
        return out + [self._event("response.reasoning_text.delta", item_id=self._thought,
                                  output_index=len(self._output), content_index=0,
                                  delta=text, **timed(timings))]

    def _close_thinking(self) -> list[Named]:
        """The reasoning item's end, before any other item starts."""
        if self._thought is None or (self._output and self._output[-1]["id"] == self._thought):
            return []
        at, text = len(self._output), self._reasoning
        item = _reasoning(self._thought, text, "completed")
        self._output.append(item)
        return [self._event("response.reasoning_text.done", item_id=self._thought,
                            output_index=at, content_index=0, text=text),
                self._event("response.output_item.done", output_index=at, item=item)]

    def _text_delta(self, text: str, timings: dict[str, Any] | None = None) -> list[Named]:
        if not text:
            return []
        out = self._open_message()
        self._text += text
        out.append(self._event("response.output_text.delta", item_id=self._msg,
                               output_index=len(self._output), content_index=0,
                               delta=text, logprobs=[], **timed(timings)))
        return out

    def _open_message(self) -> list[Named]:
        if self._msg is not None:
            return []
        out = self._close_thinking() + self._close_call()
        self._msg = new_id("msg")
        at = len(self._output)
        return out + [self._event("response.output_item.added", output_index=at,
                                  item=_message(self._msg, None, "in_progress")),
                      self._event("response.content_part.added", item_id=self._msg,
                                  output_index=at, content_index=0, part=_text_part(""))]

    def _close_message(self, status: str) -> list[Named]:
        out = self._open_message()
        assert self._msg is not None
        at, text = len(self._output), self._text
        item = _message(self._msg, text, status)
        out += [self._event("response.output_text.done", item_id=self._msg,
                            output_index=at, content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self._msg,
                            output_index=at, content_index=0, part=_text_part(text)),
                self._event("response.output_item.done", output_index=at, item=item)]
        self._output.append(item)
        self._msg_done = True
        return out

    def _function_call(self, call: ToolCall) -> list[Named]:
        out = self._close_thinking()
        item_id, at = new_id("fc"), len(self._output)
        item = _call(item_id, call, "completed")
        self._output.append(item)
        return out + [self._event("response.output_item.added", output_index=at,
                                  item=_call(item_id, call, "in_progress", "")),
                      self._event("response.function_call_arguments.delta", item_id=item_id,
                                  output_index=at, delta=call.arguments),
                      self._event("response.function_call_arguments.done", item_id=item_id,
                                  output_index=at, name=call.name, arguments=call.arguments),
                      self._event("response.output_item.done", output_index=at, item=item)]

    def failing(self, index: int) -> list[Any]:
        return self._text_delta(self._reader.held())

    def error(self, message: str, code: int) -> list[Any]:
        return [self._event("response.failed",
                            response=self.response("failed", self._output, error=message))]

    def finished(self, index: int, result: Result) -> list[Any]:
        status = _status(result)
        rest, calls = self._reader.finish()
        out = self._delta(rest) + self._close_thinking() + self._close_call()
        if (self._msg is not None and not self._msg_done) or (
                not calls and not self._streamed and self._msg is None):
            out += self._close_message(status)
        for call in calls:
            if call.id not in self._streamed:
                out += self._function_call(call)
        if self.keep is not None:
            self.keep(self._output)
        done = self.response(status, self._output, result)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self._event(kind, response=done, timings=result.timings)]

    def closing(self) -> list[Any]:
        return []


def _status(r: Result) -> str:
    return "incomplete" if r.finish_reason in INCOMPLETE else "completed"
