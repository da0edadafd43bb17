"""What both dialects report of a generation: token probabilities in each one's shape,
the speculation block, and llama.cpp's generation settings."""

from __future__ import annotations

import math
from typing import Any

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Result
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.sampling import TokenLogprob


def spec_block(r: Result) -> dict[str, Any]:
    """The `speculative` statistics of a request."""
    s = r.stats
    return {"drafted": s.drafted, "accepted": s.accepted,
            "mean_acceptance_length": round(s.mean_acceptance_length, 4),
            "rounds": s.rounds, "valid": s.valid,
            "drafter_failures": dict(s.drafter_failures)}


def generation_settings(svc: ServiceFacade, params: GenerationParams, *,
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
            "frequency_penalty": sp.frequency_penalty, "typical_p": sp.typical_p,
            "min_keep": sp.min_keep,
            "top_n_sigma": sp.top_n_sigma, "xtc_probability": sp.xtc_probability,
            "xtc_threshold": sp.xtc_threshold, "dry_multiplier": sp.dry_multiplier,
            "dry_base": sp.dry_base, "dry_allowed_length": sp.dry_allowed_length,
            "dry_penalty_last_n": sp.dry_penalty_last_n,
            "dry_sequence_breakers": list(sp.dry_sequence_breakers),
            "samplers": list(sp.chain), "stop": list(stop or []),
            "max_tokens": params.max_tokens, "n_predict": params.max_tokens,
            "ignore_eos": params.ignore_eos, "stream": stream, "logit_bias": bias,
            "n_probs": n_probs, "post_sampling_probs": post_sampling_probs,
            "speculative.n_max": dp.n_max, "speculative.n_min": dp.n_min,
            "speculative.p_min": dp.p_min, "speculative.adaptive": params.adaptive}


# -- token probabilities ------------------------------------------------------------------
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


def llama_probs(svc: ServiceFacade, logprobs: list[TokenLogprob], post: bool = False
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


def openai_logprobs(svc: ServiceFacade, logprobs: list[TokenLogprob], texts: list[str],
                    offset: int, *, chat: bool, post: bool) -> dict[str, Any]:
    """A choice's `logprobs` on the OpenAI routes: OpenAI's objects, or with
    `post_sampling_probs` llama-server's entries (`prob`, `top_probs`) under `content`, as it
    answers those routes."""
    if post:
        return {"content": llama_probs(svc, logprobs, post=True)}
    return (_chat_logprobs(svc, logprobs) if chat
            else _completion_logprobs(svc, logprobs, texts, offset))
