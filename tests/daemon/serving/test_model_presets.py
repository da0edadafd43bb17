"""llama-server's model presets (`specd serve --models-preset FILE`): the INI file read as
llama-server reads it (sections, `[*]`, comments, its keys by long and short name and
environment name), its errors naming the file and line, and a real server on loopback
serving a preset's models by name with their options, hiding what dedup-cache-models
hides, and reading the file again on `GET /models?reload=1`."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import pytest

from specd.daemon.cli.main import build_parser
from specd.daemon.cli.model_presets import PresetError, read_presets
from specd.daemon.cli.serve import apply_preset, preset_parser, served_models
from specd.daemon.serving.engine import EngineConfig
from specd.daemon.serving.served_models import ModelPreset, ServedModels

from live_server import LiveServer, live_server_in

A, B = "tiny-qwen2-Q8_0", "tiny-llama-Q8_0"  # the files' general.name
B_ALIAS = "org/b-model:Q8_0"  # as llama-server's router names a model of its cache


def _read(tmp_path: Path, text: str) -> list[ModelPreset]:
    path = tmp_path / "presets.ini"
    path.write_text(text)
    return read_presets(path, preset_parser().parse_args)


def test_sections_inherit_the_global_one_and_keys_take_every_name(tmp_path: Path) -> None:
    presets = _read(tmp_path, (
        "version = 1\n"
        "; a comment\n"
        "[*]\n"
        "c = 1024          # the shared context\n"
        "temp = 0.5\n"
        "\n"
        "[first]\n"
        "model = /models/first.gguf\n"
        "ctx-size = 2048\n"
        "LLAMA_ARG_N_PARALLEL = 2\n"
        "n-predict = -1\n"
        "spec-type = ngram-simple\n"
        "embedding = on\n"
        "[org/second:q8_0]\n"
        "hf = org/second\n"
        "spec-draft-hf = org/draft\n"
        "alias = two,second\n"
        "dedup-cache-models = true\n"
        "load-on-startup = 1\n"))
    first, second = presets
    assert first == ModelPreset(
        name="first", model="/models/first.gguf", by_name=False,
        flags=("--ctx-size", "2048", "--temp", "0.5", "--slots", "2",
               "--spec-type", "ngram", "--embeddings"))
    # a tag is upper-cased as llama-server keys it; a repo is looked up by name
    assert second == ModelPreset(
        name="org/second:Q8_0", model="org/second", by_name=True, draft="org/draft",
        draft_by_name=True, aliases=("second", "two"), flags=("--ctx-size", "1024",
                                                              "--temp", "0.5"),
        dedup=True, load_on_startup=True)


def test_a_line_that_is_no_ini_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match=r"presets\.ini:3: not a \[section\] header"):
        _read(tmp_path, "[a]\nmodel = x.gguf\nctx-size 4096\n")
    with pytest.raises(PresetError, match="preset file does not exist"):
        read_presets(tmp_path / "none.ini", preset_parser().parse_args)


def test_an_unknown_key_is_an_error_and_an_unsupported_one_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(PresetError, match=r"presets\.ini:3: option 'ctx-sise' not "
                                          r"recognized in preset 'a'"):
        _read(tmp_path, "[a]\nmodel = x.gguf\nctx-sise = 4096\n")
    with caplog.at_level(logging.WARNING, logger="specd.serving"):
        (a,) = _read(tmp_path, "[a]\nmodel = x.gguf\nn-gpu-layers = 99\nport = 9\n"
                               "LLAMA_ARG_FLASH_ATTN = on\n")
    assert a.flags == ()
    warned = caplog.text
    assert "presets.ini:3: n-gpu-layers ignored: specd has no counterpart" in warned
    assert "presets.ini:4: port ignored in a preset: the router sets it" in warned
    assert "presets.ini:5: LLAMA_ARG_FLASH_ATTN ignored" in warned


def test_a_bad_value_is_an_error_naming_the_preset(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match=r"preset \[a\]: .*ctx-size.*'many'"):
        _read(tmp_path, "[a]\nmodel = x.gguf\nctx-size = many\n")
    with pytest.raises(PresetError, match=r"presets\.ini:2: embedding = 'maybe'"):
        _read(tmp_path, "[a]\nembedding = maybe\n")
    with pytest.raises(PresetError, match=r"presets\.ini:2: ctx-size has no value"):
        _read(tmp_path, "[a]\nctx-size =\n")


@pytest.fixture(scope="module")
def files(tiny_model_factory) -> tuple[Path, Path]:
    return (tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024),
            tiny_model_factory(arch="llama", weight_type="Q8_0", seed=7, context_length=1024))


@pytest.fixture(scope="module")
def preset_file(files, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("presets") / "models.ini"
    path.write_text(
        "[*]\n"
        "n-predict = 5\n"
        "\n"
        f"[b-short]\nmodel = {files[1]}\nctx-size = 256\n"
        "\n"
        "[b-dedup]\nhf-repo = org/b-model\ndedup-cache-models = 1\n"
        "n-predict = 7\n"
        "\n"
        f"[{B_ALIAS.lower()}]\nn-predict = 4\n")  # options for a model served already
    return path


@pytest.fixture(scope="module")
def router(files, preset_file, tmp_path_factory):
    """A and B (under a cache-like name), and the preset file's two models of B."""
    a, b = files
    args = build_parser().parse_args([
        "serve", "-m", str(a), "--models", f"{B_ALIAS}={b}", "--models-max", "1",
        "--models-preset", str(preset_file), "--no-store-models", "--no-fit", "-c", "512",
        "--slots", "1", "-t", "1"])
    made: list[ServedModels] = []

    def models(first):
        made.append(served_models(args, first))
        return made[0]

    cfg = EngineConfig(target=str(a), spec_type="ngram", n_ctx=512, slots=1)
    with live_server_in(tmp_path_factory, "model-presets", cfg, keep_alive=300,
                        models=models) as srv:
        srv.served = made[0]  # type: ignore[attr-defined]
        yield srv


def _ids(server: LiveServer, reload: bool = False) -> list[str]:
    status, out = server.request("GET", "/models" + ("?reload=1" if reload else ""))
    assert status == 200, out
    return [m["id"] for m in out["data"]]


def _complete(server: LiveServer, model: str) -> dict:
    status, out = server.request("POST", "/completion", {
        "model": model, "prompt": "hello there", "temperature": 0, "ignore_eos": True,
        "return_tokens": True})
    assert status == 200, out
    return out


def test_presets_are_served_by_name_and_dedup_hides_their_model(router: LiveServer) -> None:
    # B's own entry is hidden by [b-dedup]'s dedup-cache-models, not its use
    assert _ids(router) == [A, "b-short", "b-dedup"]
    status, props = router.request("GET", "/props")
    assert status == 200 and props["role"] == "router"
    assert props["build_info"].startswith("b") and "specd" in props["build_info"]
    cached = _complete(router, B_ALIAS)
    assert cached["model"] == B_ALIAS and len(cached["tokens"]) == 4  # its section's
    short = _complete(router, "b-short")
    assert short["model"] == "b-short" and len(short["tokens"]) == 5  # [*]'s n-predict
    dedup = _complete(router, "b-dedup")
    assert dedup["model"] == "b-dedup" and len(dedup["tokens"]) == 7  # its own
    assert dedup["tokens"][:5] == short["tokens"]  # the same model, B, greedy
    served = router.served  # type: ignore[attr-defined]
    engines = {n: served.find(n).service.engine for n in ("b-short", "b-dedup")}
    assert engines["b-short"].target.path.name == engines["b-dedup"].target.path.name
    # the command line's -c wins over b-short's ctx-size, as llama-server's arguments do
    assert engines["b-short"].cfg.n_ctx == engines["b-dedup"].cfg.n_ctx == 512


def test_reload_reads_the_file_again(router: LiveServer, files, preset_file: Path) -> None:
    before = preset_file.read_text()
    _complete(router, "b-short")
    short = router.served.find("b-short")  # type: ignore[attr-defined]
    try:
        preset_file.write_text(
            f"[b-short]\nmodel = {files[1]}\nctx-size = 256\nn-predict = 3\n"
            "[b-new]\nhf-repo = org/b-model\n")
        assert _ids(router) == [A, "b-short", "b-dedup"]  # not read again unasked
        # b-dedup gone (and with it the dedup), b-short changed, b-new added
        assert _ids(router, reload=True) == [A, B_ALIAS, "b-short", "b-new"]
        assert router.served.find("b-short") is not short  # type: ignore[attr-defined]
        assert short.service is not None and not short.loaded  # the old one unloaded
        assert len(_complete(router, "b-short")["tokens"]) == 3
        status, out = router.request("POST", "/models/load", {"model": "b-dedup"})
        assert status == 404, out
        preset_file.write_text("[b-short]\nmodel = x.gguf\nctx-size 9\n")
        status, out = router.request("GET", "/models?reload=1")
        assert status == 500 and "models.ini:3:" in out["error"]["message"], out
        assert _ids(router) == [A, B_ALIAS, "b-short", "b-new"]  # nothing changed
    finally:
        preset_file.write_text(before)
        _ids(router, reload=True)


def test_the_command_line_wins_over_a_preset() -> None:
    parser = build_parser()
    flags = ("--ctx-size", "256", "--temp", "0.5")
    for command_line, n_ctx in ((["-c", "512"], 512), ([], 256)):
        given = parser.parse_args(["serve", *command_line])
        built = copy.copy(given)
        apply_preset(built, given, flags)
        assert (built.n_ctx, built.temperature) == (n_ctx, 0.5)


def test_load_on_startup_loads_the_model_when_the_daemon_starts(files, tmp_path_factory
                                                                ) -> None:
    a, b = files
    path = tmp_path_factory.mktemp("presets-startup") / "models.ini"
    path.write_text(f"[b-early]\nmodel = {b}\nload-on-startup = on\n[b-late]\nmodel = {b}\n")
    args = build_parser().parse_args([
        "serve", "-m", str(a), "--models-max", "2", "--models-preset", str(path),
        "--no-store-models", "--no-fit", "-c", "512", "--slots", "1", "-t", "1"])
    cfg = EngineConfig(target=str(a), spec_type="ngram", n_ctx=512, slots=1)
    with live_server_in(tmp_path_factory, "model-presets-startup", cfg, keep_alive=300,
                        models=lambda first: served_models(args, first)) as srv:
        end, statuses = time.monotonic() + 60, {}
        while time.monotonic() < end and statuses.get("b-early") != "loaded":
            status, out = srv.request("GET", "/models")
            statuses = {m["id"]: m["status"]["value"] for m in out["data"]}
            time.sleep(0.1)
        assert statuses == {A: "loaded", "b-early": "loaded", "b-late": "unloaded"}
