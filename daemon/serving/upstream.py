"""Models served by another server (`specd serve --upstream NAME=URL`): an
OpenAI-compatible one (vLLM, SGLang, llama-server) on another machine.

A request naming NAME goes to the upstream's /v1/chat/completions as chat messages, its
streamed answer (server-sent events) read into the Pieces and the final Result a local
request gives, so that every dialect answers it unchanged. The upstream's tool calls
come as the tagged calls a local model writes (tool_calls.py reads them back); its
usage is asked for (`stream_options.include_usage`) and kept. Its errors become an
UpstreamError with the status specd answers: the upstream's own 4xx, 502 where it fails
or cannot be reached, 504 where it does not answer in time. The bearer token is sent to
the upstream only: never logged, and wiped from any message the upstream sends back.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.daemon.spec.stats import SpecStats
from specd.daemon.text.tool_calls import CLOSE, OPEN

from .service import Piece, ProgressEvent, Result, llama_timings

log = logging.getLogger("specd.upstream")

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between two reads: a long prompt's prefill on a busy upstream
MAX_EVENT_BYTES = 16 << 20  # one server-sent event (a tool call's arguments, at most)
MAX_ERROR_BYTES = 64 << 10  # of an error answer's body
# the settings a request starts from: each left at its neutral value here is not sent,
# so the upstream applies its own default (max_tokens -1: none given)
NEUTRAL = GenerationParams(max_tokens=-1, sampling=SamplerParams(temperature=1.0))


class UpstreamError(Exception):
    """The upstream failed the request: `status` is what specd answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class UpstreamSpec:
    """`--upstream NAME=URL` (and its token, from `--upstream-token-file`)."""

    name: str
    url: str  # the server's base URL, with or without /v1
    token: str | None = field(default=None, repr=False)

    @staticmethod
    def parse(spec: str, token: str | None = None) -> UpstreamSpec:
        name, sep, url = spec.partition("=")
        name, url = name.strip(), url.strip()
        parts = urlsplit(url)
        if not sep or not name or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--upstream {spec!r}: expected NAME=URL with an http(s) URL "
                             "(e.g. big=http://gpu-box:8000)")
        return UpstreamSpec(name, url.rstrip("/"), token)

    @property
    def endpoint(self) -> str:
        base = self.url
        return base + ("/chat/completions" if base.endswith("/v1") else
                       "/v1/chat/completions")


@dataclass(frozen=True)
class ChatPrompt:
    """A chat as it is forwarded: the messages, not rendered (the upstream's template
    renders them), with the tools and how the template is asked to render."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    render: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OutputFormat:
    """A JSON constraint the upstream applies, as OpenAI's `response_format`."""

    kind: str  # json_object | json_schema
    spec: Any = None  # the schema

    def as_openai(self) -> dict[str, Any]:
        if self.kind == "json_object" and self.spec is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.spec}}


# -- the request --------------------------------------------------------------------------
def request_body(model: str, prompt: ChatPrompt, params: GenerationParams,
                 stop: list[str] | None, fmt: OutputFormat | None) -> dict[str, Any]:
    """The upstream's /v1/chat/completions body: streamed, with usage; only the
    settings the request changed from NEUTRAL."""
    body: dict[str, Any] = {"model": model, "messages": _openai_messages(prompt.messages),
                            "stream": True, "stream_options": {"include_usage": True}}
    if prompt.tools:
        body["tools"] = prompt.tools
        if prompt.tool_choice is not None:
            body["tool_choice"] = prompt.tool_choice
        if not prompt.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if prompt.render.get("continue_final_message"):  # vLLM's names for a prefill
        body.update(continue_final_message=True, add_generation_prompt=False)
    if prompt.render.get("template_kwargs"):
        body["chat_template_kwargs"] = prompt.render["template_kwargs"]
    if params.max_tokens >= 0:
        body["max_tokens"] = params.max_tokens
    s, n = params.sampling, NEUTRAL.sampling
    for key, value, neutral in (
            ("temperature", s.temperature, n.temperature), ("top_p", s.top_p, n.top_p),
            ("top_k", s.top_k, n.top_k), ("min_p", s.min_p, n.min_p),
            ("presence_penalty", s.presence_penalty, n.presence_penalty),
            ("frequency_penalty", s.frequency_penalty, n.frequency_penalty),
            # vLLM's and SGLang's name, and llama-server's
            ("repetition_penalty", s.repeat_penalty, n.repeat_penalty),
            ("repeat_penalty", s.repeat_penalty, n.repeat_penalty)):
        if value != neutral:
            body[key] = value
    if s.seed is not None:
        body["seed"] = s.seed
    if params.ignore_eos:
        body["ignore_eos"] = True
    if stop:
        body["stop"] = stop
    if fmt is not None:
        body["response_format"] = fmt.as_openai()
    return body


def _openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as OpenAI's API takes them: a tool call's arguments as JSON text
    (Ollama's clients send an object), each call with an id."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {}) if isinstance(c, dict) else {}
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments") or {})
                fixed.append({**c, "type": "function", "function": fn,
                              "id": c.get("id") or "call_" + uuid.uuid4().hex[:24]})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# -- the answer ---------------------------------------------------------------------------
class SSEParser:
    """The `data` of each server-sent event, from the bytes as they arrive."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        out: list[str] = []
        start = 0
        while (nl := self._buf.find(b"\n", start)) >= 0:
            self._line(bytes(self._buf[start:nl]).rstrip(b"\r").decode("utf-8", "replace"),
                       out)
            start = nl + 1
        del self._buf[:start]
        if len(self._buf) + sum(len(d) for d in self._data) > MAX_EVENT_BYTES:
            raise ValueError(f"an event of more than {MAX_EVENT_BYTES >> 20} MiB")
        return out

    def close(self) -> list[str]:
        """The event the stream ended in (without its blank line)."""
        out: list[str] = []
        if self._buf:
            self._line(bytes(self._buf).decode("utf-8", "replace"), out)
            self._buf.clear()
        self._line("", out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if not line:  # an event ends
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):  # a comment (keep-alive)
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


class ChunkReader:
    """An answer's chunks (chat.completion.chunk objects) read into text, tool calls,
    the finish reason and the usage."""

    def __init__(self, name: str):
        self.name = name
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}
        self.pieces = 0
        self._calls: dict[int, dict[str, str]] = {}

    def feed(self, chunk: Any) -> str:
        """One chunk's new text (an error chunk raises UpstreamError)."""
        if not isinstance(chunk, dict):
            raise UpstreamError(502, f"upstream {self.name!r} sent a chunk that is not an "
                                "object")
        if chunk.get("error") is not None:
            raise UpstreamError(502, f"upstream {self.name!r} failed: "
                                f"{_message(chunk)}")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        text = ""
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            # a whole answer (a server that did not stream) has a message, not a delta;
            # reasoning (reasoning_content) has no channel in the dialects: not passed on
            delta = choice.get("delta") or choice.get("message") or {}
            if isinstance(delta.get("content"), str):
                text += delta["content"]
            for call in delta.get("tool_calls") or []:
                self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        if text:
            self.text.append(text)
            self.pieces += 1
        return text

    def _call(self, call: Any) -> None:
        """A tool call's part: its name, and its arguments' text in parts."""
        if not isinstance(call, dict):
            return
        got = self._calls.setdefault(int(call.get("index", len(self._calls))),
                                     {"name": "", "arguments": ""})
        fn = call.get("function") or {}
        if isinstance(fn.get("name"), str):
            got["name"] += fn["name"]
        if isinstance(fn.get("arguments"), str):
            got["arguments"] += fn["arguments"]
        elif isinstance(fn.get("arguments"), dict):
            got["arguments"] += json.dumps(fn["arguments"])

    def calls_text(self) -> str:
        """The tool calls as a local model writes them (tagged JSON, tool_calls.py)."""
        out = "".join(f"{OPEN}\n" + json.dumps({"name": c["name"],
                                               "arguments": c["arguments"] or "{}"})
                      + f"\n{CLOSE}" for _, c in sorted(self._calls.items()))
        if out:
            self.text.append(out)
        return out


def _message(payload: Any) -> str:
    """The message of an error answer: OpenAI's {"error": {"message"}}, vLLM's
    {"message"}, FastAPI's {"detail"}, or the text."""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for value in (err, payload.get("message"), payload.get("detail")):
            if isinstance(value, str) and value:
                return value
    return str(payload)[:500]


def error_for(name: str, status: int, text: str) -> UpstreamError:
    """The upstream's error answer as specd's: a 4xx is the client's to fix (its status
    and message kept); a refused credential is specd's setup, and a 5xx the upstream's
    failure (502); the upstream's gateway timeout stays one (504)."""
    try:
        message = _message(json.loads(text))
    except ValueError:
        message = text.strip()[:500] or "no message"
    if status in (401, 403, 407):
        return UpstreamError(502, f"upstream {name!r} refused specd's credentials (HTTP "
                             f"{status}: {message}); check --upstream-token-file")
    if 400 <= status < 500:
        return UpstreamError(status, f"upstream {name!r}: {message}")
    return UpstreamError(504 if status == 504 else 502,
                         f"upstream {name!r} failed (HTTP {status}): {message}")


class UpstreamClient:
    """One upstream: its requests on one aiohttp session (opened on the event loop at
    the first request, closed with the app)."""

    def __init__(self, spec: UpstreamSpec, *, connect_s: float = CONNECT_TIMEOUT_S,
                 read_s: float = READ_TIMEOUT_S):
        self.spec = spec
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s,
                                              sock_read=read_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def scrub(self, text: str) -> str:
        """`text` without the token (an upstream may echo what it was sent)."""
        token = self.spec.token
        return text.replace(token, "[token]") if token else text

    async def open(self, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """Send the request: its response, once the upstream accepted it."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"Accept": "text/event-stream"}
        if self.spec.token:
            headers["Authorization"] = f"Bearer {self.spec.token}"
        name = self.name
        try:
            resp = await self._session.post(self.spec.endpoint, json=body, headers=headers)
        except TimeoutError:
            raise self._failed(504, f"upstream {name!r} did not answer in time") from None
        except aiohttp.ClientConnectorError as exc:
            reason = exc.os_error.strerror or str(exc.os_error) if exc.os_error else "?"
            raise self._failed(502, f"upstream {name!r} cannot be reached ({reason})"
                               ) from None
        except aiohttp.ClientError as exc:
            raise self._failed(502, f"upstream {name!r} failed: "
                               f"{type(exc).__name__}") from None
        if resp.status >= 400:
            try:
                text = (await resp.content.read(MAX_ERROR_BYTES)).decode("utf-8", "replace")
            except (aiohttp.ClientError, TimeoutError):
                text = ""
            finally:
                resp.release()
            err = error_for(name, resp.status, self.scrub(text))
            raise self._failed(err.status, str(err))
        return resp

    def _failed(self, status: int, message: str) -> UpstreamError:
        log.warning("%s", message)
        return UpstreamError(status, message)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class UpstreamStream:
    """One forwarded request's answer as a local one's events (service.TextStream):
    Pieces as its text arrives, then one Result. A failure before the answer begins
    raises UpstreamError (from started(), or the iteration's start); one after it ends
    the Result with an error."""

    def __init__(self, client: UpstreamClient, body: dict[str, Any]):
        self._client, self._body = client, body
        self._resp: aiohttp.ClientResponse | None = None
        self._cancelled = False
        self._t0 = time.perf_counter()

    @property
    def slot(self) -> int | None:
        return None

    async def started(self) -> None:
        if self._resp is None:
            self._resp = await self._client.open(self._body)

    def cancel(self) -> None:
        self._cancelled = True
        if self._resp is not None:
            self._resp.close()

    def __aiter__(self) -> AsyncIterator[Piece | ProgressEvent | Result]:
        return self._run()

    async def _run(self) -> AsyncIterator[Piece | ProgressEvent | Result]:
        await self.started()
        assert self._resp is not None
        resp, name = self._resp, self._client.name
        reader = ChunkReader(name)
        error: str | None = None
        status = 502  # a failure's, once the answer began
        t_first: float | None = None
        try:
            async for data in self._events(resp):
                if data.strip() == "[DONE]":
                    break
                text = reader.feed(json.loads(data))
                if text:
                    t_first = t_first or time.perf_counter()
                    yield Piece(text, [])
        except UpstreamError as exc:
            error, status = self._client.scrub(str(exc)), exc.status
        except ValueError:
            error = f"upstream {name!r} sent an answer that is not JSON events"
        except TimeoutError:
            error, status = f"upstream {name!r} stopped answering", 504
        except aiohttp.ClientError as exc:
            if not self._cancelled:
                error = f"upstream {name!r}: the answer was cut ({type(exc).__name__})"
        finally:
            resp.close()
        if error is not None:
            log.warning("%s", error)
        calls = reader.calls_text() if error is None else ""
        if calls:
            yield Piece(calls, [])
        yield self._result(reader, error, status, t_first)

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
        """The data of each event (a whole JSON answer, from a server that does not
        stream, as one)."""
        if not resp.content_type.startswith("text/event-stream"):
            yield (await resp.read()).decode("utf-8", "replace")
            return
        parser = SSEParser()
        async for chunk in resp.content.iter_any():
            for data in parser.feed(chunk):
                yield data
        for data in parser.close():
            yield data

    def _result(self, reader: ChunkReader, error: str | None, error_status: int,
                t_first: float | None) -> Result:
        usage = reader.usage
        prompt_n = int(usage.get("prompt_tokens") or 0)
        completion_n = int(usage.get("completion_tokens") or reader.pieces)
        details = usage.get("prompt_tokens_details")
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        now = time.perf_counter()
        first = t_first or now
        stats = SpecStats(prompt_tokens=prompt_n, cached_tokens=cached)
        stats.prefill_s, stats.decode_s = first - self._t0, now - first
        reason = ("error" if error is not None else "cancelled" if self._cancelled else
                  "length" if reader.finish == "length" else "stop")
        return Result(text="".join(reader.text), finish_reason=reason,
                      prompt_tokens=prompt_n, completion_tokens=completion_n,
                      cached_tokens=cached, stats=stats, error=error,
                      error_status=error_status,
                      timings={**llama_timings(stats, prompt_n - cached, completion_n),
                               "total_ms": round((now - self._t0) * 1000, 3)})




