"""The HTTP API: OpenAI-compatible and llama.cpp-compatible routes over one Service."""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib.metadata
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.scheduler import QueueFull
from specd.daemon.serving.service import Piece, ProgressEvent, Result, Service, Stream
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams, RequestError
from specd.daemon.spec.sampling import SamplerParams, TokenLogprob
from specd.daemon.text.grammar import Grammar, GrammarError
from specd.daemon.text.infill import DEFAULT_CHUNK_FILE, ExtraChunk, has_fim, infill_tokens
from specd.daemon.text.tokenizer import Tokenizer
from specd.daemon.text.tool_calls import (
    ToolCallStream,
    check_tools,
    forced_call_grammar,
    parse_tool_calls,
    tool_names,
)

from .jsonout import dumps, json_response
from .metrics import RateWindow, render_metrics
from .security import (
    IDENTITY,
    Access,
    Handler,
    cache_identity,
    cors_on_prepare,
    error_response,
    make_middlewares,
)
from .service_view import LiveRequests
from .validation import (
    BODY_TIMEOUT,
    DEFAULT_BODY_TIMEOUT,
    BadRequest,
    cache_key,
    check_constraint_size,
    check_text_bytes,
    check_tools_size,
    get,
    json_body,
    logit_bias,
    stop_list,
    texts_in,
    token_list,
)


def _fingerprint() -> str:
    """What OpenAI's `system_fingerprint` and llama.cpp's `build_info` say: specd's
    version."""
    try:
        return "specd-" + importlib.metadata.version("specd")
    except importlib.metadata.PackageNotFoundError:
        return "specd"


SYSTEM_FINGERPRINT = _fingerprint()
SERVICE = web.AppKey("service", ServiceFacade)
MAX_BODY = web.AppKey("max_body", int)
MEMORY_PLAN = web.AppKey("memory_plan", object)
STRICT_MODEL_NAME = web.AppKey("strict_model_name", bool)
LIVE = web.AppKey("live_requests", LiveRequests)
PREP = web.AppKey("prep_executor", ThreadPoolExecutor)
RATES = web.AppKey("metrics_rates", RateWindow)  # /metrics' rate gauges: since the last scrape
PREP_THREADS = 4  # requests prepared (tokenized, rendered) at once, off the event loop
MIN_BYTES_PER_TOKEN = 32
T = TypeVar("T")


def _svc(request: web.Request) -> ServiceFacade:
    return request.app[SERVICE]


def _served(request: web.Request, body: dict[str, Any]) -> ServiceFacade:
    """The service as this request's sender uses it: its prompt cache is the sender's own
    (narrowed by the request's `cache_key`), and shutdown can cancel its generation."""
    identity = cache_identity(request.get(IDENTITY, ""), cache_key(body))
    return _svc(request).for_sender(identity, request.app[LIVE])


async def _off_loop(request: web.Request, fn: Callable[..., T], *args: Any,
                    **kw: Any) -> T:
    """`fn(*args, **kw)` on a preparing thread: tokenizing or rendering a big request
    must not stall the event loop (every other client's stream, /health)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[PREP], functools.partial(fn, *args, **kw))


def _prompt_byte_limit(svc: ServiceFacade) -> int:
    """The most bytes of text that can tokenize into the context: each token stands for
    at most the vocabulary's longest token (and no tokenizer here drops characters), so
    longer text cannot fit and is refused before tokenizing."""
    return svc.n_ctx * _bytes_per_token(svc.tokenizer)


@functools.lru_cache(maxsize=8)
def _bytes_per_token(tok: Tokenizer) -> int:
    longest = max((len(tok.token_bytes(i)) for i in range(tok.vocab_size)), default=0)
    return max(MIN_BYTES_PER_TOKEN, longest)


def _check_prompt_bytes(svc: ServiceFacade, value: Any, param: str) -> None:
    check_text_bytes(texts_in(value), _prompt_byte_limit(svc), param)


def _shutting_down(request: web.Request, result: Result) -> bool:
    """Whether the daemon's shutdown cancelled this generation."""
    return request.app[LIVE].draining and result.finish_reason == "cancelled"


SHUTDOWN_MESSAGE = "specd is shutting down: the generation was cancelled"


# -- request parsing ----------------------------------------------------------------------
def _params(svc: ServiceFacade, body: dict[str, Any], *, max_key: str) -> GenerationParams:
    """The request's settings over the daemon's defaults (`specd serve -n / --temp /
    --seed / --ignore-eos ...`, as /props reports them)."""
    d = svc.defaults
    max_tokens = get(body, max_key, int, None, lo=-1, hi=1 << 20)
    if max_tokens is None or max_tokens < 0:
        max_tokens = d.max_tokens
    spec = body.get("speculative") or {}
    if not isinstance(spec, dict):
        raise BadRequest("'speculative' must be an object", param="speculative")
    seed = get(body, "seed", int, d.sampling.seed)
    try:
        sampling = SamplerParams(
            temperature=get(body, "temperature", float, d.sampling.temperature, lo=0, hi=100),
            top_k=get(body, "top_k", int, d.sampling.top_k, lo=0),
            top_p=get(body, "top_p", float, d.sampling.top_p, lo=0, hi=1),
            min_p=get(body, "min_p", float, d.sampling.min_p, lo=0, hi=1),
            repeat_penalty=get(body, "repeat_penalty", float, d.sampling.repeat_penalty, lo=0),
            repeat_last_n=get(body, "repeat_last_n", int, d.sampling.repeat_last_n, lo=-1),
            presence_penalty=get(body, "presence_penalty", float,
                                 d.sampling.presence_penalty),
            frequency_penalty=get(body, "frequency_penalty", float,
                                  d.sampling.frequency_penalty),
            logit_bias=d.sampling.logit_bias if body.get("logit_bias") is None else logit_bias(
                body["logit_bias"],
                lambda text: svc.tokenizer.encode(text, add_bos=False, parse_special=False),
                svc.tokenizer.vocab_size),
            seed=None if seed is None or seed < 0 else seed).validate()
        draft = DraftParams(
            n_max=get(spec, "n_max", int, get(body, "speculative.n_max", int, d.draft.n_max),
                      lo=0, hi=64),
            n_min=get(spec, "n_min", int, get(body, "speculative.n_min", int, d.draft.n_min),
                      lo=0, hi=64),
            p_min=get(spec, "p_min", float, get(body, "speculative.p_min", float,
                                                d.draft.p_min), lo=0, hi=1),
            probabilistic=d.draft.probabilistic).validate()
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    # the draft length (and source) chosen per round from measured costs, or n_max always
    adaptive = get(spec, "adaptive", bool, get(body, "speculative.adaptive", bool, d.adaptive))
    return GenerationParams(max_tokens=max_tokens, sampling=sampling, draft=draft,
                            adaptive=adaptive,
                            ignore_eos=get(body, "ignore_eos", bool, d.ignore_eos),
                            backend_sampling=get(body, "backend_sampling", bool,
                                                 d.backend_sampling))


def _check_model(request: web.Request, body: dict[str, Any]) -> None:
    """Any model name (or none, or "") is served by the loaded model, as llama-server
    does: clients hard-code "gpt-3.5-turbo" or send "" (llama.vim), and responses name
    the model that answered. `--strict-model-name` makes an unknown name a 404."""
    model = get(body, "model", str, None)
    if not model or not request.app[STRICT_MODEL_NAME]:
        return
    _known_model(_svc(request), model)


def _known_model(svc: ServiceFacade, name: str) -> None:
    """A 404 unless `name` is one the served model answers to."""
    if name not in svc.model_names:
        raise BadRequest(f"unknown model {name!r}; this daemon serves "
                         f"{svc.model_name!r}", status=404, code="model_not_found",
                         param="model")


def _prompt_tokens(svc: ServiceFacade, value: Any, name: str = "prompt") -> list[int]:
    tok = svc.tokenizer
    _check_prompt_bytes(svc, value, name)
    if isinstance(value, str):
        return tok.encode(value, parse_special=True)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        return _prompt_tokens(svc, value[0], name)
    return token_list(value, name, tok.vocab_size)


async def _constraint(svc: ServiceFacade, body: dict[str, Any]) -> Grammar | None:
    """OpenAI `response_format`, or the native `json_schema` / `grammar` / `regex` fields."""
    kind, spec = None, None
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise BadRequest("'response_format' must be an object with a 'type'",
                             param="response_format")
        if rf["type"] == "json_object":
            kind, spec = "json_object", rf.get("schema")
            if spec is not None:
                kind = "json_schema"
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise BadRequest("'response_format.json_schema' must be an object with a "
                                 "'schema'", param="response_format")
            kind, spec = "json_schema", js["schema"]
        elif rf["type"] != "text":
            raise BadRequest(f"unsupported response_format type {rf['type']!r}",
                             param="response_format")
    for field, k in (("json_schema", "json_schema"), ("grammar", "lark"), ("regex", "regex")):
        value = body.get(field)
        if field == "grammar" and isinstance(value, str) and not value.strip():
            value = None  # no grammar, as llama.cpp takes it (its clients send "")
        if value is not None:
            if kind is not None:
                raise BadRequest("give only one constraint (response_format, json_schema, "
                                 "grammar or regex)", param=field)
            kind, spec = k, value
    if kind is None:
        return None
    check_constraint_size(spec, "response_format" if rf is not None else
                          next(f for f in ("json_schema", "grammar", "regex") if f in body))
    try:
        return await svc.compile_constraint(kind, spec)
    except GrammarError as exc:
        raise BadRequest(str(exc), param="response_format" if rf else None) from None


def _check_fits(svc: ServiceFacade, prompt: list[int], param: str) -> None:
    if not prompt:
        raise BadRequest("the prompt is empty", param=param)
    try:
        svc.check_prompt(prompt)
    except RequestError as exc:
        raise BadRequest(str(exc), code="context_length_exceeded", param=param) from None


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N_PROBS = 1000  # llama.cpp's n_probs: any number; this keeps a response's size sane


def _openai_logprobs(body: dict[str, Any], chat: bool) -> int | None:
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


def _unsupported(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    """A field asking for what specd does not do is a clear 400, not silently ignored
    (a client reading logprobs would otherwise fail on the missing data)."""
    for name in fields:
        value = body.get(name)
        if value not in (None, False, 0, ""):
            raise BadRequest(f"'{name}' is not supported by specd", param=name)


# -- running ------------------------------------------------------------------------------
async def _collect(request: web.Request, svc: ServiceFacade, prompt: list[int],
                   params: GenerationParams, **kw: Any) -> Result:
    result: Result | None = None
    async for ev in svc.generate(prompt, params, **kw):
        if isinstance(ev, Result):
            result = ev
    assert result is not None
    if result.error:
        raise RuntimeError(result.error)
    if _shutting_down(request, result):
        raise BadRequest(SHUTDOWN_MESSAGE, status=503, code="unavailable")
    return result


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send_error(resp: web.StreamResponse, message: str, code: int = 500) -> None:
    """A failure after the stream began: an error event (what llama.cpp's server and
    OpenAI's send), never a normal finish."""
    etype = "unavailable_error" if code == 503 else "server_error"
    await _send(resp, {"error": {"code": code, "message": message, "type": etype}})


async def _send(resp: web.StreamResponse, payload: Any) -> None:
    data = payload if isinstance(payload, str) else dumps(payload)
    await resp.write(f"data: {data}\n\n".encode())


def _spec_block(r: Result) -> dict[str, Any]:
    s = r.stats
    return {"drafted": s.drafted, "accepted": s.accepted,
            "mean_acceptance_length": round(s.mean_acceptance_length, 4),
            "rounds": s.rounds, "valid": s.valid,
            "drafter_failures": dict(s.drafter_failures)}


def _usage(*results: Result) -> dict[str, Any]:
    """OpenAI's usage of one request's choices: the prompt once, every choice's tokens."""
    r = results[0]
    completion = sum(x.completion_tokens for x in results)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": completion,
            "total_tokens": r.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
            "speculative": _spec_block(r)}


def _generation_settings(svc: ServiceFacade, params: GenerationParams, *,
                         stop: list[str] | None = None, stream: bool = False,
                         n_probs: int = 0, post_sampling_probs: bool = False
                         ) -> dict[str, Any]:
    """A request's settings as llama.cpp reports them (`generation_settings`, /props'
    `default_generation_settings.params`): logit_bias as [{token, bias}], null for never
    (ignore_eos bans the end-of-generation tokens that way, as llama.cpp shows it)."""
    sp, dp = params.sampling, params.draft
    bias = [{"token": t, "bias": None if b == -math.inf else b}
            for t, b in sorted(sp.logit_bias.items())]
    if params.ignore_eos:
        bias += [{"token": t, "bias": None} for t in sorted(svc.eog_ids)]
    return {"seed": -1 if sp.seed is None else sp.seed, "temperature": sp.temperature,
            "top_k": sp.top_k, "top_p": sp.top_p, "min_p": sp.min_p,
            "repeat_last_n": sp.repeat_last_n, "repeat_penalty": sp.repeat_penalty,
            "presence_penalty": sp.presence_penalty,
            "frequency_penalty": sp.frequency_penalty, "stop": list(stop or []),
            "max_tokens": params.max_tokens, "n_predict": params.max_tokens,
            "ignore_eos": params.ignore_eos, "stream": stream, "logit_bias": bias,
            "n_probs": n_probs, "post_sampling_probs": post_sampling_probs,
            "speculative.n_max": dp.n_max, "speculative.n_min": dp.n_min,
            "speculative.p_min": dp.p_min, "speculative.adaptive": params.adaptive}


def _token_text(svc: ServiceFacade, token: int) -> tuple[str, list[int]]:
    """A token's text (without the bytes of a character it only begins or ends, as
    llama.cpp gives it) and its bytes."""
    data = svc.tokenizer.token_bytes(token)
    return data.decode("utf-8", "ignore"), list(data)


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: the lowest float stands for a probability of 0 (llama.cpp)."""
    return max(logprob, -3.4028234663852886e38)


def _chat_logprobs(svc: ServiceFacade, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat's `logprobs` object for these tokens."""
    def entry(token: int, lp: float) -> dict[str, Any]:
        text, data = _token_text(svc, token)
        return {"token": text, "logprob": _finite(lp), "bytes": data}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in logprobs]}


def _completion_logprobs(svc: ServiceFacade, logprobs: list[TokenLogprob], texts: list[str],
                         offset: int) -> dict[str, Any]:
    """The completions API's `logprobs` object (tokens, token_logprobs, top_logprobs,
    text_offset: where each token's text starts, the first at `offset`)."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [_token_text(svc, t.token)[0] for t in logprobs],
            "token_logprobs": [_finite(t.logprob) for t in logprobs],
            "top_logprobs": [{_token_text(svc, i)[0]: _finite(lp) for i, lp in t.top}
                             for t in logprobs],
            "text_offset": offsets[:len(logprobs)]}


def _llama_probs(svc: ServiceFacade, logprobs: list[TokenLogprob], post: bool = False
                 ) -> list[dict[str, Any]]:
    """llama.cpp's `completion_probabilities` for these tokens: logprobs, or with `post`
    (post_sampling_probs) the sampled distribution's probabilities as `prob` and
    `top_probs`."""
    def entry(token: int, lp: float) -> dict[str, Any]:
        text, data = _token_text(svc, token)
        return {"id": token, "token": text, "bytes": data,
                **({"prob": math.exp(lp)} if post else {"logprob": _finite(lp)})}

    top = "top_probs" if post else "top_logprobs"
    return [{**entry(t.token, t.logprob), top: [entry(i, lp) for i, lp in t.top]}
            for t in logprobs]


def _oai_logprobs(svc: ServiceFacade, logprobs: list[TokenLogprob], texts: list[str], offset: int,
                  *, chat: bool, post: bool) -> dict[str, Any]:
    """A choice's `logprobs` on the OpenAI routes: OpenAI's objects, or with
    `post_sampling_probs` llama-server's entries (`prob`, `top_probs`) under `content`, as it
    answers those routes."""
    if post:
        return {"content": _llama_probs(svc, logprobs, post=True)}
    return (_chat_logprobs(svc, logprobs) if chat
            else _completion_logprobs(svc, logprobs, texts, offset))


def _oai_finish(reason: str) -> dict[str, str]:
    """A choice's finish fields: OpenAI's `finish_reason` (only its values: clients
    switch on them) and specd's own reason as `finish_detail` (time_limit,
    grammar_dead_end, cancelled, ...)."""
    oai = "length" if reason in ("length", "time_limit") else "stop"
    return {"finish_reason": oai, "finish_detail": reason}


def _tool_choice(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool = True
                 ) -> tuple[set[str] | None, str | None]:
    """(the declared tools' names, whose calls the reply is read for: None for
    tool_choice "none"; a grammar forcing calls, for "required" or a named function,
    one call if not `parallel`)."""
    if choice == "none":
        return None, None
    if choice is not None and choice != "auto" and not tools:
        raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice")
    names = tool_names(tools)
    if choice in (None, "auto"):
        return (names if tools else None), None
    if choice == "required":
        return names, forced_call_grammar(tools or [], parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(
            name, str):
        raise BadRequest("'tool_choice' must be 'auto', 'none', 'required' or "
                         "{type: function, function: {name}}", param="tool_choice")
    if name not in names:
        raise BadRequest(f"'tool_choice' names {name!r}, which is not among the tools",
                         param="tool_choice")
    return names, forced_call_grammar(tools or [], name, parallel)


@dataclass
class _ChatInputs:
    """What a chat request renders its prompt from, and how it reads the reply."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # told to the model (None: none, or tool_choice none)
    names: set[str] | None  # the tools whose calls the reply is read for
    forced: str | None  # a grammar making the reply calls (tool_choice)
    # continue_final_message / add_generation_prompt, template_kwargs where given
    render: dict[str, Any]


def _chat_inputs(body: dict[str, Any]) -> _ChatInputs:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("'messages' must be a non-empty array of {role, content}",
                         param="messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be an array of objects", param="tools")
    check_tools_size(tools or [])
    try:
        check_tools(tools or [])
    except ValueError as exc:
        raise BadRequest(str(exc), param="tools") from None
    names, forced = _tool_choice(tools, body.get("tool_choice"),
                                 get(body, "parallel_tool_calls", bool, True))
    if names is None:  # tool_choice none: the model is not told of tools either
        tools = None
    # a final assistant message is continued (prefill), as llama-server does, unless
    # the request says otherwise
    prefill = messages[-1]["role"] == "assistant"
    if prefill and len(messages) > 1 and messages[-2]["role"] == "assistant":
        raise BadRequest("only the last message may be an assistant's to continue (two "
                         "assistant messages end the chat)", param="messages")
    cont = get(body, "continue_final_message", bool, prefill)
    render: dict[str, Any] = {
        "continue_final_message": cont,
        "add_generation_prompt": get(body, "add_generation_prompt", bool, not cont)}
    # more variables for the template, as llama-server and vLLM take them
    # ({"enable_thinking": false} for Qwen3's)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object",
                             param="chat_template_kwargs")
        render["template_kwargs"] = kwargs
    # OpenAI's reasoning_effort, as llama-server passes it: "none" turns thinking off,
    # another level is the template's `reasoning_effort` (gpt-oss reads it)
    effort = get(body, "reasoning_effort", str, None)
    if effort is not None:
        render["template_kwargs"] = {**(kwargs or {}), **(
            {"enable_thinking": False} if effort == "none" else {"reasoning_effort": effort})}
    return _ChatInputs(messages, tools or None, names, forced, render)


def _render(svc: ServiceFacade, chat: _ChatInputs, how: str) -> Any:
    """The chat's prompt, rendered by the service's `how` ("render_chat": the text,
    "chat_tokens": its token ids); a template error, or more text than the context can
    hold, is a 400."""
    check_text_bytes(texts_in(chat.messages) + texts_in(chat.tools or [])
                     + texts_in(chat.render.get("template_kwargs") or {}),
                     _prompt_byte_limit(svc), "messages")
    try:
        return getattr(svc, how)(chat.messages, chat.tools, **chat.render)
    except ValueError as exc:
        raise BadRequest(f"chat template: {exc}") from None


async def _rendered(request: web.Request, how: str) -> Any:
    """The chat request's prompt (see _render), prepared off the event loop."""
    chat = _chat_inputs(await json_body(request))
    return await _off_loop(request, _render, _svc(request), chat, how)


async def apply_template(request: web.Request) -> web.Response:
    """llama-server's /apply-template: the prompt text a chat request renders."""
    return json_response({"prompt": await _rendered(request, "render_chat")})


async def chat_input_tokens(request: web.Request) -> web.Response:
    """llama-server's /chat/completions/input_tokens: how many tokens the prompt is."""
    return json_response({"input_tokens": len(await _rendered(request, "chat_tokens"))})


async def _openai(request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await json_body(request)
    svc = _served(request, body)
    _check_model(request, body)
    _unsupported(body, () if chat else ("echo", "suffix", "best_of"))
    names: set[str] | None = None  # the request's tools, when calls are parsed
    forced: str | None = None  # a grammar making the reply calls (tool_choice)
    if chat:
        chat_in = _chat_inputs(body)
        names, forced = chat_in.names, chat_in.forced
        prompt = await _off_loop(request, _render, svc, chat_in, "chat_tokens")
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompt = await _off_loop(request, _prompt_tokens, svc, body["prompt"])
    params = await _off_loop(request, _params, svc, body, max_key="max_tokens")
    params.logprobs = _openai_logprobs(body, chat)
    params.post_sampling_probs = (get(body, "post_sampling_probs", bool, False)
                                  and params.logprobs is not None)
    if chat and "max_completion_tokens" in body:
        params.max_tokens = get(body, "max_completion_tokens", int, params.max_tokens, lo=0)
    stop = stop_list(body)
    grammar = await _constraint(svc, body)
    if forced is not None:
        if grammar is not None:
            raise BadRequest("tool_choice that forces a call cannot be combined with "
                             "another constraint", param="tool_choice")
        try:
            # the calls' arguments are JSON: their numbers bounded as a schema's are
            grammar = await svc.compile_constraint("lark", forced, bound_numbers=True)
        except GrammarError as exc:
            raise BadRequest(f"tools: {exc}", param="tools") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = svc.model_name
    obj = "chat.completion" if chat else "text_completion"
    _check_fits(svc, prompt, "messages" if chat else "prompt")
    # n choices: n requests on the same prompt (each slot reuses what its cache holds),
    # seeded seed, seed + 1, ... where a seed is given
    n = get(body, "n", int, 1, lo=1, hi=MAX_CHOICES)
    choice_params = [params if i == 0 else _nth_choice(params, i) for i in range(n)]
    if not get(body, "stream", bool, False):
        results = await asyncio.gather(*(_collect(request, svc, prompt, p, stop=stop,
                                                  grammar=grammar)
                                         for p in choice_params))
        choices = []
        for i, r in enumerate(results):
            choice: dict[str, Any] = {"index": i, **_oai_finish(r.finish_reason),
                                      "logprobs": None}
            if params.logprobs is not None:
                choice["logprobs"] = _oai_logprobs(svc, r.logprobs, r.texts, 0, chat=chat,
                                                   post=params.post_sampling_probs)
            if chat:
                content, calls = ((r.text, []) if names is None
                                  else parse_tool_calls(r.text, names))
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = [c.as_openai() for c in calls]
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = r.text
            choices.append(choice)
        return json_response({"id": rid, "object": obj, "created": created, "model": model,
                              "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
                              "usage": _usage(*results), "timings": results[0].timings})
    # queued before the response starts: a full queue is still a 503 the client can retry
    progress = get(body, "return_progress", bool, False)
    per_token = get(body, "timings_per_token", bool, False)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    streams: list[Stream] = []
    try:
        for p in choice_params:
            streams.append(svc.submit(prompt, p, stop=stop, grammar=grammar,
                                      progress=progress, timings=per_token))
        return await _openai_stream(request, streams, chat=chat, rid=rid, created=created,
                                    model=model, include_usage=include_usage, names=names,
                                    logprobs=params.logprobs is not None,
                                    post=params.post_sampling_probs)
    finally:
        for stream in streams:
            stream.cancel()  # the client went away (a no-op once finished)


MAX_CHOICES = 16  # n: choices of one request


def _nth_choice(params: GenerationParams, i: int) -> GenerationParams:
    """The settings of choice i of n: the request's, seeded seed + i where seeded."""
    seed = params.sampling.seed
    return replace(params, sampling=replace(
        params.sampling, seed=None if seed is None else (seed + i) % (1 << 63)))


class _ChoiceStream:
    """One choice's streaming state: tool-call text held back, logprobs not yet sent."""

    def __init__(self, index: int, names: set[str] | None):
        self.index = index
        self.tools = None if names is None else ToolCallStream(names)
        self.logprobs: list[TokenLogprob] = []  # of tokens no chunk has carried yet
        self.texts: list[str] = []
        self.offset = 0  # the text sent so far (completions' text_offset)


async def _openai_stream(request: web.Request, streams: list[Stream], *, chat: bool, rid: str,
                         created: int, model: str, include_usage: bool = False,
                         names: set[str] | None = None,
                         logprobs: bool = False, post: bool = False) -> web.StreamResponse:
    """Chunks as OpenAI streams them, each choice's with its index (several choices
    interleave). The usage is sent once: with stream_options.include_usage in OpenAI's
    own last chunk, whose choices are empty, else on the last finishing chunk (where
    older llama.cpp servers put it). With tool `names`, text that may be a tool call is
    held back, and the calls come whole in one chunk before the finishing one. With
    `logprobs`, each chunk carries those of the tokens that came since the choice's last
    chunk (text held back keeps its tokens' logprobs for a later one); `post`: as
    post-sampling probabilities (`_oai_logprobs`)."""
    resp = await _sse(request)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    svc = _svc(request)

    def chunk(st: _ChoiceStream, delta: str | None, finish: dict[str, str] | None = None,
              first: bool = False) -> dict[str, Any]:
        c: dict[str, Any] = {"index": st.index, "finish_reason": None, **(finish or {}),
                             "logprobs": None}
        if logprobs and st.logprobs and not first:
            c["logprobs"] = _oai_logprobs(svc, st.logprobs, st.texts, st.offset, chat=chat,
                                          post=post)
            st.offset += sum(len(t) for t in st.texts)
            st.logprobs, st.texts = [], []
        if chat:
            c["delta"] = ({"role": "assistant", "content": delta or ""} if first
                          else ({"content": delta} if delta else {}))
        else:
            c["text"] = delta or ""
        return {"id": rid, "object": chunk_obj, "created": created, "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [c]}

    states = [_ChoiceStream(i, names) for i in range(len(streams))]
    if chat:
        for st in states:
            await _send(resp, chunk(st, "", first=True))
    results: list[Result] = []
    async for i, ev in _merged(streams):
        st = states[i]
        if isinstance(ev, ProgressEvent):  # return_progress
            await _send(resp, {**chunk(st, None), "prompt_progress": ev.as_json(),
                               **_timed(ev.timings)})
        elif isinstance(ev, Piece):
            st.logprobs.extend(ev.logprobs)
            st.texts.extend(ev.texts)
            text = ev.text if st.tools is None else st.tools.feed(ev.text)
            if text:
                await _send(resp, {**chunk(st, text), **_timed(ev.timings)})
        elif ev.error or _shutting_down(request, ev):
            if st.tools is not None and st.tools.held():
                await _send(resp, chunk(st, st.tools.held()))
            await _send_error(resp, *((ev.error,) if ev.error else (SHUTDOWN_MESSAGE, 503)))
            await resp.write_eof()
            return resp
        else:
            results.append(ev)
            finish = _oai_finish(ev.finish_reason)
            if st.tools is not None:
                rest, calls = st.tools.finish()
                if rest:
                    await _send(resp, chunk(st, rest))
                if calls:
                    called = chunk(st, None)
                    called["choices"][0]["delta"] = {
                        "tool_calls": [c.as_openai(k) for k, c in enumerate(calls)]}
                    await _send(resp, called)
                    finish["finish_reason"] = "tool_calls"
            final = chunk(st, None, finish)
            if len(results) < len(streams):
                await _send(resp, final)
            elif include_usage:  # the timings ride on the last chunk, as llama-server's
                await _send(resp, final)
                await _send(resp, {**final, "choices": [], "usage": _usage(*results),
                                   "timings": results[0].timings})
            else:
                await _send(resp, {**final, "usage": _usage(*results),
                                   "timings": results[0].timings})
    await _send(resp, "[DONE]")
    await resp.write_eof()
    return resp


def _timed(timings: dict[str, Any] | None) -> dict[str, Any]:
    """An event's "timings" field, where the request asked for them per token."""
    return {} if timings is None else {"timings": timings}


async def _merged(streams: list[Stream]
                  ) -> AsyncIterator[tuple[int, Piece | ProgressEvent | Result]]:
    """(index, event) of several streams as the events come."""
    if len(streams) == 1:
        async for ev in streams[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Piece | ProgressEvent | Result | None]] = asyncio.Queue()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for ev in stream:
                await queue.put((i, ev))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=False)


# -- llama.cpp-compatible -----------------------------------------------------------------
def _infill_prompt(svc: ServiceFacade, body: dict[str, Any], max_tokens: int) -> list[int]:
    """llama.cpp's /infill prompt (`daemon.infill`): extra files, then prefix, suffix and
    prompt, trimmed to leave the context room for the completion."""
    tok = svc.tokenizer
    if not has_fim(tok):
        raise BadRequest("this model's vocabulary has no FIM tokens; /infill is unavailable")
    extra = body.get("input_extra") or []
    # as llama.cpp checks them: a string text in each, a filename a string if given
    if not isinstance(extra, list) or not all(
            isinstance(e, dict) and isinstance(e.get("text"), str)
            and isinstance(e.get("filename", ""), str) for e in extra):
        raise BadRequest("'input_extra' must be an array of {filename, text}: text a "
                         "string, filename a string if given", param="input_extra")
    chunks = [ExtraChunk(e.get("filename", DEFAULT_CHUNK_FILE), e.get("text", ""))
              for e in extra]
    return infill_tokens(tok, get(body, "input_prefix", str, ""),
                         get(body, "input_suffix", str, ""), get(body, "prompt", str, ""),
                         chunks, svc.n_ctx, max_tokens)


async def _llama_completion(request: web.Request, *, infill: bool) -> web.StreamResponse:
    out = await _llama_run(request, await json_body(request), infill=infill)
    return json_response(out) if isinstance(out, dict | list) else out


async def _llama_run(request: web.Request, body: dict[str, Any], *, infill: bool
                     ) -> dict[str, Any] | list[dict[str, Any]] | web.StreamResponse:
    """One /completion or /infill request: its response's JSON, or the stream it sent."""
    svc = _served(request, body)
    params = await _off_loop(request, _params, svc, body, max_key="n_predict")
    n_probs = get(body, "n_probs", int, 0, lo=0, hi=MAX_N_PROBS)
    post = get(body, "post_sampling_probs", bool, False) and n_probs > 0
    params.post_sampling_probs = post
    params.logprobs = n_probs or None
    if infill:
        prompt = await _off_loop(request, _infill_prompt, svc, body, params.max_tokens)
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompts = await _off_loop(request, _prompts, svc, body["prompt"], "prompt")
        if len(prompts) > 1:  # several: one completion each, a list of results
            if get(body, "stream", bool, False):
                raise BadRequest("streaming several prompts is not supported; send them "
                                 "one by one", param="prompt")
            out = []
            for i, p in enumerate(prompts):
                one = await _llama_run(request, {**body, "prompt": p}, infill=False)
                assert isinstance(one, dict)
                out.append({**one, "index": i})
            return out
        prompt = prompts[0]
    stop = stop_list(body)
    cache_prompt = get(body, "cache_prompt", bool, True)
    t_max = get(body, "t_max_predict_ms", (int, float), None, lo=0)
    _check_fits(svc, prompt, "prompt")
    kw = dict(stop=stop, cache_prompt=cache_prompt, t_max_ms=t_max,
              grammar=await _constraint(svc, body),
              n_indent=get(body, "n_indent", int, 0, lo=0),  # editor plugins (llama.vim)
              progress=get(body, "stream", bool, False) and get(body, "return_progress",
                                                                 bool, False),
              timings=get(body, "stream", bool, False) and get(body, "timings_per_token",
                                                                bool, False))

    fields = body.get("response_fields")
    if fields is not None and not (isinstance(fields, list)
                                   and all(isinstance(f, str) for f in fields)):
        raise BadRequest("'response_fields' must be an array of strings",
                         param="response_fields")

    return_tokens = get(body, "return_tokens", bool, False)

    def final(r: Result) -> dict[str, Any]:
        full = {"index": 0, "content": r.text if not stream else "",
                "tokens": r.tokens if return_tokens and not stream else [],
                "id_slot": -1 if r.slot is None else r.slot, "stop": True,
                "model": svc.model_name, "tokens_predicted": r.completion_tokens,
                "tokens_evaluated": r.prompt_tokens,
                "generation_settings": _generation_settings(svc, params, stop=stop,
                                                            stream=stream, n_probs=n_probs,
                                                            post_sampling_probs=post),
                "prompt": svc.tokenizer.decode(prompt),
                "has_new_line": "\n" in r.text, "truncated": False,
                "stop_type": {"stop": "eos" if not r.stopping_word else "word",
                              "length": "limit", "time_limit": "limit"}.get(
                                  r.finish_reason, r.finish_reason),
                "stopping_word": r.stopping_word, "tokens_cached": r.cached_tokens,
                "timings": r.timings, "speculative": _spec_block(r)}
        if n_probs and not stream:
            full["completion_probabilities"] = _llama_probs(svc, r.logprobs, post)
        # llama.cpp's response_fields: just these, a nested one under its "a/b" path (none
        # or [] is every field)
        return _pick_fields(full, fields) if fields else full

    stream = get(body, "stream", bool, False)
    if not stream:
        return final(await _collect(request, svc, prompt, params, **kw))
    events = svc.submit(prompt, params, **kw)  # a full queue is a 503 before any byte
    n_predicted = 0

    def partial(text: str, tokens: list[int]) -> dict[str, Any]:
        """A streamed event, as llama.cpp's (with the tokens, always)."""
        nonlocal n_predicted
        n_predicted += len(tokens)
        return {"index": 0, "content": text, "tokens": tokens, "stop": False,
                "id_slot": -1 if events.req.slot is None else events.req.slot,
                "tokens_predicted": n_predicted, "tokens_evaluated": len(prompt)}

    try:
        resp = await _sse(request)
        held: dict[str, Any] | None = None  # with n_probs: the last token's event
        async for ev in events:
            if isinstance(ev, Piece) and n_probs:
                # one event per token, as llama.cpp streams them with their probabilities;
                # the last one waits for text that may come after it (the flushed tail)
                for token, text, lp in zip(ev.tokens, ev.texts, ev.logprobs, strict=True):
                    if held is not None:
                        await _send(resp, held)
                    held = {**partial(text, [token]),
                            "completion_probabilities": _llama_probs(svc, [lp], post),
                            **_timed(ev.timings)}
                if not ev.tokens and held is not None:
                    held["content"] += ev.text
                elif not ev.tokens:
                    await _send(resp, partial(ev.text, []))
                continue
            if held is not None:
                await _send(resp, held)
                held = None
            if isinstance(ev, ProgressEvent):  # return_progress
                await _send(resp, {**partial("", []), "prompt_progress": ev.as_json(),
                                   **_timed(ev.timings)})
            elif isinstance(ev, Piece):
                await _send(resp, {**partial(ev.text, ev.tokens), **_timed(ev.timings)})
            elif ev.error:
                await _send_error(resp, ev.error)
            elif _shutting_down(request, ev):
                await _send_error(resp, SHUTDOWN_MESSAGE, 503)
            else:
                await _send(resp, final(ev))
        await resp.write_eof()
        return resp
    finally:
        events.cancel()


def _pick_fields(full: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """{path: value} for each "a/b/c" path found in `full` (llama.cpp's
    json_get_nested_values: llama.vim asks for "timings/prompt_n" and the like)."""
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = full
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out


async def completion(request: web.Request) -> web.StreamResponse:
    return await _llama_completion(request, infill=False)


async def infill(request: web.Request) -> web.StreamResponse:
    return await _llama_completion(request, infill=True)


async def tokenize(request: web.Request) -> web.Response:
    svc = _svc(request)
    body = await json_body(request)
    content = get(body, "content", str, "")
    # add_special: the BOS / EOS the vocabulary adds (none where it adds none), as
    # llama.cpp's tokenizer does: the prompt a completion would evaluate
    special = None if get(body, "add_special", bool, False) else False
    ids = await _off_loop(request, svc.tokenizer.encode, content, add_bos=special,
                          add_eos=special, parse_special=get(body, "parse_special", bool, True))
    pieces = get(body, "with_pieces", bool, False)
    data = await _off_loop(request, _tokens_json, svc.tokenizer, ids, pieces)
    return web.Response(body=data, content_type="application/json")


def _tokens_json(tok: Tokenizer, ids: list[int], pieces: bool) -> bytes:
    """/tokenize's response, written a slice of tokens at a time: a few milliseconds
    each, so the event loop's thread gets the GIL in between, even for millions."""
    parts = []
    for start in range(0, len(ids), _JSON_SLICE):
        part = ids[start:start + _JSON_SLICE]
        items: list[Any] = ([{"id": i, "piece": _piece(tok.token_bytes(i))} for i in part]
                            if pieces else part)
        parts.append(dumps(items)[1:-1])
    return ('{"tokens":[' + ",".join(parts) + "]}").encode()


_JSON_SLICE = 16384


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 on their own (part of a
    character), as llama.cpp's /tokenize gives them."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def detokenize(request: web.Request) -> web.Response:
    svc = _svc(request)
    body = await json_body(request)
    ids = await _off_loop(request, token_list, body.get("tokens", []), "tokens",
                          svc.tokenizer.vocab_size)
    return json_response({"content": await _off_loop(request, svc.tokenizer.decode, ids)})


# -- embeddings ---------------------------------------------------------------------------
def _prompts(svc: ServiceFacade, value: Any, param: str = "input",
             tok: Tokenizer | None = None) -> list[list[int]]:
    """The token ids of each prompt, as llama-server reads `prompt` / `input` / `content`:
    a text, an array of ids (text among them is tokenized in place), {"prompt_string":
    text}, {"content": [text parts]}, or an array of those (several prompts). A text
    may give no tokens. `tok`: the tokenizer (default: the target's)."""
    tok = tok or svc.tokenizer

    def one(item: Any) -> list[int]:
        if isinstance(item, dict):
            if "multimodal_data" in item:
                raise BadRequest("this model reads text only ('multimodal_data')",
                                 param=param)
            if isinstance(item.get("prompt_string"), str):
                item = item["prompt_string"]
            elif isinstance(item.get("content"), list) and all(
                    isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str) for p in item["content"]):
                item = "".join(p["text"] for p in item["content"])
            else:
                raise BadRequest(f"a '{param}' object needs 'prompt_string' or 'content' as "
                                 "an array of text parts (this model reads text only)",
                                 param=param)
        _check_prompt_bytes(svc, item, param)
        if isinstance(item, str):
            return tok.encode(item, parse_special=True)
        if isinstance(item, list) and item and all(
                isinstance(x, int | str) and not isinstance(x, bool) for x in item):
            ids: list[int] = []
            for x in item:
                ids += [x] if isinstance(x, int) else tok.encode(x, add_bos=False)
            return token_list(ids, param, tok.vocab_size)
        raise BadRequest(f"'{param}' must be a string, an array of token ids, an object "
                         "with text, or an array of these", param=param)

    if isinstance(value, list):
        if not value:
            raise BadRequest(f"the {param} is empty", param=param)
        if any(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return [one(value)]  # one input of ids (with text among them)
        return [one(x) for x in value]
    return [one(value)]


async def _embed(request: web.Request, *, openai: bool) -> web.Response:
    body = await json_body(request)
    svc = _served(request, body)
    emb = svc.embeddings
    if emb is None:
        raise BadRequest("this daemon does not compute embeddings: start it with "
                         "--embeddings", status=501, code="not_supported")
    if openai:
        _check_model(request, body)
        if emb.pooling == "none":
            raise BadRequest("pooling 'none' gives a vector per token, which "
                             "/v1/embeddings cannot return (use /embeddings)", param="input")
    fmt = get(body, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise BadRequest(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                         param="encoding_format")
    field = "input" if "input" in body or openai else "content"
    if field not in body:
        raise BadRequest(f"'{field}' is required", param=field)
    tok = emb.tokenizer
    # an empty text: its start alone (llama.cpp embeds the BOS it adds)
    start = [tok.bos_id if tok.bos_id is not None else (tok.eos_id or 0)]
    inputs = [tokens or start
              for tokens in await _off_loop(request, _prompts, svc, body[field], field, tok)]
    for tokens in inputs:
        if len(tokens) > emb.n_ctx - 1:
            raise BadRequest(f"input is too large to process: {len(tokens)} tokens, the "
                             f"context holds {emb.n_ctx - 1}", param=field)
    vectors = await svc.embed(inputs, get(body, "embd_normalize", int, 2, lo=-1))

    def encoded(v: np.ndarray) -> Any:
        if fmt == "base64":  # as OpenAI sends it: float32, little-endian
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return np.asarray(v, dtype=np.float32).tolist()

    if not openai:  # llama.cpp's: each input's vectors (one, pooled; or one per token)
        return json_response([{"index": i, "embedding": encoded(np.atleast_2d(v))}
                              for i, v in enumerate(vectors)])
    n = sum(len(t) for t in inputs)
    return json_response({
        "model": svc.model_name, "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n, "total_tokens": n}})


async def embeddings_oai(request: web.Request) -> web.StreamResponse:
    return await _embed(request, openai=True)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _embed(request, openai=False)


# -- status -------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


def _model_card(svc: ServiceFacade) -> dict[str, Any]:
    return {"id": svc.model_name, "aliases": svc.aliases,
            "tags": svc.tags, "object": "model", "created": int(svc.started),
            "owned_by": "specd"}


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(_svc(request))]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model under any name it answers to, else a 404
    (a lookup says what is there, whatever a completion request would accept)."""
    svc = _svc(request)
    _known_model(svc, request.match_info["model_id"])
    return json_response(_model_card(svc))


async def props(request: web.Request) -> web.Response:
    svc = _svc(request)
    info = svc.describe()
    d = svc.defaults
    tok = svc.tokenizer
    info.update({"total_slots": svc.n_slots, "n_ctx": svc.n_ctx,
                 "memory_plan": request.app.get(MEMORY_PLAN),
                 # llama-server's: the model's path and name, its template and tokens
                 "model_path": str(svc.model_path),
                 "model_alias": svc.model_name,
                 "chat_template": svc.chat_template,
                 "bos_token": "" if tok.bos_id is None else tok.token_text(tok.bos_id),
                 "eos_token": "" if tok.eos_id is None else tok.token_text(tok.eos_id),
                 "modalities": {"vision": False, "video": False, "audio": False},
                 "build_info": SYSTEM_FINGERPRINT,
                 "default_generation_settings": {
                     "n_ctx": svc.n_ctx, "params": _generation_settings(svc, d),
                     "n_predict": d.max_tokens, "speculative.n_max": d.draft.n_max,
                     "speculative.n_min": d.draft.n_min, "speculative.p_min": d.draft.p_min}})
    return json_response(info)


async def slots(request: web.Request) -> web.Response:
    return json_response(_svc(request).slot_info())


async def metrics(request: web.Request) -> web.Response:
    svc = _svc(request)
    # llama-server's header: scrapers tell a restart from a counter reset by it
    return web.Response(text=render_metrics(svc, request.app[RATES]), content_type="text/plain",
                        charset="utf-8",
                        headers={"Process-Start-Time-Unix": str(int(svc.started))})


def _busy(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        if request.app[LIVE].draining:
            return error_response(503, "specd is shutting down")
        try:
            return await handler(request)
        except QueueFull as exc:
            return error_response(503, str(exc))
        except RequestError as exc:
            return error_response(400, str(exc))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
    return wrapped


def create_app(service: Service, *, allowed_origins: set[str] | None = None,
               token: str | None = None, access: Access | None = None,
               max_body: int = 8 << 20, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               memory_plan: dict[str, Any] | None = None,
               strict_model_name: bool = False) -> web.Application:
    """The API over `service`. `access` says who may use TCP (`token` alone: a token
    every TCP client must send). Closing the app (its runner's cleanup) cancels the
    generations in flight and stops the service's scheduler."""
    if access is None:
        access = Access(token=token, require_token=token is not None)
    app = web.Application(client_max_size=max_body, middlewares=make_middlewares(
        allowed_origins=allowed_origins or set(), access=access))
    app.on_response_prepare.append(cors_on_prepare(allowed_origins or set()))
    app[SERVICE] = ServiceFacade(service)
    app[MAX_BODY] = max_body
    app[BODY_TIMEOUT] = body_timeout
    app[MEMORY_PLAN] = memory_plan
    app[STRICT_MODEL_NAME] = strict_model_name
    app[LIVE] = LiveRequests()
    app[RATES] = RateWindow()
    app[PREP] = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="specd-prep")
    app.on_shutdown.append(_cancel_generations)
    app.on_cleanup.append(_stop_service)
    r = app.router
    r.add_get("/health", health)
    r.add_get("/v1/models", models)
    r.add_get("/models", models)
    r.add_get("/v1/models/{model_id:.+}", model)
    r.add_post("/v1/completions", _busy(completions))
    r.add_post("/v1/chat/completions", _busy(chat_completions))
    r.add_post("/chat/completions", _busy(chat_completions))
    r.add_post("/apply-template", apply_template)
    r.add_post("/chat/completions/input_tokens", chat_input_tokens)
    r.add_post("/v1/chat/completions/input_tokens", chat_input_tokens)
    r.add_post("/completion", _busy(completion))
    r.add_post("/completions", _busy(completion))
    r.add_post("/infill", _busy(infill))
    r.add_post("/v1/embeddings", _busy(embeddings_oai))
    r.add_post("/embeddings", _busy(embeddings))
    r.add_post("/embedding", _busy(embeddings))
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_get("/props", props)
    r.add_get("/slots", slots)
    r.add_get("/metrics", metrics)
    return app


async def _cancel_generations(app: web.Application) -> None:
    """Shutdown: every generation in flight ends now; its client gets an error event
    (or a 503), and requests still arriving are refused."""
    app[LIVE].cancel_all()


async def _stop_service(app: web.Application) -> None:
    """After the last response: the scheduler's worker stops while the event loop still
    runs, so no callback reaches a closed loop."""
    app[PREP].shutdown(wait=False, cancel_futures=True)
    await asyncio.get_running_loop().run_in_executor(None, app[SERVICE].stop)
