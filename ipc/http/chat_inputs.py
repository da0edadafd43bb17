"""A chat request's inputs: messages, tools and tool_choice, how the template renders
them; and the rendering itself, bounded by what the context can hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.upstream_facade import UpstreamFacade
from specd.daemon.spec.media import PromptImage
from specd.daemon.text.tool_calls import check_tools, forced_call_grammar, tool_names

from ..security import IDENTITY, is_own_user
from ..validation import BadRequest, check_text_bytes, check_tools_size, get, json_body, texts_in
from .media_inputs import chat_images, image_prompt
from .parsing import prompt_byte_limit
from .state import off_loop, served


@dataclass
class ChatInputs:
    """What a chat request renders its prompt from, and how it reads the reply."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # told to the model (None: none, or tool_choice none)
    names: set[str] | None  # the tools whose calls the reply is read for
    forced: str | None  # a grammar making the reply calls (tool_choice)
    # continue_final_message / add_generation_prompt, template_kwargs where given
    render: dict[str, Any]
    choice: Any = None  # tool_choice, as given (an upstream applies it)
    parallel: bool = True  # parallel_tool_calls
    # the images' file bytes, in the order of their media markers in `messages`
    images: list[bytes] = field(default_factory=list)


def tool_choice(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool = True
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


def chat_inputs(body: dict[str, Any], *, own_user: bool = False) -> ChatInputs:
    """own_user: the caller is the daemon's own OS user (its images may be local files)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("'messages' must be a non-empty array of {role, content}",
                         param="messages")
    messages, images = chat_images(messages, own_user=own_user)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be an array of objects", param="tools")
    check_tools_size(tools or [])
    try:
        check_tools(tools or [])
    except ValueError as exc:
        raise BadRequest(str(exc), param="tools") from None
    parallel = get(body, "parallel_tool_calls", bool, True)
    names, forced = tool_choice(tools, body.get("tool_choice"), parallel)
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
    return ChatInputs(messages, tools or None, names, forced, render,
                      body.get("tool_choice"), parallel, images)


def render(svc: ServiceFacade, chat: ChatInputs, how: str) -> Any:
    """The chat's prompt, rendered by the service's `how` ("render_chat": the text,
    "chat_tokens": its token ids); a template error, or more text than the context can
    hold, is a 400. An upstream's model takes the chat as messages (its template renders
    them): its "chat_tokens" are a ChatPrompt."""
    if chat.images and not svc.takes_images:
        raise BadRequest(f"{svc.model_name} takes no images: start it with --mmproj, the "
                         "vision projector of its family", param="messages")
    if isinstance(svc, UpstreamFacade) and how == "chat_tokens":
        return svc.chat_prompt(chat.messages, chat.tools, chat.choice, chat.parallel,
                               chat.render)
    check_text_bytes(texts_in(chat.messages) + texts_in(chat.tools or [])
                     + texts_in(chat.render.get("template_kwargs") or {}),
                     prompt_byte_limit(svc), "messages")
    try:
        return getattr(svc, how)(chat.messages, chat.tools, **chat.render)
    except ValueError as exc:
        raise BadRequest(f"chat template: {exc}") from None


def chat_prompt(svc: ServiceFacade, chat: ChatInputs) -> tuple[Any, tuple[PromptImage, ...]]:
    """The chat's prompt as `render(svc, chat, "chat_tokens")` gives it, and its images:
    with images, the rendered text split at their media markers and the images encoded
    (ServiceFacade.image_prompt; a bad image is a 400). Runs the vision encoder: call it
    off the event loop."""
    if not chat.images:
        return render(svc, chat, "chat_tokens"), ()
    return image_prompt(svc, render(svc, chat, "render_chat"), chat.images, "messages")


async def rendered(request: web.Request, how: str) -> Any:
    """The chat request's prompt (see render) for the model it names, prepared off the
    event loop."""
    body = await json_body(request)
    chat = chat_inputs(body, own_user=is_own_user(request.get(IDENTITY, "")))
    svc = await served(request, body, wake=True)
    if how == "chat_tokens":  # (the images' tokens counted too)
        return (await off_loop(request, chat_prompt, svc, chat))[0]
    return await off_loop(request, render, svc, chat, how)
