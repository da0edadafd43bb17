"""OpenAI's dialect: /v1/chat/completions and /v1/completions, with n choices, tool
calls, logprobs and usage as OpenAI's clients read them."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Piece, ProgressEvent, Result
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import PromptImage
from specd.daemon.spec.sampling import TokenLogprob
from specd.daemon.text.reply_delta import ReplyDelta
from specd.daemon.text.reply_stream import ReplyStream

from ..jsonout import json_response
from ..security import IDENTITY, is_own_user
from ..validation import BadRequest, get, json_body, stop_list
from .chat_inputs import chat_inputs, chat_prompt
from .parsing import (
    check_fits,
    check_model,
    constraint,
    generation_params,
    prompt_tokens,
    unsupported,
)
from .reply_reading import ReplyReading
from .reporting import openai_logprobs, spec_block
from .state import SYSTEM_FINGERPRINT, off_loop, served
from .streaming import collect, stream_events, submit_all, timed

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_CHOICES = 16  # n: choices of one request


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=False)


def _logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    """How many top tokens to report with each token's logprob (None: no logprobs):
    chat's `logprobs: true` with `top_logprobs`, the completions API's `logprobs: k`."""
    if not chat:
        return get(body, "logprobs", int, None, lo=0, hi=MAX_TOP_LOGPROBS)
    top = get(body, "top_logprobs", int, None, lo=0, hi=MAX_TOP_LOGPROBS)
    if not get(body, "logprobs", bool, False):
        if top:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def _finish(reason: str) -> dict[str, str]:
    """A choice's finish fields: OpenAI's `finish_reason` (only its values: clients
    switch on them) and specd's own reason as `finish_detail` (time_limit,
    grammar_dead_end, cancelled, ...)."""
    oai = "length" if reason in ("length", "time_limit") else "stop"
    return {"finish_reason": oai, "finish_detail": reason}


def _usage(*results: Result) -> dict[str, Any]:
    """OpenAI's usage of one request's choices: the prompt once, every choice's tokens."""
    r = results[0]
    completion = sum(x.completion_tokens for x in results)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": completion,
            "total_tokens": r.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
            "speculative": spec_block(r)}


def _nth_choice(params: GenerationParams, i: int) -> GenerationParams:
    """The settings of choice i of n: the request's, seeded seed + i where seeded."""
    seed = params.sampling.seed
    return replace(params, sampling=replace(
        params.sampling, seed=None if seed is None else (seed + i) % (1 << 63)))


async def _openai(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await json_body(request)
    svc = await served(request, body)
    check_model(request, body)
    unsupported(body, () if chat else ("echo", "suffix", "best_of"))
    names: set[str] | None = None  # the request's tools, when calls are parsed
    forced: str | None = None  # a grammar making the reply calls (tool_choice)
    tools: list[dict[str, Any]] | None = None
    images: tuple[PromptImage, ...] = ()  # the prompt's, at their placeholders
    if chat:
        chat_in = chat_inputs(body, own_user=is_own_user(request.get(IDENTITY, "")))
        names, forced, tools = chat_in.names, chat_in.forced, chat_in.tools
        prompt, images = await off_loop(request, chat_prompt, svc, chat_in)
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompt = await off_loop(request, prompt_tokens, svc, body["prompt"])
    params = await off_loop(request, generation_params, svc, body, max_key="max_tokens")
    params.logprobs = _logprobs_asked(body, chat)
    params.post_sampling_probs = (get(body, "post_sampling_probs", bool, False)
                                  and params.logprobs is not None)
    if chat and "max_completion_tokens" in body:
        params.max_tokens = get(body, "max_completion_tokens", int, params.max_tokens, lo=0)
    stop = stop_list(body)
    grammar = await constraint(svc, body, forced)
    reading = ReplyReading.for_chat(svc, body, tools, prompt) if chat else None
    if reading is not None:
        grammar = await reading.budgeted(svc, body, grammar)
    check_fits(svc, prompt, "messages" if chat else "prompt")
    # n choices: n requests on the same prompt (each slot reuses what its cache holds),
    # seeded seed, seed + 1, ... where a seed is given
    n = get(body, "n", int, 1, lo=1, hi=MAX_CHOICES)
    choices = [params if i == 0 else _nth_choice(params, i) for i in range(n)]
    reply = _Reply(svc, chat=chat, names=names, logprobs=params.logprobs is not None,
                   post=params.post_sampling_probs, reading=reading)
    if not get(body, "stream", bool, False):
        results = await collect(request, svc, prompt, choices, stop=stop, grammar=grammar,
                                images=images)
        return json_response(reply.whole(results))
    options = body.get("stream_options")
    reply.include_usage = isinstance(options, dict) and options.get("include_usage") is True
    streams = submit_all(svc, prompt, choices, stop=stop, grammar=grammar, images=images,
                         progress=get(body, "return_progress", bool, False),
                         timings=get(body, "timings_per_token", bool, False))
    reply.n_streams = len(streams)
    return await stream_events(request, streams, reply)


class _ChoiceState:
    """One streamed choice: its reply's reader (what may be a tool call or a tag held
    back), logprobs not yet sent."""

    def __init__(self, index: int, reader: ReplyStream | None):
        self.index = index
        self.reader = reader  # (None: a completion's text, passed on as it comes)
        self.streamed: set[str] = set()  # the ids of the calls streamed piece by piece
        self.logprobs: list[TokenLogprob] = []  # of tokens no chunk has carried yet
        self.texts: list[str] = []
        self.offset = 0  # the text sent so far (completions' text_offset)


class _Reply:
    """One request's answer, whole or as chunks as OpenAI streams them, each choice's
    with its index (several choices interleave).

    Streamed, the usage is sent once: with stream_options.include_usage in OpenAI's own
    last chunk, whose choices are empty, else on the last finishing chunk (where older
    llama.cpp servers put it). With tool `names`, text that may be a tool call is held
    back, and the calls come whole in one chunk before the finishing one; reasoning the
    chat format tells apart comes as `reasoning_content` deltas as it is written. With
    `logprobs`, each chunk carries those of the tokens that came since the choice's last
    chunk (text held back keeps its tokens' logprobs for a later one); `post`: as
    post-sampling probabilities (`openai_logprobs`)."""

    def __init__(self, svc: ServiceFacade, *, chat: bool, names: set[str] | None,
                 logprobs: bool, post: bool, reading: ReplyReading | None = None):
        self.svc, self.chat, self.names = svc, chat, names
        self.reading = reading or ReplyReading(None, None)
        self.logprobs, self.post = logprobs, post
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = svc.model_name
        self.include_usage = False
        self.n_streams = 1
        self._states: list[_ChoiceState] = []
        self._results: list[Result] = []

    def _head(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}

    # -- whole ----------------------------------------------------------------------------
    def whole(self, results: list[Result]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            choice: dict[str, Any] = {"index": i, **_finish(r.finish_reason),
                                      "logprobs": None}
            if self.logprobs:
                choice["logprobs"] = openai_logprobs(self.svc, r.logprobs, r.texts, 0,
                                                     chat=self.chat, post=self.post)
            if self.chat:
                parsed = self.reading.parse(r.text, self.names)
                choice["message"] = {"role": "assistant", "content": parsed.content}
                if parsed.reasoning is not None:
                    choice["message"]["reasoning_content"] = parsed.reasoning
                if parsed.calls:
                    choice["message"]["tool_calls"] = [c.as_openai() for c in parsed.calls]
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = r.text
            choices.append(choice)
        return {**self._head("chat.completion" if self.chat else "text_completion", choices),
                "usage": _usage(*results), "timings": results[0].timings}

    # -- streamed (streaming.EventWriter) -------------------------------------------------
    def _chunk(self, st: _ChoiceState, delta: str | None,
               finish: dict[str, str] | None = None, first: bool = False,
               reasoning: str = "") -> dict[str, Any]:
        c: dict[str, Any] = {"index": st.index, "finish_reason": None, **(finish or {}),
                             "logprobs": None}
        if self.logprobs and st.logprobs and not first:
            c["logprobs"] = openai_logprobs(self.svc, st.logprobs, st.texts, st.offset,
                                            chat=self.chat, post=self.post)
            st.offset += sum(len(t) for t in st.texts)
            st.logprobs, st.texts = [], []
        if self.chat:
            c["delta"] = ({"role": "assistant", "content": delta or ""} if first
                          else ({"content": delta} if delta else {}))
            if reasoning:
                c["delta"]["reasoning_content"] = reasoning
        else:
            c["text"] = delta or ""
        return self._head("chat.completion.chunk" if self.chat else "text_completion", [c])

    def _delta(self, st: _ChoiceState, delta: ReplyDelta,
               timings: dict[str, Any] | None = None) -> list[Any]:
        """The chunks carrying a reply's delta (none for an empty one): its reasoning and
        content, then its calls' pieces (a call's id and name first, as OpenAI streams
        them)."""
        out = []
        if delta.reasoning or delta.content:
            out.append({**self._chunk(st, delta.content, reasoning=delta.reasoning),
                        **timed(timings)})
        if delta.calls:
            pieces = []
            for c in delta.calls:
                fn: dict[str, Any] = {"arguments": c.arguments}
                piece: dict[str, Any] = {"index": c.index, "function": fn}
                if c.id is not None:
                    st.streamed.add(c.id)
                    fn["name"] = c.name
                    piece.update(id=c.id, type="function")
                pieces.append(piece)
            called = self._chunk(st, None)
            called["choices"][0]["delta"] = {"tool_calls": pieces}
            out.append(called)
        return out

    def opening(self) -> list[Any]:
        self._states = [_ChoiceState(i, self.reading.stream(self.names) if self.chat else None)
                        for i in range(self.n_streams)]
        return [self._chunk(st, "", first=True) for st in self._states] if self.chat else []

    def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
        st = self._states[index]
        if isinstance(ev, ProgressEvent):  # return_progress
            return [{**self._chunk(st, None), "prompt_progress": ev.as_json(),
                     **timed(ev.timings)}]
        st.logprobs.extend(ev.logprobs)
        st.texts.extend(ev.texts)
        if st.reader is None:
            return [{**self._chunk(st, ev.text), **timed(ev.timings)}] if ev.text else []
        return self._delta(st, st.reader.feed(ev.text), ev.timings)

    def failing(self, index: int) -> list[Any]:
        st = self._states[index]
        held = st.reader.held() if st.reader is not None else ""
        return [self._chunk(st, held)] if held else []

    def finished(self, index: int, result: Result) -> list[Any]:
        st = self._states[index]
        self._results.append(result)
        out: list[Any] = []
        finish = _finish(result.finish_reason)
        if st.reader is not None:
            rest, calls = st.reader.finish()
            out += self._delta(st, rest)
            whole = [c.as_openai(k) for k, c in enumerate(calls) if c.id not in st.streamed]
            if whole:  # calls not streamed piece by piece: each whole
                called = self._chunk(st, None)
                called["choices"][0]["delta"] = {"tool_calls": whole}
                out.append(called)
            if calls:
                finish["finish_reason"] = "tool_calls"
        final = self._chunk(st, None, finish)
        results = self._results
        if len(results) < self.n_streams:
            out.append(final)
        elif self.include_usage:  # the timings ride on the last chunk, as llama-server's
            out += [final, {**final, "choices": [], "usage": _usage(*results),
                            "timings": results[0].timings}]
        else:
            out.append({**final, "usage": _usage(*results), "timings": results[0].timings})
        return out

    def closing(self) -> list[Any]:
        return ["[DONE]"]
