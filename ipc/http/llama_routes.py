"""llama.cpp's dialect: /completion and /infill (editor plugins' FIM), /tokenize,
/detokenize, /apply-template and the chat's input token count."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Piece, ProgressEvent, Result, TextStream
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import MEDIA_MARKER, PromptImage, text_runs
from specd.daemon.text.tokenizer import Tokenizer

from ..jsonout import dumps, json_response
from ..validation import BadRequest, get, json_body, stop_list, token_list
from .chat_inputs import rendered
from .media_inputs import image_prompt, multimodal_prompt
from .parsing import (
    check_fits,
    check_prompt_bytes,
    constraint,
    generation_params,
    infill_prompt,
    prompts,
)
from .reporting import generation_settings, llama_probs, spec_block
from .state import off_loop, served
from .streaming import collect, stream_events, submit_all, timed

MAX_N_PROBS = 1000  # llama.cpp's n_probs: any number; this keeps a response's size sane


async def completion(request: web.Request) -> web.StreamResponse:
    return await _llama_completion(request, infill=False)


async def infill(request: web.Request) -> web.StreamResponse:
    return await _llama_completion(request, infill=True)


async def apply_template(request: web.Request) -> web.Response:
    """llama-server's /apply-template: the prompt text a chat request renders."""
    return json_response({"prompt": await rendered(request, "render_chat")})


async def chat_input_tokens(request: web.Request) -> web.Response:
    """llama-server's /chat/completions/input_tokens: how many tokens the prompt is."""
    return json_response({"input_tokens": len(await rendered(request, "chat_tokens"))})


async def _llama_completion(request: web.Request, *, infill: bool) -> web.StreamResponse:
    out = await _llama_run(request, await json_body(request), infill=infill)
    return json_response(out) if isinstance(out, dict | list) else out


async def _llama_run(request: web.Request, body: dict[str, Any], *, infill: bool
                     ) -> dict[str, Any] | list[dict[str, Any]] | web.StreamResponse:
    """One /completion or /infill request: its response's JSON, or the stream it sent."""
    svc = await served(request, body)
    params = await off_loop(request, generation_params, svc, body, max_key="n_predict")
    n_probs = get(body, "n_probs", int, 0, lo=0, hi=MAX_N_PROBS)
    images: tuple[PromptImage, ...] = ()  # the prompt's, at their placeholders
    params.post_sampling_probs = get(body, "post_sampling_probs", bool, False) and n_probs > 0
    params.logprobs = n_probs or None
    if infill:
        prompt = await off_loop(request, infill_prompt, svc, body, params.max_tokens)
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        media = multimodal_prompt(body["prompt"])
        if media is not None:  # a prompt string with a media marker per file
            check_prompt_bytes(svc, media[0], "prompt")
            prompt, images = await off_loop(request, image_prompt, svc, *media, "prompt")
            several = [prompt]
        else:
            several = await off_loop(request, prompts, svc, body["prompt"], "prompt")
        if len(several) > 1:  # one completion each, a list of results
            if get(body, "stream", bool, False):
                raise BadRequest("streaming several prompts is not supported; send them "
                                 "one by one", param="prompt")
            out = []
            for i, p in enumerate(several):
                one = await _llama_run(request, {**body, "prompt": p}, infill=False)
                assert isinstance(one, dict)
                out.append({**one, "index": i})
            return out
        prompt = several[0]
    stop = stop_list(body)
    stream = get(body, "stream", bool, False)
    cache_prompt = get(body, "cache_prompt", bool, True)
    t_max = get(body, "t_max_predict_ms", (int, float), None, lo=0)
    check_fits(svc, prompt, "prompt")
    kw = dict(stop=stop, cache_prompt=cache_prompt, t_max_ms=t_max, images=images,
              grammar=await constraint(svc, body),
              n_indent=get(body, "n_indent", int, 0, lo=0),  # editor plugins (llama.vim)
              progress=stream and get(body, "return_progress", bool, False),
              timings=stream and get(body, "timings_per_token", bool, False))
    fields = body.get("response_fields")
    if fields is not None and not (isinstance(fields, list)
                                   and all(isinstance(f, str) for f in fields)):
        raise BadRequest("'response_fields' must be an array of strings",
                         param="response_fields")
    reply = _Reply(svc, prompt, params, stop=stop, stream=stream, n_probs=n_probs,
                   fields=fields, return_tokens=get(body, "return_tokens", bool, False))
    if not stream:
        return reply.final((await collect(request, svc, prompt, [params], **kw))[0])
    streams = submit_all(svc, prompt, [params], **kw)  # a full queue: a 503 before any byte
    reply.running = streams[0]
    return await stream_events(request, streams, reply)


class _Reply:
    """One /completion or /infill answer: its final object, and as a stream llama.cpp's
    events (with n_probs, one per token with its probabilities)."""

    def __init__(self, svc: ServiceFacade, prompt: list[int], params: GenerationParams, *,
                 stop: list[str], stream: bool, n_probs: int, fields: list[str] | None,
                 return_tokens: bool):
        self.svc, self.prompt, self.params, self.stop = svc, prompt, params, stop
        self.stream, self.n_probs, self.fields = stream, n_probs, fields
        self.return_tokens = return_tokens
        self.running: TextStream | None = None  # streamed: the request (its slot, once it has one)
        self._n_predicted = 0
        self._held: dict[str, Any] | None = None  # with n_probs: the last token's event

    def final(self, r: Result) -> dict[str, Any]:
        stream, post = self.stream, self.params.post_sampling_probs
        full = {"index": 0, "content": r.text if not stream else "",
                "tokens": r.tokens if self.return_tokens and not stream else [],
                "id_slot": -1 if r.slot is None else r.slot, "stop": True,
                "model": self.svc.model_name, "tokens_predicted": r.completion_tokens,
                "tokens_evaluated": r.prompt_tokens,
                "generation_settings": generation_settings(
                    self.svc, self.params, stop=self.stop, stream=stream,
                    n_probs=self.n_probs, post_sampling_probs=post),
                "prompt": "".join(MEDIA_MARKER if run is None else
                                  self.svc.tokenizer.decode(run)
                                  for run in text_runs(self.prompt)),
                "has_new_line": "\n" in r.text, "truncated": False,
                "stop_type": {"stop": "eos" if not r.stopping_word else "word",
                              "length": "limit", "time_limit": "limit"}.get(
                                  r.finish_reason, r.finish_reason),
                "stopping_word": r.stopping_word, "tokens_cached": r.cached_tokens,
                "timings": r.timings, "speculative": spec_block(r)}
        if self.n_probs and not stream:
            full["completion_probabilities"] = llama_probs(self.svc, r.logprobs, post)
        # llama.cpp's response_fields: just these, a nested one under its "a/b" path (none
        # or [] is every field)
        return _pick_fields(full, self.fields) if self.fields else full

    # -- streamed (streaming.EventWriter) -------------------------------------------------
    def _partial(self, text: str, tokens: list[int]) -> dict[str, Any]:
        """A streamed event, as llama.cpp's (with the tokens, always)."""
        self._n_predicted += len(tokens)
        return {"index": 0, "content": text, "tokens": tokens, "stop": False,
                "id_slot": self._slot(),
                "tokens_predicted": self._n_predicted, "tokens_evaluated": len(self.prompt)}

    def _slot(self) -> int:
        slot = None if self.running is None else self.running.slot
        return -1 if slot is None else slot

    def _release(self) -> list[Any]:
        held, self._held = self._held, None
        return [] if held is None else [held]

    def opening(self) -> list[Any]:
        return []

    def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
        if isinstance(ev, Piece) and self.n_probs:
            # one event per token, as llama.cpp streams them with their probabilities;
            # the last one waits for text that may come after it (the flushed tail)
            out = []
            post = self.params.post_sampling_probs
            for token, text, lp in zip(ev.tokens, ev.texts, ev.logprobs, strict=True):
                out += self._release()
                self._held = {**self._partial(text, [token]),
                              "completion_probabilities": llama_probs(self.svc, [lp], post),
                              **timed(ev.timings)}
            if not ev.tokens and self._held is not None:
                self._held["content"] += ev.text
            elif not ev.tokens:
                out.append(self._partial(ev.text, []))
            return out
        out = self._release()
        if isinstance(ev, ProgressEvent):  # return_progress
            return out + [{**self._partial("", []), "prompt_progress": ev.as_json(),
                           **timed(ev.timings)}]
        return out + [{**self._partial(ev.text, ev.tokens), **timed(ev.timings)}]

    def failing(self, index: int) -> list[Any]:
        return self._release()

    def finished(self, index: int, result: Result) -> list[Any]:
        return self._release() + [self.final(result)]

    def closing(self) -> list[Any]:
        return []


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


# -- tokens -------------------------------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    body = await json_body(request)
    svc = await served(request, body, wake=True)
    content = get(body, "content", str, "")
    # add_special: the BOS / EOS the vocabulary adds (none where it adds none), as
    # llama.cpp's tokenizer does: the prompt a completion would evaluate
    special = None if get(body, "add_special", bool, False) else False
    ids = await off_loop(request, svc.tokenizer.encode, content, add_bos=special,
                         add_eos=special, parse_special=get(body, "parse_special", bool, True))
    pieces = get(body, "with_pieces", bool, False)
    data = await off_loop(request, _tokens_json, svc.tokenizer, ids, pieces)
    return web.Response(body=data, content_type="application/json")


_JSON_SLICE = 16384


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


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 on their own (part of a
    character), as llama.cpp's /tokenize gives them."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def detokenize(request: web.Request) -> web.Response:
    body = await json_body(request)
    svc = await served(request, body, wake=True)
    ids = await off_loop(request, token_list, body.get("tokens", []), "tokens",
                         svc.tokenizer.vocab_size)
    return json_response({"content": await off_loop(request, svc.tokenizer.decode, ids)})
