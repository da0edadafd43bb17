"""Real weights: SmolLM2-135M (real tokenizer, real answers) and the Qwen2.5-Coder pair."""

from __future__ import annotations

import ast
import json
import re

import pytest

from specd.daemon.drafters.composite import CompositeDrafter
from specd.daemon.drafters.dflash import DFlashDrafter
from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.text.tool_calls import parse_tool_calls, tool_names
from specd.ort_models.runner import ModelRunner

from speculation_checks import assert_speculated, decode_all


def _engine(target: str, draft: str | None = None, **kw) -> Engine:
    """An engine on catalog models, fetched first (the test skips only where they cannot be
    downloaded); any error building it fails the test."""
    from conftest import fetched_model

    for name in (target, draft):
        if name is not None:
            fetched_model(name)
    return Engine(EngineConfig(target=target, draft=draft, **kw))


def _run(engine: Engine, prompt: list[int], *, drafter=None, **kw) -> Generation:
    """The request decoded to its end (its tokens: `.tokens`, its rounds: `.stats`)."""
    gen = Generation(engine.target.runner, 0, prompt, GenerationParams(**kw),
                     eog=engine.eog_ids, drafter=drafter)
    decode_all(gen)
    return gen


def _generate(engine: Engine, prompt: list[int], **kw) -> list[int]:
    return _run(engine, prompt, **kw).tokens


@pytest.fixture(scope="module")
def smol() -> Engine:
    return _engine("smollm2-135m-instruct", n_ctx=1024)


@pytest.mark.real
def test_smollm2_knows_the_capital_of_france(smol: Engine) -> None:
    prompt = smol.encode_prompt("What is the capital of France?", chat=True)
    text = smol.tokenizer.decode(_generate(smol, prompt, max_tokens=48), skip_special=True)
    assert "Paris" in text, text


@pytest.mark.real
@pytest.mark.parametrize("n_max", [1, 2, 4, 8, 16])
def test_smollm2_self_draft_is_byte_identical(smol: Engine, n_max: int) -> None:
    prompt = smol.encode_prompt("Write a haiku about autumn leaves.", chat=True)
    want = _generate(smol, prompt, max_tokens=48, ignore_eos=True)
    drafter = DraftModelDrafter(ModelRunner(smol.target.built, n_ctx=1024))
    got = _run(smol, prompt, drafter=drafter, max_tokens=48, ignore_eos=True,
               draft=DraftParams(n_max=n_max, p_min=0.5 if n_max == 8 else 0.0))
    assert got.tokens == want
    assert_speculated(got.stats, min_first=0.9)  # the model drafting for itself


@pytest.fixture(scope="module")
def qwen_pair() -> Engine:
    return _engine("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", n_ctx=1024)


CODE_PROMPT = "Write a Python function is_palindrome(s) that ignores case and spaces."


@pytest.mark.slow
def test_qwen_coder_writes_a_plausible_function(qwen_pair: Engine) -> None:
    prompt = qwen_pair.encode_prompt(CODE_PROMPT, chat=True)
    text = qwen_pair.tokenizer.decode(_generate(qwen_pair, prompt, max_tokens=160),
                                      skip_special=True)
    m = re.search(r"```(?:python)?\n(.*?)(```|$)", text, re.S)
    code = m.group(1) if m else text
    tree = ast.parse(code)
    names = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert "is_palindrome" in names, text


@pytest.mark.slow
@pytest.mark.parametrize("prompt_text", [
    CODE_PROMPT,
    "Explain in two sentences why the sky is blue.",
])
def test_qwen_pair_speculation_is_byte_identical(qwen_pair: Engine, prompt_text: str) -> None:
    prompt = qwen_pair.encode_prompt(prompt_text, chat=True)
    want = _generate(qwen_pair, prompt, max_tokens=64, ignore_eos=True)
    assert isinstance(qwen_pair.drafter, CompositeDrafter)  # spec type auto with a draft
    [model] = qwen_pair.drafter.models
    for n_max in (4, 16):
        got = _run(qwen_pair, prompt, drafter=model, max_tokens=64,
                   ignore_eos=True, draft=DraftParams(n_max=n_max))
        assert got.tokens == want, n_max
        assert_speculated(got.stats, min_first=0.5)
    # the draft model and prompt lookup, chosen per round by the adaptive controller
    got = _run(qwen_pair, prompt, drafter=qwen_pair.drafter, max_tokens=64,
               ignore_eos=True, draft=DraftParams(n_max=8), adaptive=True)
    assert got.tokens == want
    assert_speculated(got.stats)


@pytest.mark.slow
def test_the_shipped_head_drafts_for_the_qwen_target_byte_identically() -> None:
    engine = _engine("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-dflash", n_ctx=1024)
    assert engine.spec_type == "draft-dflash" and engine.head is not None
    prompt = engine.encode_prompt(CODE_PROMPT, chat=True)
    want = _generate(engine, prompt, max_tokens=96, ignore_eos=True)
    # the head alone, its whole block every round: its own drafts are accepted
    gen = _run(engine, prompt, drafter=DFlashDrafter(engine.head), max_tokens=96,
               ignore_eos=True, draft=DraftParams(n_max=7), adaptive=False)
    assert gen.tokens == want
    assert gen.stats.mean_acceptance_length > 1.2, gen.stats.mean_acceptance_length
    # with prompt lookup in front, lengths chosen per round
    got = _run(engine, prompt, drafter=engine.drafter, max_tokens=96, ignore_eos=True,
               draft=DraftParams(n_max=8), adaptive=True)
    assert got.tokens == want
    assert_speculated(got.stats)


WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.mark.slow
def test_qwen_coder_calls_a_tool(qwen_pair: Engine) -> None:
    """The default target, given a tool through its own template, answers with a call that
    specd reads as one (it writes a ```json block rather than <tool_call> tags)."""
    prompt = qwen_pair.chat_tokens(
        [{"role": "user", "content": "What's the weather in Paris right now?"}], WEATHER_TOOL)
    text = qwen_pair.tokenizer.decode(_generate(qwen_pair, prompt, max_tokens=60),
                                      skip_special=True)
    content, calls = parse_tool_calls(text, tool_names(WEATHER_TOOL))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})], text
    assert content is None
