"""Rendering a model's chat template (`tokenizer.chat_template`) the way transformers does.

Templates come with downloaded models, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment`, with the environment transformers' `apply_chat_template` sets
up (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that does not escape HTML, a `{% generation %}` tag, namespaces without underscore names).
Every failure, a template bug or a sandbox refusal, comes out as `ValueError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

# Used when a model ships no template. Content may be a string or a list of text parts.
CHATML_FALLBACK = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

FALLBACK_NOTE = (
    "the model has no chat template (tokenizer.chat_template); using a ChatML fallback "
    "(<|im_start|>role ... <|im_end|>), which may not be what the model was trained on"
)


class ChatTemplateError(ValueError):
    """A chat template that failed to compile or render; the message says why."""


# how deep values inside messages and tools may nest (JSON schemas need a few dozen)
MAX_NESTING = 100


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """The prompt text `template` makes of `messages`.

    `template` None or empty: the ChatML fallback (with a logged note). `extra` goes to the
    template as variables (`tools`, `documents`, `enable_thinking`, ...); `tools` and
    `documents` are None unless given, as transformers passes them.

    `continue_final_message` (assistant prefill): the text ends with the last message's
    content, not closed, so that the model continues it (transformers' rule: the rendered
    chat is cut after the content's last occurrence; a final message with no content is a
    new turn instead). It cannot be combined with `add_generation_prompt`.
    """
    if continue_final_message:
        if add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt "
                                    "cannot both be set")
        if not messages:
            raise ChatTemplateError("continue_final_message needs a final message")
        final = _message(messages[-1]).get("content") or ""
        if not isinstance(final, str) or not final.strip():
            return render_chat(template, messages[:-1], bos_token=bos_token,
                               eos_token=eos_token, **extra)
        text = render_chat(template, messages, add_generation_prompt=False,
                           bos_token=bos_token, eos_token=eos_token, **extra)
        for part in (final, final.strip()):  # some templates (Llama 3) trim contents
            end = text.rfind(part)
            if end >= 0:
                return text[: end + len(part)]
        raise ChatTemplateError("continue_final_message: the chat template does not write "
                                "the final message's content as given")
    if not template:
        log.warning(FALLBACK_NOTE)
        template = CHATML_FALLBACK
    compiled = _compile(template)
    variables: dict[str, Any] = {"tools": None, "documents": None}
    variables.update(_plain(extra))
    variables.update(
        messages=[_message(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    try:
        try:
            return compiled.render(**variables)
        except (TypeError, jinja2.exceptions.UndefinedError):
            # `content: null` (an assistant turn with tool calls) where the template joins
            # content as a string (SmolLM2's, ChatML ones) or calls a string's method on
            # it (Qwen3's `content.lstrip()`): again with "" for it, as templates that
            # test `content is none` got None first
            nulls = [m for m in variables["messages"] if m.get("content", "") is None]
            if not nulls:
                raise
            for m in nulls:
                m["content"] = ""
            return compiled.render(**variables)
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from None
    except Exception as exc:  # templates can fail in any way Python can
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A plain copy, as OpenAI clients send it normalised the way the model's template
    expects (what transformers and llama.cpp's server do):

    - `content` given as a list of parts becomes their text, joined by newlines (a part
      that is not text is refused: these models read text only);
    - a tool call's `function.arguments`, a JSON string in OpenAI's format, becomes the
      object it encodes (templates `tojson` it themselves), unless it is not valid JSON;
    - None values stay None (`content: null` on an assistant turn with tool calls; a
      template that cannot join None gets "" instead, see render_chat).
    """
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
    out = {str(k): _plain(v, 1) for k, v in message.items()}
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"message content part of type {kind!r} is not "
                                        "supported (text parts only)")
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    for call in out.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = _plain(json.loads(fn["arguments"]), 4)
            except RecursionError:
                raise _too_deep() from None
            except ValueError:
                pass  # left as the client sent it
    return out


def _too_deep() -> ChatTemplateError:
    return ChatTemplateError(f"values in the chat nest deeper than {MAX_NESTING} levels")


def _plain(value: Any, depth: int = 0) -> Any:
    """Rebuild template data from plain JSON types, so no object's methods reach the template
    (nesting deeper than MAX_NESTING is refused)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if depth >= MAX_NESTING:
        raise _too_deep()
    if isinstance(value, Mapping):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from None
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None


class _Sandbox(ImmutableSandboxedEnvironment):
    """Refuses unsafe attribute access at once (jinja would render it as an empty Undefined)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _TemplateDict()
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson: no HTML escaping, and json.dumps' options (as transformers);
    # a filter's generator (`tools | map(attribute='function')`) as the list it yields, as
    # llama.cpp's template engine writes it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
        sort_keys=sort_keys, default=_generated_list)


def _generated_list(value: Any) -> list[Any]:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed names (no reaching into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): the body
    renders as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()
