"""Constraints inside the real decode loop (ORT tiny models, draft model speculation)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.serving.engine import EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.daemon.text.grammar import compile_constraint
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from live_server import live_server
from speculation_checks import assert_speculated

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "point": {"type": "object", "properties": {"x": {"type": "number"}},
                  "required": ["x"], "additionalProperties": False}},
     "required": ["tags", "point"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f]{2,4}$"}},
     "required": ["id"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    tp = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=8, context_length=1024)
    dp = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=8, perturb=0.01,
                            context_length=1024)
    tok = Tokenizer.from_metadata(GGUFFile(tp).metadata)
    return load_or_build(tp), load_or_build(dp), tok, tp


def _run(built, tok, schema, *, drafter=None, **kw):
    grammar = compile_constraint("json_schema", schema, tok).start()
    prompt = tok.encode("<|im_start|>user\ngive json<|im_end|>\n<|im_start|>assistant\n")
    gen = Generation(ModelRunner(built, n_ctx=512), 0, prompt, GenerationParams(**kw),
                     eog=set(tok.eot_ids), drafter=drafter, grammar=grammar)
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    return out, gen


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "pattern"])
def test_outputs_validate_and_greedy_is_identical_with_a_draft(setup, schema) -> None:
    target, draft, tok, _ = setup
    want, g0 = _run(target, tok, schema, max_tokens=200)
    assert g0.finish_reason == "stop", g0.finish_reason
    jsonschema.validate(json.loads(tok.decode(want, skip_special=True)), schema)
    # a budget that ends on the token completing the object cut nothing off: "stop"
    assert _run(target, tok, schema, max_tokens=len(want))[1].finish_reason == "stop"
    assert _run(target, tok, schema, max_tokens=len(want) - 1)[1].finish_reason == "length"
    for drafter in (DraftModelDrafter(ModelRunner(draft, n_ctx=512)), NgramDrafter()):
        got, g1 = _run(target, tok, schema, drafter=drafter, max_tokens=200,
                       draft=DraftParams(n_max=4))
        assert got == want
        if isinstance(drafter, DraftModelDrafter):  # lookups find few repeats here
            assert_speculated(g1.stats)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "pattern"])
@pytest.mark.parametrize("probabilistic", [False, True])
def test_sampled_outputs_validate(setup, schema, probabilistic) -> None:
    target, draft, tok, _ = setup
    for seed in range(3):
        out, gen = _run(target, tok, schema, max_tokens=200,
                        drafter=DraftModelDrafter(ModelRunner(draft, n_ctx=512)),
                        sampling=SamplerParams(temperature=0.8, seed=seed),
                        draft=DraftParams(n_max=4, probabilistic=probabilistic))
        assert gen.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(out, skip_special=True)), schema)


def test_http_response_format_and_bad_constraints(setup, tmp_path, monkeypatch) -> None:
    *_, path = setup
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server(cfg, tmp_path) as srv:
        status, out = srv.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "json please"}], "max_tokens": 200,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": SCHEMAS[0]}}})
        assert status == 200, out
        jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), SCHEMAS[0])
        status, out = srv.request("POST", "/completion", {"prompt": "x", "regex": "[ab]{2}",
                                                          "n_predict": 10})
        assert status == 200 and out["content"] in ("aa", "ab", "ba", "bb"), out
        status, out = srv.request("POST", "/completion", {"prompt": "x", "regex": "[ab"})
        assert status == 400 and "regex" in out["error"]["message"]
        status, out = srv.request("POST", "/completion", {"prompt": "x", "regex": "a\ud800"})
        assert status == 400 and "not valid Unicode" in out["error"]["message"], out
        # "" is no grammar, as llama.cpp's clients send it
        status, out = srv.request("POST", "/completion", {"prompt": "x", "grammar": " ",
                                                          "n_predict": 2})
        assert status == 200 and out["tokens_predicted"] == 2, out
        # compiles, but llguidance's lexer gives up on the first token: a dead end, not a 500
        status, out = srv.request("POST", "/completion", {"prompt": "x", "n_predict": 4,
                                                          "regex": "(a{1000}){1000}"})
        assert status == 200 and out["stop_type"] == "grammar_dead_end", out
        status, out = srv.request("POST", "/v1/completions", {
            "prompt": "x", "response_format": {"type": "json_schema",
                                               "json_schema": {"schema": {"type": "nope"}}}})
        assert status == 400, out
        assert srv.request("GET", "/health")[0] == 200


@pytest.mark.parametrize("budget", [3, 9])
def test_a_reasoning_budget_holds_under_speculation(setup, budget) -> None:
    """A reasoning budget riding on a grammar state (the prompt opened <think>): the end
    tag comes right after `budget` tokens, and greedy output is the same with a draft
    model drafting (and accepted) as without one."""
    from specd.daemon.text.reasoning import END
    from specd.daemon.text.reasoning_budget import ReasoningBudget, partial_utf8_ids

    target, draft, tok, _ = setup
    start, end = (tuple(tok.encode(t, add_bos=False)) for t in ("<think>", END))
    budgeted = compile_constraint("regex", r"(?s:.*)", tok).with_budget(
        ReasoningBudget(start, end, budget, True, (), partial_utf8_ids(tok)))
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")

    def run(drafter=None, **kw):
        gen = Generation(ModelRunner(target, n_ctx=512), 0, prompt,
                         GenerationParams(max_tokens=40, **kw), eog=set(tok.eot_ids),
                         drafter=drafter, grammar=budgeted.start())
        out = gen.prefill()
        while not gen.done:
            out += gen.step()
        return out, gen

    want, _ = run()
    at = next(i for i in range(len(want)) if tuple(want[i:i + len(end)]) == end)
    assert budget <= at <= budget + 3  # (a character ended first: at most 3 bytes more)
    got, g1 = run(DraftModelDrafter(ModelRunner(draft, n_ctx=512)),
                  draft=DraftParams(n_max=4))
    assert got == want
    assert_speculated(g1.stats)
