"""Issue 40 against a real daemon on loopback: big requests prepared off the event loop,
limits that name themselves, whose prompt cache is whose (the token-guessing attack run
as another OS user), shutdown during a stream, nesting, LAN Host names, token files."""

from __future__ import annotations

import http.client
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.scheduler import Request, Scheduler
from specd.daemon.serving.service import Service
from specd.ipc.http.app import create_app
from specd.ipc.security import Access, TokenFileError, load_or_create_token
from specd.ipc.server import ServeConfig, serve_access
from specd.ipc.validation import (
    MAX_CONSTRAINT_BYTES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
)
from specd.memory_fit.rss import trim_heap

from live_server import call, live_server, serving

NOBODY = 65534
TOKEN = "s3cret-token-for-tests"
as_root = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                             reason="running a client as another OS user needs root")


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)


def _cfg(tiny_path: Path, slots: int = 2) -> EngineConfig:
    return EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=512, slots=slots)


@pytest.fixture(scope="module")
def server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("hardening")
    access = Access(token=TOKEN)  # the owner without it; anyone else with it
    with live_server(_cfg(tiny_path), tmp, access=access) as srv:
        yield srv


def as_user(uid: int, fn: Callable[[], Any]) -> Any:
    """fn() in a forked child running as `uid` (its JSON result, or {"exception": ...})."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return into pytest
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            out: Any = fn()
        except BaseException as exc:
            out = {"exception": repr(exc)}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while chunk := f.read(65536):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


# -- 1. big requests ----------------------------------------------------------------------
def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(
        server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = server.service.tokenizer
    seen: list[int] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: (seen.append(len(text)),
                                                           real(text, **kw))[1])
    big = "lorem ipsum " * 600_000  # 7.2 MB
    for path, body in (("/completion", {"prompt": big}),
                       ("/v1/completions", {"prompt": big}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": big}]}),
                       ("/apply-template", {"messages": [{"role": "user", "content": big}]}),
                       ("/v1/embeddings", {"input": big})):
        status, out = call(server.port, "POST", path, body)
        assert status in (400, 501), (path, out)
        if status == 400:
            assert "bytes of text, more than the context can hold" in out["error"]["message"], out
            assert out["error"]["code"] == "context_length_exceeded"
    assert not any(n > 100_000 for n in seen), seen
    # a prompt that fits in bytes but not in tokens is still measured after tokenizing
    status, out = call(server.port, "POST", "/completion", {"prompt": "a b " * 3000})
    assert status == 400 and "context" in out["error"]["message"]


def test_health_and_other_clients_are_served_while_a_huge_text_is_tokenized(
        server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer held mid-way (as a 7 MB text holds it for seconds): /health and
    another client's completion are answered meanwhile."""
    tok = server.service.tokenizer
    real, started, gate = tok.encode, threading.Event(), threading.Event()

    def slow(text: str, **kw: Any) -> list[int]:
        if len(text) > 1_000_000:
            started.set()
            gate.wait(60)
        return real(text, **kw)

    monkeypatch.setattr(tok, "encode", slow)
    result: dict[str, Any] = {}
    big = threading.Thread(target=lambda: result.update(
        out=call(server.port, "POST", "/tokenize", {"content": "word " * 1_400_000})))
    big.start()
    try:
        assert started.wait(60), "the big text never reached the tokenizer"
        assert call(server.port, "GET", "/health", timeout=10) == (200, {"status": "ok"})
        status, out = call(server.port, "POST", "/completion",
                           {"prompt": "hello", "n_predict": 3}, timeout=30)
        assert status == 200 and "out" not in result
    finally:
        gate.set()
        big.join(120)
    status, out = result["out"]
    assert status == 200 and len(out["tokens"]) >= 1_400_000


@pytest.mark.skipif(not trim_heap(), reason="no malloc_trim: the heap is the allocator's")
def test_a_huge_tokenize_gives_its_memory_back(server: Any) -> None:
    """A 7 MB text takes the tokenizer hundreds of MB; once answered, they go back to the
    system rather than stay resident until the daemon exits."""
    import psutil

    proc = psutil.Process()
    trim_heap()  # the baseline: no freed memory held, whatever ran before
    before = proc.memory_info().rss
    status, out = call(server.port, "POST", "/tokenize", {"content": "word " * 1_400_000})
    assert status == 200 and len(out["tokens"]) >= 1_400_000
    del out
    grown = (proc.memory_info().rss - before) / 2**20
    assert grown < 150, f"RSS grew by {grown:.0f} MB and stayed"


# -- 2. limits ----------------------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"the limit is {MAX_STOP_STRINGS}"),
    ({"stop": "y" * (MAX_STOP_CHARS + 1)}, f"the limit is {MAX_STOP_CHARS}"),
    ({"json_schema": {"type": "object", "description": "z" * MAX_CONSTRAINT_BYTES}},
     f"the limit is {MAX_CONSTRAINT_BYTES}"),
    ({"grammar": "start: " + '"a" | ' * (MAX_CONSTRAINT_BYTES // 6) + '"b"'},
     f"the limit is {MAX_CONSTRAINT_BYTES}"),
])
def test_stop_lists_and_constraints_have_limits_that_name_themselves(
        server: Any, body: dict[str, Any], message: str) -> None:
    status, out = call(server.port, "POST", "/completion", {"prompt": "hi", **body})
    assert status == 400 and message in out["error"]["message"], out


def test_tools_have_limits_that_name_themselves(server: Any) -> None:
    def tool(i: int, doc: str = "") -> dict[str, Any]:
        return {"type": "function", "function": {"name": f"f{i}", "description": doc,
                                                 "parameters": {"type": "object"}}}

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, out = call(server.port, "POST", "/v1/chat/completions",
                       {**chat, "tools": [tool(i) for i in range(MAX_TOOLS + 1)]})
    assert status == 400 and f"the limit is {MAX_TOOLS}" in out["error"]["message"]
    status, out = call(server.port, "POST", "/v1/chat/completions",
                       {**chat, "tools": [tool(0, "d" * 300_000)]})
    assert status == 400 and "bytes as JSON; the limit is" in out["error"]["message"]
    status, out = call(server.port, "POST", "/v1/chat/completions",
                       {**chat, "tools": [tool(i) for i in range(8)]})
    assert status == 200, out


def test_the_longest_stop_list_allowed_still_stops(server: Any) -> None:
    status, first = call(server.port, "POST", "/completion",
                         {"prompt": "hello", "n_predict": 12, "ignore_eos": True})
    assert status == 200
    word = first["content"][3:6]
    stops = [f"never-{i}" for i in range(MAX_STOP_STRINGS - 1)] + [word]
    status, out = call(server.port, "POST", "/completion",
                       {"prompt": "hello", "n_predict": 12, "ignore_eos": True,
                        "stop": stops})
    assert status == 200 and out["stopping_word"] == word, out
    assert out["content"] == first["content"][:first["content"].index(word)]


@pytest.mark.parametrize("path, field, value", [
    ("/completion", "t_max_predict_ms", float("nan")),
    ("/completion", "temperature", float("inf")),
    ("/completion", "min_p", float("nan")),
    ("/completion", "presence_penalty", float("-inf")),
    ("/v1/completions", "frequency_penalty", float("nan")),
    ("/v1/chat/completions", "top_p", float("nan")),
])
def test_a_number_that_is_not_finite_is_a_400_naming_its_field(
        server: Any, path: str, field: str, value: float) -> None:
    """JSON's NaN and Infinity (which Python's parser reads) are no setting's value."""
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]}
                            if "chat" in path else {"prompt": "hi"})
    status, out = call(server.port, "POST", path, {**body, "max_tokens": 2, "n_predict": 2,
                                                   field: value})
    assert status == 400, out
    assert out["error"]["param"] == field and "finite" in out["error"]["message"], out


# -- 8. nesting ---------------------------------------------------------------------------
def test_absurdly_nested_message_values_are_a_400(server: Any) -> None:
    deep: Any = "x"
    for _ in range(900):  # under JSON's own limit, far over the template walk's
        deep = [deep]
    calls = [{"id": "1", "type": "function",
              "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]
    for messages in ([{"role": "user", "content": "hi", "extra": deep}],
                     [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "user", "content": "go on"}]):
        for path in ("/v1/chat/completions", "/apply-template"):
            status, out = call(server.port, "POST", path, {"messages": messages})
            assert status == 400, out
            assert "nest" in out["error"]["message"]


# -- 4. whose cache is whose --------------------------------------------------------------
SECRET = "Note to self: the door PIN is 4821. Do not share it with anyone."


def _completion(port: int, prompt: str, **extra: Any) -> dict[str, Any]:
    headers = extra.pop("headers", None)
    status, out = call(port, "POST", "/completion",
                       {"prompt": prompt, "n_predict": 1, **extra}, headers=headers)
    assert status == 200, out
    return out


def test_another_identity_never_sees_a_cached_prompt(server: Any) -> None:
    """Same OS user, different cache keys: nothing shared; the same key: shared."""
    port = server.port
    _completion(port, SECRET, cache_key="editor")
    assert _completion(port, SECRET, cache_key="editor")["tokens_cached"] > 10
    assert _completion(port, SECRET, cache_key="browser")["tokens_cached"] == 0
    out = _completion(port, SECRET + " more", headers={"Authorization": f"Bearer {TOKEN}"})
    assert out["tokens_cached"] == 0  # root, with the token or without: root's own cache
    status, out = call(port, "POST", "/completion", {"prompt": "x", "cache_key": 5})
    assert status == 400 and "'cache_key' must be a string" in out["error"]["message"]


@as_root
def test_other_os_users_need_the_token_and_cannot_guess_a_cached_prompt(
        server: Any) -> None:
    port = server.port
    _completion(port, SECRET)  # the owner's (root's) prompt, now in a slot
    assert _completion(port, SECRET)["tokens_cached"] > 10  # cached for its owner

    def without_token() -> Any:
        return call(port, "POST", "/completion", {"prompt": SECRET, "n_predict": 1})

    status, out = as_user(NOBODY, without_token)
    assert status == 401 and "its own OS user" in out["error"]["message"], out
    assert as_user(NOBODY, lambda: call(port, "GET", "/health")) == [200, {"status": "ok"}]

    def guess_the_first_digit() -> Any:
        counts = {}
        for digit in "0123456789":
            guess = SECRET[:SECRET.index("4821")] + digit
            status, out = call(port, "POST", "/completion",
                               {"prompt": guess, "n_predict": 1},
                               headers={"Authorization": f"Bearer {TOKEN}"})
            assert status == 200, out
            counts[digit] = out["tokens_cached"]
        return counts

    counts = as_user(NOBODY, guess_the_first_digit)
    assert "exception" not in counts, counts
    # its own earlier guesses are all it ever matches: the right digit gains nothing
    assert counts["0"] == 0 and len(set(list(counts.values())[1:])) == 1, counts
    exact = as_user(NOBODY, lambda: call(port, "POST", "/completion",
                                         {"prompt": SECRET, "n_predict": 1},
                                         headers={"Authorization": f"Bearer {TOKEN}"}))
    # the whole secret: again only the prefix of its own guesses
    assert exact[0] == 200 and exact[1]["tokens_cached"] == counts["1"], (exact, counts)


@as_root
def test_allow_other_users_serves_them_without_the_token_but_not_the_owners_cache(
        tiny_path: Path, tmp_path: Path) -> None:
    with live_server(_cfg(tiny_path), tmp_path,
                     access=Access(token=TOKEN, other_users=True)) as srv:
        _completion(srv.port, SECRET)
        status, out = as_user(NOBODY, lambda: call(srv.port, "POST", "/completion",
                                                   {"prompt": SECRET, "n_predict": 1}))
        assert status == 200 and out["tokens_cached"] == 0, out
        assert _completion(srv.port, SECRET)["tokens_cached"] > 10


def test_a_required_token_is_required_of_the_owner_too(tiny_path: Path,
                                                       tmp_path: Path) -> None:
    with live_server(_cfg(tiny_path, 1), tmp_path,
                     access=Access(token=TOKEN, require_token=True)) as srv:
        status, out = call(srv.port, "POST", "/tokenize", {"content": "hi"})
        assert status == 401 and "bearer token" in out["error"]["message"]
        status, _ = call(srv.port, "POST", "/tokenize", {"content": "hi"},
                         headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200


def test_api_keys_are_required_and_admitted_as_the_token_is(
        tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's --api-key: keys of the owner's choosing, sent as a bearer token or
    in X-Api-Key; with one, every TCP client needs a key or the token."""
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = ServeConfig(port=0, socket_path=None, api_keys=frozenset({"key-one", "key-two"}))
    access = serve_access(cfg)
    assert access.require_token and access.token
    app = create_app(_service(tiny_path), access=access)
    with serving(app, cfg) as (srv, _):
        def status(headers: dict[str, str]) -> tuple[int, Any]:
            return call(srv.port, "POST", "/tokenize", {"content": "hi"}, headers=headers)

        for refused in ({}, {"Authorization": "Bearer key-three"}, {"X-Api-Key": "key"}):
            code, out = status(refused)
            assert code == 401 and out["error"]["type"] == "authentication_error", out
        for admitted in ({"Authorization": "Bearer key-one"}, {"X-Api-Key": "key-two"},
                         {"Authorization": "key-two"},
                         {"Authorization": f"Bearer {access.token}"}):
            assert status(admitted)[0] == 200, admitted
        assert call(srv.port, "GET", "/health") == (200, {"status": "ok"})


def test_allowing_localhost_allows_every_loopback_origin(tiny_path: Path,
                                                         tmp_path: Path) -> None:
    """--allow-origin localhost: a web app served from any loopback port (llama-server's
    --cors-origins localhost); other origins, look-alikes included, are still refused."""
    with live_server(_cfg(tiny_path, 1), tmp_path, allowed_origins={"localhost"}) as srv:
        def preflight(origin: str) -> tuple[int, Any]:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("OPTIONS", "/completion", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            resp = conn.getresponse()
            resp.read()
            conn.close()
            return resp.status, resp.getheader("Access-Control-Allow-Origin")

        for origin in ("http://localhost", "http://localhost:5173", "https://127.0.0.1:3000",
                       "http://[::1]:8080"):
            assert preflight(origin) == (200, origin)
        for origin in ("http://localhost.evil.com", "http://notlocalhost", "http://evil.com",
                       "file://localhost", "http://[::1"):
            code, allowed = preflight(origin)
            assert code in (401, 403) and allowed is None, origin


# -- 9. serving a LAN ---------------------------------------------------------------------
def _lan_address() -> str | None:
    import socket

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def _service(tiny_path: Path, slots: int = 1) -> Service:
    engine = Engine(_cfg(tiny_path, slots))
    return Service(engine, Scheduler(engine))


def test_a_lan_client_with_the_token_may_name_the_machine_in_host(
        tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lan = _lan_address()
    if lan is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = ServeConfig(host=lan, port=0, socket_path=None, allow_non_loopback=True)
    access = serve_access(cfg)
    assert access.require_token and access.token and lan in access.hosts
    app = create_app(_service(tiny_path), access=access)
    with serving(app, cfg) as (srv, _):
        auth = {"Authorization": f"Bearer {access.token}"}
        for host in (f"{lan}:{srv.port}", lan):
            status, out = call(srv.port, "POST", "/tokenize", {"content": "hi"},
                               host=lan, headers={**auth, "Host": host})
            assert status == 200, out
        status, out = call(srv.port, "POST", "/tokenize", {"content": "hi"}, host=lan,
                           headers={"Host": f"{lan}:{srv.port}"})
        assert status == 401
        status, out = call(srv.port, "POST", "/tokenize", {"content": "hi"}, host=lan,
                           headers={**auth, "Host": "attacker.example"})
        assert status == 403 and "DNS-rebinding" in out["error"]["message"]


def test_token_files_must_be_private_and_not_empty(tmp_path: Path) -> None:
    path = tmp_path / "token"
    token = load_or_create_token(path)
    assert len(token) > 20 and path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_token(path) == token
    path.chmod(0o644)
    with pytest.raises(TokenFileError,
                       match="may be read or written by other users .*0644.*chmod 600"):
        load_or_create_token(path)
    path.chmod(0o600)
    path.write_text("\n")
    with pytest.raises(TokenFileError, match="is empty"):
        load_or_create_token(path)
    if hasattr(os, "getuid") and os.getuid() == 0:
        path.write_text("theirs\n")
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(TokenFileError, match=f"belongs to uid {NOBODY}"):
            load_or_create_token(path)


# -- 7. shutdown --------------------------------------------------------------------------
def _slowed(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round of every request waits 20 ms: a stream is still running when the
    server closes."""
    real = scheduler.submit

    def submit(req: Request) -> Request:
        inner = req.on_tokens

        def on_tokens(tokens: list[int]) -> bool | None:
            threading.Event().wait(0.02)
            return inner(tokens)

        req.on_tokens = on_tokens
        return real(req)

    monkeypatch.setattr(scheduler, "submit", submit)


def _sse(port: int, path: str, body: dict[str, Any], first: threading.Event) -> list[Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events: list[Any] = []
    for line in resp:
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
            first.set()
    conn.close()
    return events


def test_closing_the_server_cancels_streams_with_an_error_event(
        tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    service = _service(tiny_path, slots=2)
    _slowed(service.scheduler, monkeypatch)
    app = create_app(service)
    cfg = ServeConfig(port=0, socket_path=None)
    routes = (("/completion", {"prompt": "hi", "n_predict": 400, "ignore_eos": True}),
              ("/v1/completions", {"prompt": "hi", "max_tokens": 400, "ignore_eos": True}))
    with serving(app, cfg) as (srv, close):
        firsts = [threading.Event() for _ in routes]
        results: list[list[Any]] = [[] for _ in routes]
        threads = [threading.Thread(target=lambda i=i, r=r: results[i].extend(
            _sse(srv.port, r[0], r[1], firsts[i]))) for i, r in enumerate(routes)]
        for t in threads:
            t.start()
        assert all(f.wait(60) for f in firsts)
        close()
        for t in threads:
            t.join(60)
    for events in results:
        last = events[-1]
        assert isinstance(last, dict) and last["error"]["code"] == 503, events[-3:]
        assert "shutting down" in last["error"]["message"] and "[DONE]" not in events
    assert not service.scheduler._thread.is_alive()  # stopped with the app
    assert "Event loop is closed" not in caplog.text and "Traceback" not in caplog.text


def test_where_the_kernel_does_not_name_the_peer_the_token_is_required(
        server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on macOS or Windows: no socket table to read, so the owner needs the token
    too (the CLI and the tray read it from the token file)."""
    import specd.ipc.security as security

    monkeypatch.setattr(security, "tcp_peer_uid", lambda local, remote: None)
    status, out = call(server.port, "POST", "/tokenize", {"content": "hi"})
    assert status == 401 and "its own OS user" in out["error"]["message"]
    status, _ = call(server.port, "POST", "/tokenize", {"content": "hi"},
                     headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
