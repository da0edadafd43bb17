"""Chat templates: the real models' templates against transformers' renderings, the ChatML
fallback, and the sandbox."""

from __future__ import annotations

import json
import logging
from datetime import datetime

import pytest
from test_tokenizer import GOLDEN, real_metadata

from specd.daemon.text.chat_template import (
    CHATML_FALLBACK,
    ChatTemplateError,
    render_chat,
)

TEMPLATE_MODELS = sorted(
    name for name in GOLDEN if not name.startswith("_") and GOLDEN[name].get("chats")
)


@pytest.mark.real
@pytest.mark.parametrize("name", TEMPLATE_MODELS)
def test_real_templates_match_transformers(name: str) -> None:
    template = real_metadata(name).get("tokenizer.chat_template")
    assert template, f"{name} should ship a chat template"
    golden = GOLDEN[name]
    for chat in golden["chats"]:
        rendered = render_chat(
            template,
            chat["messages"],
            add_generation_prompt=chat["add_generation_prompt"],
            bos_token=golden["bos_token"] or "",
            eos_token=golden["eos_token"] or "",
        )
        assert rendered == chat["rendered"]


def test_chatml_fallback(caplog: pytest.LogCaptureFixture) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text",
                                                                     "text": "there "}]},
        {"role": "assistant", "content": "hello", "tool_calls": None},
    ]
    with caplog.at_level(logging.WARNING):
        out = render_chat(None, messages)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi\nthere <|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "no chat template" in caplog.text
    assert render_chat("", messages[:1], add_generation_prompt=False).endswith("<|im_end|>\n")
    assert render_chat(CHATML_FALLBACK, []) == "<|im_start|>assistant\n"


def test_openai_message_shapes_reach_the_template_as_it_expects() -> None:
    """Text parts joined; `content: null` kept (not a missing key); a tool call's JSON
    string arguments as the object; a non-text part refused."""
    template = ("{% for m in messages %}{{ m.role }}:"
                "{% if m.content is none %}<none>{% else %}{{ m.content }}{% endif %}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.arguments | tojson }}]"
                "{% endfor %};{% endfor %}")
    out = render_chat(template, [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                     "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"type": "function", "function": {"name": "g", "arguments": "not json"}}]},
    ], add_generation_prompt=False)
    assert out == 'user:a\nb;assistant:<none>[{"x": 1}]["not json"];'
    with pytest.raises(ValueError, match="part of type 'image_url' is not supported"):
        render_chat(template, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:"}}]}])


def test_null_content_where_the_template_joins_strings() -> None:
    """ChatML-style templates (SmolLM2's, the fallback) add content to strings: an
    assistant turn with tool calls and `content: null` renders as empty content there,
    while the template above still sees None."""
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny"}]
    out = render_chat(CHATML_FALLBACK, messages)
    assert "<|im_start|>assistant\n<|im_end|>" in out and "sunny" in out
    # a string's method called on it, as Qwen3's template does
    stripped = "{% for m in messages %}[{{ m.content.lstrip() }}]{% endfor %}"
    assert render_chat(stripped, messages) == "[weather?][][sunny]"
    with pytest.raises(ValueError, match="TypeError"):  # other type errors still surface
        render_chat("{{ messages[0].content + 1 }}", messages)


def test_hf_environment_features() -> None:
    template = (
        "{{ bos_token }}{{ messages[0] | tojson }}"
        "|{{ {'b': 1, 'a': '<é>'} | tojson(sort_keys=true) }}"
        "|{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}"
        "|{% generation %}gen{% endgeneration %}|{{ strftime_now('%Y') }}"
        "|{{ tools is none }}|{{ enable_thinking }}|{{ dict(a=1)['a'] }}"
        "\n  {% if add_generation_prompt %}\n    GEN\n  {% endif %}\n"
    )
    out = render_chat(
        template,
        [{"role": "user", "content": "hi"}],
        bos_token="<s>",
        enable_thinking=False,
    )
    year = datetime.now().strftime("%Y")
    assert out == (
        '<s>{"role": "user", "content": "hi"}|{"a": "<é>", "b": 1}|1|gen|'
        f"{year}|True|False|1\n    GEN\n"
    )
    assert json.loads(out.split("|")[0][3:]) == {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set ns = namespace(_secret=1) %}",
        "{{ messages.append({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses(template: str) -> None:
    with pytest.raises(ValueError, match="sandbox"):
        render_chat(template, [{"role": "user", "content": "hi"}])


def test_template_errors_are_value_errors() -> None:
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        render_chat(
            "{% if messages[0]['role'] == 'system' %}"
            "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}",
            [{"role": "system", "content": "x"}],
        )
    with pytest.raises(ValueError, match="does not compile"):
        render_chat("{% for m in messages %}", [])
    with pytest.raises(ValueError, match="ZeroDivisionError"):
        render_chat("{{ 1 // 0 }}", [])
    with pytest.raises(ValueError, match="dicts"):
        render_chat("{{ messages }}", ["not a dict"])  # type: ignore[list-item]
    assert issubclass(ChatTemplateError, ValueError)


# trims each message's content, as Llama 3's template does
TRIMMING = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_continue_final_message_leaves_the_assistant_turn_open() -> None:
    chat = [{"role": "user", "content": "Write f"},
            {"role": "assistant", "content": "def f(x):\n    "}]
    out = render_chat(CHATML_FALLBACK, chat, add_generation_prompt=False,
                      continue_final_message=True)
    assert out == ("<|im_start|>user\nWrite f<|im_end|>\n"
                   "<|im_start|>assistant\ndef f(x):\n    ")
    # a template that trims the content: cut after what it wrote
    assert render_chat(TRIMMING, chat, add_generation_prompt=False,
                       continue_final_message=True) == "<user>Write f</user><assistant>def f(x):"
    # no content to continue: a new turn, as without it
    empty = [chat[0], {"role": "assistant", "content": ""}]
    assert render_chat(CHATML_FALLBACK, empty, add_generation_prompt=False,
                       continue_final_message=True) == render_chat(CHATML_FALLBACK, chat[:1])
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        render_chat(CHATML_FALLBACK, chat, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not write"):
        render_chat("{% for m in messages %}{{ m.role }}{% endfor %}", chat,
                    add_generation_prompt=False, continue_final_message=True)


def test_absurdly_nested_values_are_a_value_error_not_a_recursion_error() -> None:
    from specd.daemon.text.chat_template import MAX_NESTING, ChatTemplateError, render_chat

    deep: object = "x"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ChatTemplateError, match=f"deeper than {MAX_NESTING}"):
        render_chat(None, [{"role": "user", "content": "hi", "extra": deep}])
    args = "[" * 100000 + "]" * 100000  # a tool call's arguments, as a JSON string
    calls = [{"type": "function", "function": {"name": "f", "arguments": args}}]
    with pytest.raises(ChatTemplateError, match="deeper than"):
        render_chat(None, [{"role": "assistant", "content": None, "tool_calls": calls}])
    shallow: object = "x"
    for _ in range(MAX_NESTING - 5):
        shallow = {"a": shallow}
    assert "hi" in render_chat(None, [{"role": "user", "content": "hi", "extra": shallow}])


def test_tojson_writes_a_filter_chains_generator_as_a_list() -> None:
    """llama.cpp's DeepSeek-R1 template lists its tools as `tools | map(attribute=
    'function') | tojson`: jinja's map yields a generator, written as the list."""
    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g"}}]
    out = render_chat("{{ tools | map(attribute='function') | tojson }}",
                      [{"role": "user", "content": "hi"}], tools=tools)
    assert out == '[{"name": "f"}, {"name": "g"}]'
    with pytest.raises(ChatTemplateError, match="not JSON serializable"):
        render_chat("{{ namespace(a=1) | tojson }}", [{"role": "user", "content": "hi"}])
