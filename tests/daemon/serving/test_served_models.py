"""Several local models served by name (`specd serve -m A --models B`): B is built by the
CLI's own builder on the first request naming it, at most --models-max load at once, and
the listings, the router routes and the official clients see both. A real server on
loopback with two tiny models of different architectures."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import ollama
import openai
import pytest

from specd.daemon.cli.main import build_parser
from specd.daemon.cli.serve import served_models
from specd.daemon.serving.engine import EngineConfig
from specd.daemon.serving.served_models import ServedModels

from live_server import LiveServer, live_server_in

A, B = "tiny-qwen2-Q8_0", "tiny-llama-Q8_0"  # the files' general.name


@pytest.fixture(scope="module")
def files(tiny_model_factory) -> tuple[Path, Path]:
    return (tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024),
            tiny_model_factory(arch="llama", weight_type="Q8_0", seed=7, context_length=1024))


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    a, b = files
    missing = a.parent / "not-there.gguf"
    args = build_parser().parse_args([
        "serve", "-m", str(a), "--models", f"{b},{missing}", "--models-max", "1",
        "--no-store-models", "--no-fit", "-c", "512", "--slots", "1", "-t", "1"])
    cfg = EngineConfig(target=str(a), spec_type="ngram", n_ctx=512, slots=1)
    with live_server_in(tmp_path_factory, "served-models", cfg, keep_alive=300,
                        models=lambda first: served_models(args, first)) as srv:
        yield srv


def _statuses(server: LiveServer) -> dict[str, str]:
    status, out = server.request("GET", "/v1/models")
    assert status == 200, out
    return {m["id"]: m["status"]["value"] for m in out["data"]}


def _wait_status(server: LiveServer, want: dict[str, str], within: float = 20.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if {k: v for k, v in _statuses(server).items() if k in want} == want:
            return True
        time.sleep(0.1)
    return False


def _complete(server: LiveServer, model: str | None) -> tuple[str, list[int]]:
    status, out = server.request("POST", "/completion", {
        "model": model, "prompt": "hello there", "n_predict": 6, "temperature": 0,
        "ignore_eos": True, "return_tokens": True})
    assert status == 200, out
    return out["model"], out["tokens"]


def test_each_model_answers_by_name_one_loaded_at_a_time(server: LiveServer, files) -> None:
    b_file = files[1]
    # before any request names it, B is listed by its file's name, unloaded
    assert _statuses(server) == {A: "loaded", b_file.stem: "unloaded",
                                 "not-there": "unloaded"}
    name_a, want_a = _complete(server, None)
    assert name_a == A
    name_b, want_b = _complete(server, b_file.stem)  # built now, by the CLI's builder
    assert name_b == B and want_b != want_a
    # --models-max 1: A unloaded to make room
    assert _statuses(server) == {A: "unloaded", B: "loaded", "not-there": "unloaded"}
    assert _complete(server, B) == (B, want_b)  # by its own name once built
    assert _complete(server, A) == (A, want_a)  # A back, B out, answers as before
    assert _wait_status(server, {A: "loaded", B: "unloaded"})
    assert _complete(server, "gpt-4o-mini")[0] == A  # any other name: the first model


def test_router_routes_load_and_unload_by_name(server: LiveServer) -> None:
    _complete(server, B)
    assert server.request("POST", "/models/load", {"model": B})[0] == 400  # running
    assert server.request("POST", "/models/unload", {"model": B}) == (200, {"success": True})
    assert _wait_status(server, {B: "unloaded"})
    assert server.request("POST", "/models/load", {"model": A}) == (200, {"success": True})
    assert _statuses(server)[A] == "loaded"
    status, out = server.request("POST", "/models/load", {"model": "no-such-model"})
    assert status == 404 and "this daemon serves" in out["error"]["message"]


def test_the_cli_unloads_a_model_by_name(server: LiveServer, files,
                                         monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`specd unload NAME` (what the tray's item runs) and `specd status` over the
    daemon's socket."""
    from specd.daemon.cli.main import main

    monkeypatch.setenv("SPECD_RUNTIME_DIR", str(server.socket_path.parent))
    _complete(server, files[1].stem)
    assert main(["status"]) == 0
    assert f"models:     {A} (unloaded), {B} (loaded), not-there (unloaded)" in \
        capsys.readouterr().out
    assert main(["unload", B]) == 0
    assert f"model {B} unloading" in capsys.readouterr().out
    assert _wait_status(server, {B: "unloaded"})


def test_a_model_that_cannot_load_is_a_503_and_the_rest_serve(server: LiveServer) -> None:
    status, out = server.request("POST", "/completion", {
        "model": "not-there", "prompt": "hi", "n_predict": 2})
    assert status == 503 and "not-there" in out["error"]["message"], out
    assert _complete(server, A)[0] == A


def test_a_running_stream_ends_before_its_model_makes_room(server: LiveServer,
                                                           files) -> None:
    """B waits for A's running stream to finish whole; A unloads only then."""
    _complete(server, A)
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "none")
    stream = oai.completions.create(model=A, prompt="once", max_tokens=400, temperature=0,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    finish, usage = None, None
    chunks = iter(stream)
    next(chunks)  # A is running now
    answers: list[tuple[str, float]] = []
    asked_b = threading.Thread(target=lambda: answers.append((
        _complete(server, files[1].stem)[0], time.monotonic())))
    b_sent = time.monotonic()
    asked_b.start()
    time.sleep(0.2)  # B waits for A to make room; A meanwhile gets one more request,
    assert _complete(server, A)[0] == A  # which must not keep A loaded past B's wait
    for chunk in chunks:
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    a_done = time.monotonic()
    asked_b.join(timeout=120)
    assert b_sent < a_done  # B was asked for while A ran
    assert finish == "length" and usage is not None and usage.completion_tokens == 400
    assert answers and answers[0][0] == B  # and got once A had made room
    # A's second request came while B waited: it ran, and one model is loaded now
    assert sorted(_statuses(server).values()) == ["loaded", "unloaded", "unloaded"]


def test_official_clients_list_and_use_both(server: LiveServer, files) -> None:
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "none")
    ids = {m.id for m in oai.models.list().data}
    assert {A} <= ids and (B in ids or files[1].stem in ids)
    for model in (B, A):
        out = oai.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
        assert out.model == model and out.choices[0].message.content is not None
    client = ollama.Client(host=server.base_url,
                           headers={"Authorization": f"Bearer {server.token}"}
                           if server.token else None)
    assert {A + ":latest", B + ":latest"} <= {m.model for m in client.list().models}
    reply = client.chat(model=B + ":latest", messages=[{"role": "user", "content": "hi"}],
                        options={"num_predict": 3, "temperature": 0})
    assert reply.model == B + ":latest"
    assert [m.model for m in client.ps().models] == [B + ":latest"]  # A made room


def test_two_models_answering_to_one_name_are_refused(server: LiveServer, files) -> None:
    first = server.service
    with pytest.raises(ValueError, match="names both"):
        ServedModels(first, [str(files[1]), str(files[1].with_name("x") / files[1].name)],
                     lambda ref: first)


@pytest.fixture(scope="module")
def router(files, tmp_path_factory):
    """Models loaded only when asked to, B answering to an alias (llama-server's router
    names its models so)."""
    a, b = files
    args = build_parser().parse_args([
        "serve", "-m", str(a), "--models", f"org/b-model:Q8_0={b}", "--models-max", "2",
        "--no-models-autoload", "--no-store-models", "--no-fit", "-c", "512", "--slots",
        "1", "-t", "1"])
    cfg = EngineConfig(target=str(a), spec_type="ngram", n_ctx=512, slots=1)
    with live_server_in(tmp_path_factory, "served-models-router", cfg, keep_alive=300,
                        models=lambda first: served_models(args, first)) as srv:
        yield srv


def test_without_autoload_a_model_loads_only_when_asked(router: LiveServer) -> None:
    alias = "org/b-model:Q8_0"
    assert _statuses(router) == {A: "loaded", alias: "unloaded"}
    status, out = router.request("POST", "/v1/chat/completions", {
        "model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 400 and "/models/load" in out["error"]["message"], out
    assert router.request("POST", "/models/load", {"model": alias}) == (200, {"success": True})
    assert _statuses(router) == {A: "loaded", alias: "loaded"}  # --models-max 2
    name, _ = _complete(router, alias)
    assert name == alias  # its alias is what responses call it
    status, props = router.request("GET", "/props")
    assert (props["role"], props["max_instances"], props["models_autoload"]) == \
        ("router", 2, False)


def test_token_routes_use_the_named_model_and_wake_it(server: LiveServer, router: LiveServer,
                                                       files) -> None:
    """/tokenize and the input-token counts take the model the body names, loading it as
    llama-server's do (a sleeping model wakes), unless models load only when asked."""
    from specd.daemon.text.tokenizer import Tokenizer
    from specd.ort_models.gguf_file import GGUFFile

    text = "hello there"
    want = Tokenizer.from_metadata(GGUFFile(files[1]).metadata).encode(
        text, add_bos=False, add_eos=False)
    _complete(server, A)  # B unloaded (--models-max 1)
    assert _wait_status(server, {A: "loaded", B: "unloaded"})
    status, out = server.request("POST", "/tokenize", {"model": B, "content": text})
    assert status == 200 and out["tokens"] == want
    assert _statuses(server)[B] == "loaded"
    chat = {"model": A, "messages": [{"role": "user", "content": "hello"}]}
    _, counted = server.request("POST", "/v1/chat/completions/input_tokens", chat)
    assert _statuses(server)[A] == "loaded"
    _, responses = server.request("POST", "/v1/responses/input_tokens",
                                  {"model": A, "input": "hello"})
    assert counted["input_tokens"] == responses["input_tokens"] > 0
    alias = "org/b-model:Q8_0"  # without autoload: a 400, as a chat request gets
    router.request("POST", "/models/unload", {"model": alias})
    assert _wait_status(router, {alias: "unloaded"})
    status, out = router.request("POST", "/tokenize", {"model": alias, "content": text})
    assert status == 400 and "/models/load" in out["error"]["message"]


def test_start_unloaded_builds_but_holds_no_session(files) -> None:
    from specd.daemon.cli.serve import build_service

    args = build_parser().parse_args([
        "serve", "-m", str(files[0]), "--start-unloaded", "--no-fit", "-c", "512",
        "--slots", "1", "-t", "1"])
    args.draft, args.also_draft = None, None
    service = build_service(args)
    try:
        assert not service.engine.loaded and service.engine.target.session is None
        assert not service.scheduler.residency().loaded
    finally:
        service.scheduler.stop()


def test_props_of_a_named_model_as_llama_servers_router(server: LiveServer, router: LiveServer,
                                                        files) -> None:
    """/props?model=NAME answers NAME's own props (loading it where models load on
    request), without the router's fields; an unknown name, or one not loaded where
    models load only when asked, is llama-server's 400."""
    _complete(server, files[1].stem)  # B built (listed by its own name from then on)
    _complete(server, A)
    assert _wait_status(server, {A: "loaded", B: "unloaded"})
    status, props = server.request("GET", f"/props?model={B}")
    assert status == 200, props
    assert (props["model_alias"], props["model_path"]) == (B, str(files[1]))
    assert "role" not in props and props["is_sleeping"] is False
    assert props["default_generation_settings"]["n_ctx"] == props["n_ctx"] == 512
    assert _statuses(server)[B] == "loaded"  # loaded to answer, A made room (--models-max 1)
    status, props_a = server.request("GET", f"/props?model={A}")
    assert status == 200 and (props_a["model_alias"], props_a["model_path"]) == (
        A, str(files[0]))
    status, out = server.request("GET", "/props?model=no-such-model")
    assert status == 400, out
    assert (out["error"]["message"], out["error"]["type"]) == (
        "model 'no-such-model' not found", "invalid_request_error")
    status, main = server.request("GET", "/props")
    assert status == 200 and main["role"] == "router"
    alias = "org/b-model:Q8_0"  # without autoload: not loaded is a 400, until asked to load
    router.request("POST", "/models/unload", {"model": alias})
    assert _wait_status(router, {alias: "unloaded"})
    status, out = router.request("GET", f"/props?model={alias}")
    assert status == 400 and out["error"]["message"] == "model is not loaded", out
    status, props = router.request("GET", f"/props?model={alias}&autoload=true")
    assert status == 200 and props["model_alias"] == alias, props
    assert _statuses(router)[alias] == "loaded"
