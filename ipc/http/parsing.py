"""Request parsing the dialects share: generation settings over the daemon's defaults,
prompts (text, token ids, several; infill's), constraints, and the checks that a prompt
fits and a model name is served."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.upstream import OutputFormat
from specd.daemon.serving.upstream_facade import UpstreamFacade
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams, RequestError
from specd.daemon.spec.sampler_chain import parse_samplers
from specd.daemon.spec.sampling import SamplerParams
from specd.daemon.text.grammar import Grammar, GrammarError
from specd.daemon.text.infill import DEFAULT_CHUNK_FILE, ExtraChunk, has_fim, infill_tokens
from specd.daemon.text.tokenizer import Tokenizer

from ..validation import (
    BadRequest,
    check_constraint_size,
    check_text_bytes,
    get,
    logit_bias,
    texts_in,
    token_list,
)
from .state import STRICT_MODEL_NAME, service

MIN_BYTES_PER_TOKEN = 32


# -- settings -----------------------------------------------------------------------------
def generation_params(svc: ServiceFacade, body: dict[str, Any], *, max_key: str
                      ) -> GenerationParams:
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
            seed=None if seed is None or seed < 0 else seed,
            **sampler_chain_settings(body, d.sampling)).validate()
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


def sampler_chain_settings(body: dict[str, Any], d: SamplerParams) -> dict[str, Any]:
    """llama-server's sampler chain fields over the daemon's defaults: `samplers` (names or
    one letter each; an unknown one is a 400 naming it), typical, min_keep, top-n-sigma,
    XTC and DRY (a dry_base below 1 means the default, as llama-server reads it)."""
    samplers = body.get("samplers")
    if samplers is None:
        chain = d.samplers
    elif isinstance(samplers, str | list):
        try:
            chain = parse_samplers(samplers)
        except ValueError as exc:
            raise BadRequest(str(exc), param="samplers") from None
    else:
        raise BadRequest(f"'samplers' must be an array of names or a string of letters, "
                         f"got {type(samplers).__name__}", param="samplers")
    dynatemp = get(body, "dynatemp_range", float, 0.0)
    if dynatemp != 0.0:
        raise BadRequest("'dynatemp_range' (dynamic temperature) is not supported by specd",
                         param="dynatemp_range")
    dry_base = get(body, "dry_base", float, d.dry_base)
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None and (not isinstance(breakers, list) or not breakers
                                 or not all(isinstance(b, str) for b in breakers)):
        raise BadRequest("'dry_sequence_breakers' must be a non-empty array of strings",
                         param="dry_sequence_breakers")
    return {
        "samplers": chain,
        "typical_p": get(body, "typical_p", float, d.typical_p),
        "min_keep": get(body, "min_keep", int, d.min_keep, lo=0, hi=(1 << 31) - 1),
        "top_n_sigma": get(body, "top_n_sigma", float, d.top_n_sigma),
        "xtc_probability": get(body, "xtc_probability", float, d.xtc_probability, lo=0, hi=1),
        "xtc_threshold": get(body, "xtc_threshold", float, d.xtc_threshold, lo=0, hi=1),
        "dry_multiplier": get(body, "dry_multiplier", float, d.dry_multiplier),
        "dry_base": d.dry_base if dry_base < 1.0 else dry_base,
        "dry_allowed_length": get(body, "dry_allowed_length", int, d.dry_allowed_length,
                                  lo=0, hi=1 << 31),
        "dry_penalty_last_n": get(body, "dry_penalty_last_n", int, d.dry_penalty_last_n,
                                  lo=-1, hi=1 << 31),
        "dry_sequence_breakers": (d.dry_sequence_breakers if breakers is None
                                  else tuple(breakers)),
    }


def unsupported(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    """A field asking for what specd does not do is a clear 400, not silently ignored
    (a client reading logprobs would otherwise fail on the missing data)."""
    for name in fields:
        value = body.get(name)
        if value not in (None, False, 0, ""):
            raise BadRequest(f"'{name}' is not supported by specd", param=name)


# -- model names --------------------------------------------------------------------------
def check_model(request: web.Request, body: dict[str, Any]) -> None:
    """Any model name (or none, or "") is served by the loaded model, as llama-server
    does: clients hard-code "gpt-3.5-turbo" or send "" (llama.vim), and responses name
    the model that answered. `--strict-model-name` makes an unknown name a 404."""
    model = get(body, "model", str, None)
    if not model or not request.app[STRICT_MODEL_NAME] or model in service(
            request).upstream_names:
        return
    known_model(service(request), model)


def known_model(svc: ServiceFacade, name: str) -> None:
    """A 404 unless `name` is one a local model answers to."""
    if name not in svc.served_names:
        served = ", ".join(repr(n) for n, _ in svc.local_models())
        raise BadRequest(f"unknown model {name!r}; this daemon serves {served}",
                         status=404, code="model_not_found", param="model")


# -- prompts ------------------------------------------------------------------------------
def prompt_byte_limit(svc: ServiceFacade) -> int:
    """The most bytes of text that can tokenize into the context: each token stands for
    at most the vocabulary's longest token (and no tokenizer here drops characters), so
    longer text cannot fit and is refused before tokenizing."""
    return svc.n_ctx * _bytes_per_token(svc.tokenizer)


@functools.lru_cache(maxsize=8)
def _bytes_per_token(tok: Tokenizer) -> int:
    longest = max((len(tok.token_bytes(i)) for i in range(tok.vocab_size)), default=0)
    return max(MIN_BYTES_PER_TOKEN, longest)


def check_prompt_bytes(svc: ServiceFacade, value: Any, param: str) -> None:
    check_text_bytes(texts_in(value), prompt_byte_limit(svc), param)


def prompt_tokens(svc: ServiceFacade, value: Any, name: str = "prompt") -> list[int]:
    """The OpenAI completions API's `prompt`: a text, or token ids (one of them in a list)."""
    tok = svc.tokenizer
    check_prompt_bytes(svc, value, name)
    if isinstance(value, str):
        return tok.encode(value, parse_special=True)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        return prompt_tokens(svc, value[0], name)
    return token_list(value, name, tok.vocab_size)


def prompt_items(value: Any, param: str = "input") -> list[Any]:
    """The prompts `value` holds, as llama-server reads `prompt` / `input` / `content`:
    one (a text, an object, an array of ids with text among them) or an array of
    those (several prompts)."""
    if isinstance(value, list):
        if not value:
            raise BadRequest(f"the {param} is empty", param=param)
        if any(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return [value]  # one input of ids (with text among them)
        return list(value)
    return [value]


def prompt_item_tokens(svc: ServiceFacade, item: Any, param: str = "input",
                       tok: Tokenizer | None = None) -> list[int]:
    """The token ids of one prompt: a text, an array of ids (text among them is
    tokenized in place), {"prompt_string": text} or {"content": [text parts]}. A text
    may give no tokens. `tok`: the tokenizer (default: the target's)."""
    tok = tok or svc.tokenizer
    if isinstance(item, dict):
        if "multimodal_data" in item:
            raise BadRequest("'multimodal_data' is read by /completion (one prompt) and "
                             "the embeddings routes, not here", param=param)
        if isinstance(item.get("prompt_string"), str):
            item = item["prompt_string"]
        elif isinstance(item.get("content"), list) and all(
                isinstance(p, dict) and p.get("type") == "text"
                and isinstance(p.get("text"), str) for p in item["content"]):
            item = "".join(p["text"] for p in item["content"])
        else:
            raise BadRequest(f"a '{param}' object needs 'prompt_string' or 'content' as "
                             "an array of text parts (this route reads text only)",
                             param=param)
    check_prompt_bytes(svc, item, param)
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


def prompts(svc: ServiceFacade, value: Any, param: str = "input",
            tok: Tokenizer | None = None) -> list[list[int]]:
    """The token ids of each prompt `value` holds (prompt_items, prompt_item_tokens)."""
    return [prompt_item_tokens(svc, item, param, tok) for item in prompt_items(value, param)]


def infill_prompt(svc: ServiceFacade, body: dict[str, Any], max_tokens: int) -> list[int]:
    """llama.cpp's /infill prompt (`daemon.infill`): extra files, then prefix, suffix and
    prompt, trimmed to leave the context room for the completion."""
    tok = svc.tokenizer
    if not has_fim(tok):
        raise BadRequest("this model's vocabulary has no FIM tokens: infill (a prefix and "
                         "a suffix) is unavailable")
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


def check_fits(svc: ServiceFacade, prompt: list[int], param: str) -> None:
    if not prompt:
        raise BadRequest("the prompt is empty", param=param)
    try:
        svc.check_prompt(prompt)
    except RequestError as exc:
        raise BadRequest(str(exc), code="context_length_exceeded", param=param) from None


# -- constraints --------------------------------------------------------------------------
async def constraint(svc: ServiceFacade, body: dict[str, Any], forced: str | None = None
                     ) -> Grammar | OutputFormat | None:
    """OpenAI `response_format`, or the native `json_schema` / `grammar` / `regex` fields;
    or `forced`, the grammar of the tool calls tool_choice demands (alone). For an
    upstream's model: the JSON format it is asked for (it applies tool_choice itself)."""
    if isinstance(svc, UpstreamFacade):
        requested = _requested(body)
        return None if requested is None else svc.output_format(*requested[:2])
    grammar = await _requested_constraint(svc, body)
    if forced is None:
        return grammar
    if grammar is not None:
        raise BadRequest("tool_choice that forces a call cannot be combined with "
                         "another constraint", param="tool_choice")
    try:
        # the calls' arguments are JSON: their numbers bounded as a schema's are
        return await svc.compile_constraint("lark", forced, bound_numbers=True)
    except GrammarError as exc:
        raise BadRequest(f"tools: {exc}", param="tools") from None


async def _requested_constraint(svc: ServiceFacade, body: dict[str, Any]) -> Grammar | None:
    requested = _requested(body)
    if requested is None:
        return None
    kind, spec, param = requested
    try:
        return await svc.compile_constraint(kind, spec)
    except GrammarError as exc:
        raise BadRequest(str(exc), param=param) from None


def _requested(body: dict[str, Any]) -> tuple[str, Any, str | None] | None:
    """(the constraint's kind, its spec, what a 400 names) of the request's one
    constraint, checked; None where it has none."""
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
    return kind, spec, "response_format" if rf else None
