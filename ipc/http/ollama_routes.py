"""Ollama's dialect: /api/chat and /api/generate, translated into what the shared layer
takes (ollama_requests) and answered as Ollama's JSON, or its NDJSON stream."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Piece, ProgressEvent, Result
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import MEDIA_MARKER, PromptImage
from specd.daemon.text.reply_delta import ReplyDelta
from specd.daemon.text.tool_calls import ToolCall

from ..jsonout import json_response
from ..validation import BadRequest, get, json_body, stop_list, token_list
from .chat_inputs import chat_inputs, chat_prompt
from .media_inputs import chat_images, image_prompt
from .ollama_requests import (
    chat_body,
    image_parts,
    keep_alive,
    sampling_fields,
    served_model,
    timestamp,
    with_images,
)
from .parsing import (
    check_fits,
    constraint,
    generation_params,
    infill_prompt,
    prompt_tokens,
)
from .reply_reading import ReplyReading
from .state import off_loop, served
from .streaming import NDJSON, collect, stream_events, submit_all


async def _loaded(svc: ServiceFacade, name: str, alive: float | None, *,
                  chat: bool) -> web.Response:
    """Ollama's answer to a request with nothing to generate: the model loaded and kept
    for `alive` once idle, or with keep_alive 0 unloaded (once nothing runs on it)."""
    if alive == 0:
        svc.unload()
    else:
        try:
            await svc.load(alive)
        except RuntimeError as exc:
            raise BadRequest(str(exc), status=500) from None
    out: dict[str, Any] = {"model": name, "created_at": timestamp(), "done": True,
                           "done_reason": "unload" if alive == 0 else "load"}
    out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return json_response(out)


# -- the routes ---------------------------------------------------------------------------
async def chat(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    svc = await served(request, body)
    name = served_model(svc, body)
    alive = keep_alive(body)
    if not body.get("messages"):
        return await _loaded(svc, name, alive, chat=True)
    chat_in = chat_inputs(chat_body(body))
    prompt, images = await off_loop(request, chat_prompt, svc, chat_in)
    fields, params = await _settings(request, svc, body)
    reply = OllamaReply(name, chat=True, names=chat_in.names,
                        reading=ReplyReading.for_chat(svc, body, chat_in.tools, prompt))
    return await _answer(request, svc, body, fields, params, prompt, reply, chat_in.forced,
                         keep_alive=alive, images=images)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    svc = await served(request, body)
    name = served_model(svc, body)
    alive = keep_alive(body)
    images = image_parts(body, "images")
    if get(body, "template", str, ""):
        raise BadRequest("'template' is not supported: specd writes prompts with the model's "
                         "own chat template (or none, with raw)", param="template")
    text, suffix = get(body, "prompt", str, ""), get(body, "suffix", str, "")
    context = body.get("context") or []
    if not text and not suffix and not context:
        return await _loaded(svc, name, alive, chat=False)
    fields, params = await _settings(request, svc, body)
    held: tuple[PromptImage, ...] = ()  # the prompt's images, at their placeholders
    reading = None  # (a raw prompt, or a fill in the middle, is not a chat's reply)
    if images and (suffix or context):
        raise BadRequest("'images' go with a prompt, not with 'suffix' or 'context'",
                         param="images")
    if suffix:  # fill in the middle, as llama.cpp's /infill
        prompt = await off_loop(request, infill_prompt, svc,
                                {"input_prefix": text, "input_suffix": suffix},
                                params.max_tokens)
    elif get(body, "raw", bool, False):
        if images:  # the images first, each at its marker, then the text
            _, files = chat_images([{"role": "user", "content": images}], own_user=False)
            prompt, held = await off_loop(request, image_prompt, svc,
                                          MEDIA_MARKER * len(files) + text, files, "images")
        else:
            prompt = await off_loop(request, prompt_tokens, svc, text)
    else:
        system = get(body, "system", str, "")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": with_images(text, images)}]
        prompt, held = await off_loop(request, chat_prompt, svc,
                                      chat_inputs({"messages": messages}))
        reading = ReplyReading.for_chat(svc, body, None, prompt)
    if context:  # an earlier answer's `context`: the conversation so far
        prompt = token_list(context, "context", svc.tokenizer.vocab_size) + prompt
    # (a forwarded chat, or one holding images, has no token ids to return)
    reply = OllamaReply(name, chat=False, context=prompt if isinstance(prompt, list)
                        and not held else None, reading=reading)
    return await _answer(request, svc, body, fields, params, prompt, reply, keep_alive=alive,
                         images=held)


async def _settings(request: web.Request, svc: ServiceFacade, body: dict[str, Any]
                    ) -> tuple[dict[str, Any], GenerationParams]:
    """(the request's settings as the shared parsers' fields, its generation settings)."""
    fields = sampling_fields(body)
    return fields, await off_loop(request, generation_params, svc, fields,
                                  max_key="num_predict")


async def _answer(request: web.Request, svc: ServiceFacade, body: dict[str, Any],
                  fields: dict[str, Any], params: GenerationParams, prompt: list[int],
                  reply: OllamaReply, forced: str | None = None, *,
                  keep_alive: float | None = None, images: tuple[PromptImage, ...] = ()
                  ) -> web.StreamResponse:
    """The generation, whole as one JSON object or streamed as NDJSON (Ollama's default);
    the model stays loaded for `keep_alive` once idle after it; `images`: the prompt's."""
    kw = dict(stop=stop_list(fields),
              grammar=await reply.reading.budgeted(svc, body,
                                                   await constraint(svc, fields, forced)),
              keep_alive=keep_alive, images=images)
    check_fits(svc, prompt, "messages" if reply.chat else "prompt")
    if not get(body, "stream", bool, True):
        return json_response(reply.whole((await collect(request, svc, prompt, [params],
                                                        **kw))[0]))
    streams = submit_all(svc, prompt, [params], **kw)  # a full queue: a 503 before any byte
    return await stream_events(request, streams, reply, NDJSON)


# -- the answer ---------------------------------------------------------------------------
def _ns(ms: Any) -> int:
    return int(round(float(ms or 0) * 1e6))


def _ollama_call(call: ToolCall) -> dict[str, Any]:
    """A tool call as Ollama gives it: its arguments an object, not JSON text."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"function": {"name": call.name,
                         "arguments": arguments if isinstance(arguments, dict) else {}}}


class OllamaReply:
    """One /api/chat or /api/generate answer: whole, or as Ollama's stream of deltas ending
    with a `done` object that carries the counts and durations (streaming.EventWriter).
    The reply is read by `reading` (reply_reading; None: its text as it comes): reasoning
    the template tells apart is the `thinking` field as it is written; with tool `names`,
    text that may be a tool call is held back and the calls come whole in one object
    before the last. `context`: the prompt, returned with the reply's tokens (generate's
    `context`)."""

    def __init__(self, model: str, *, chat: bool, names: set[str] | None = None,
                 context: list[int] | None = None, reading: ReplyReading | None = None):
        self.model, self.chat, self.names, self.context = model, chat, names, context
        self.reading = reading or ReplyReading(None, None)
        self._reader = self.reading.stream(names)

    def _piece(self, text: str, done: bool = False, thinking: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        out.update({"message": {"role": "assistant", "content": text}} if self.chat
                   else {"response": text})
        if thinking:
            (out["message"] if self.chat else out)["thinking"] = thinking
        out["done"] = done
        return out

    def _calls(self, calls: list[ToolCall]) -> dict[str, Any]:
        out = self._piece("")
        out["message"]["tool_calls"] = [_ollama_call(c) for c in calls]
        return out

    def _done(self, r: Result, text: str = "", thinking: str = "") -> dict[str, Any]:
        t = r.timings
        out = {**self._piece(text, done=True, thinking=thinking),
               "done_reason": "length" if r.finish_reason in ("length", "time_limit")
               else "stop",
               "total_duration": _ns(t.get("total_ms")), "load_duration": 0,
               "prompt_eval_count": r.prompt_tokens,
               "prompt_eval_duration": _ns(t.get("prompt_ms")),
               "eval_count": r.completion_tokens, "eval_duration": _ns(t.get("predicted_ms"))}
        if self.context is not None:
            out["context"] = self.context + r.tokens
        return out

    def whole(self, r: Result) -> dict[str, Any]:
        parsed = self.reading.parse(r.text, self.names)
        out = self._done(r, parsed.content or "", parsed.reasoning or "")
        if parsed.calls:
            out["message"]["tool_calls"] = [_ollama_call(c) for c in parsed.calls]
        return out

    # -- streamed (streaming.EventWriter) -------------------------------------------------
    def opening(self) -> list[Any]:
        return []

    def _delta(self, delta: ReplyDelta) -> list[Any]:
        return [self._piece(delta.content, thinking=delta.reasoning)] if delta else []

    def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
        if isinstance(ev, ProgressEvent):
            return []
        return self._delta(self._reader.feed(ev.text))

    def failing(self, index: int) -> list[Any]:
        held = self._reader.held()
        return [self._piece(held)] if held else []

    def finished(self, index: int, result: Result) -> list[Any]:
        rest, calls = self._reader.finish()
        out = self._delta(rest)
        if calls:
            out.append(self._calls(calls))
        return out + [self._done(result)]

    def closing(self) -> list[Any]:
        return []
