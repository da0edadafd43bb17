"""The `specd` command line as a user runs it (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fetched_model

from tiny_gguf import write_corrupt_variants


def specd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd.daemon.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_streams_text_to_stdout_and_stats_to_stderr(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12)
    r = specd("generate", "-m", str(path), "hello world", "-n", "12", "--ignore-eos",
              "--spec-type", "ngram", "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stderr.strip().splitlines()[-1])
    assert stats["generated_tokens"] == 12 and stats["spec_type"] == "ngram"
    assert r.stdout.strip()


def test_generate_with_draft_model_and_prompt_lookup(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12)
    draft = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12, perturb=0.01)
    want = specd("generate", "-m", str(path), "hello hello hello world", "-n", "24",
                 "--ignore-eos")
    r = specd("generate", "-m", str(path), "-md", str(draft), "hello hello hello world",
              "-n", "24", "--ignore-eos", "--spec-type", "draft+ngram", "--spec-adaptive",
              "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stderr.strip().splitlines()[-1])
    assert stats["spec_type"] == "draft+ngram" and "lookup_rounds" in stats
    assert r.stdout == want.stdout  # greedy: the target's text
    r = specd("generate", "-m", str(path), "hi", "-n", "4", "--spec-type", "draft+ngram")
    assert r.returncode != 0 and "--spec-type draft+ngram needs a draft model" in r.stderr


def test_prompt_file_and_chat(tiny_model_factory, tmp_path) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12)
    pf = tmp_path / "p.txt"
    pf.write_text("hello world\n")
    assert specd("generate", "-m", str(path), "--prompt-file", str(pf), "-n", "4").returncode == 0
    r = specd("generate", "-m", str(path), "--chat", "hi", "-n", "4")
    assert r.returncode == 0, r.stderr
    r = specd("generate", "-m", str(path), "-n", "4")
    assert r.returncode == 1 and "give exactly one of" in r.stderr


@pytest.mark.parametrize("variant", ["truncated", "garbage", "unknown_arch", "unsupported_type"])
def test_bad_files_are_one_line_errors(tmp_path, variant) -> None:
    bad = write_corrupt_variants(tmp_path)[variant]
    r = specd("generate", "-m", str(bad), "hi", "-n", "2")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("specd: error:") and "Traceback" not in r.stderr, r.stderr


def test_device_errors_are_one_line(tiny_model_factory) -> None:
    import onnxruntime as ort

    path = str(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12))
    r = specd("generate", "-m", path, "hi", "-n", "4", "--device", "gpu")
    assert r.returncode == 1
    assert r.stderr.strip() == "specd: error: unknown device 'gpu': use auto, cpu, cuda or cuda:N"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        r = specd("generate", "-m", path, "hi", "-n", "4", "--device", "cuda")
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert "CUDA EP not available: the CPU package onnxruntime is installed" in r.stderr


def test_serve_setup_errors_are_one_line(tiny_model_factory, tmp_path) -> None:
    """What `specd serve` (and so `specd start` and the service) meets before it listens:
    the memory plan's errors and out-of-range flags, as one line each."""
    path = str(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12))
    short = str(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12,
                                   context_length=128))  # trained on less than a bucket
    r = specd("serve", "-m", short, "--no-socket", "--port", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"specd: error: a context of at least 256 tokens is needed; {Path(short).name} was "
        "trained on 128")
    for flag, value, want in (("--slots", "0", "--slots: 0 is out of range"),
                              ("--queue", "0", "--queue: 0 is out of range"),
                              ("--port", "70000", "--port: 70000 is out of range"),
                              ("-c", "0", "-c/--ctx-size: 0 is out of range")):
        r = specd("serve", "-m", path, flag, value)
        assert r.returncode == 2 and want in r.stderr, r.stderr


def test_output_piped_into_head_ends_quietly(tiny_model_factory) -> None:
    path = str(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12))
    r = subprocess.run(f"{sys.executable} -m specd.daemon.cli generate -m {path} hi -n 480 "
                       "--ignore-eos | head -c 1", shell=True, capture_output=True, text=True,
                       timeout=300, executable="/bin/bash")
    assert "Broken pipe" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_models_list_says_which_models_run() -> None:
    r = specd("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    runs = {row["name"]: row["runnable"] for row in json.loads(r.stdout)}
    assert runs["qwen2.5-coder-1.5b-instruct"] and runs["smollm2-135m-instruct"]
    assert runs["gemma-3-270m"] is True  # gemma3 runs since its architecture module
    assert all(runs.values())
    assert "cannot run" not in specd("models", "list").stdout


def test_unknown_model_name_lists_the_catalog() -> None:
    r = specd("generate", "-m", "no-such-model", "hi", "--no-fetch")
    assert r.returncode == 1 and "qwen2.5-coder-1.5b-instruct" in r.stderr


def test_synthetic_needs_rates(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12)
    r = specd("generate", "-m", str(path), "hi", "--spec-type", "synthetic")
    assert r.returncode == 1 and "--spec-synthetic-rates" in r.stderr
    r = specd("generate", "-m", str(path), "hi", "-n", "8", "--spec-type", "synthetic",
              "--spec-synthetic-rates", "0.9,0.5", "--spec-draft-n-max", "2")
    assert r.returncode == 0 and "SYNTHETIC: output not valid" in r.stderr


@pytest.mark.real
def test_models_info_explains_compatibility() -> None:
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                 "smollm2-135m-instruct"):
        fetched_model(name)
    ok = specd("models", "info", "qwen2.5-coder-1.5b-instruct", "--draft",
               "qwen2.5-coder-0.5b-instruct", "--no-fetch")
    assert ok.returncode == 0 and "compatible" in ok.stdout and "Q4_K" in ok.stdout
    bad = specd("models", "info", "smollm2-135m-instruct", "--draft",
                "qwen2.5-coder-0.5b-instruct", "--no-fetch", "--json")
    assert bad.returncode == 1
    info = json.loads(bad.stdout)
    assert not info["draft"]["compatible"]
    assert any("vocab size differs" in p for p in info["draft"]["problems"])


@pytest.mark.parametrize("args, message", [
    (["--configs", "draft n=2"], "unknown bench configuration 'draft n=2'"),
    (["--configs", "draft n_max=2"], "draft configurations need a draft model"),
    (["--prompts", "code,poetry"], "unknown prompt 'poetry'"),
    (["--temperatures", "0,warm"], "--temperatures takes numbers"),
])
def test_bench_refuses_bad_choices_before_loading(tiny_model_factory, args, message) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12)
    r = specd("bench", "-m", str(path), "--no-draft", *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bench_runs_end_to_end(tiny_model_factory, tmp_path) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12)
    r = specd("bench", "-m", str(path), "--no-draft", "--configs", "target-only,ngram n_max=4",
              "--prompts", "code", "--temperatures", "0", "-n", "8", "--repeats", "1",
              "-c", "512", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert [row["config"] for row in summary["rows"]] == ["target-only", "ngram n_max=4"]
    assert summary["bandwidth_gbs"] > 0 and all(row["memory_mb"] > 0 for row in summary["rows"])
    assert "× bound" in r.stdout and (tmp_path / "bench.png").is_file()


def test_models_info_describes_an_architecture_specd_cannot_run(tmp_path) -> None:
    from tiny_gguf import write_corrupt_variants

    path = write_corrupt_variants(tmp_path)["unknown_arch"]
    r = specd("models", "info", str(path), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "mamba9" and info["runnable"] is False
    text = specd("models", "info", str(path)).stdout
    assert "specd cannot run mamba9 models yet" in text


def test_a_command_without_its_action_shows_that_commands_help() -> None:
    r = specd("models")
    assert r.returncode == 2 and "usage: specd models" in r.stderr and "pull" in r.stderr


def test_token_and_thread_counts_are_range_checked() -> None:
    for flag in ("-n", "-t"):
        r = specd("generate", flag, "-5", "hi")
        assert r.returncode == 2 and "-5 is out of range (at least 0)" in r.stderr, r.stderr


def test_draft_vocab_reaches_the_engine_config_and_is_range_checked() -> None:
    from specd.daemon.cli.generate import engine_config_from_args
    from specd.daemon.cli.main import build_parser
    from specd.daemon.models.building import DRAFT_VOCAB_ROWS

    parser = build_parser()
    for argv, want in ((["generate", "hi"], DRAFT_VOCAB_ROWS),
                       (["generate", "--draft-vocab", "0", "hi"], 0),
                       (["serve", "--draft-vocab", "65536"], 65536)):
        assert engine_config_from_args(parser.parse_args(argv)).draft_vocab == want
    r = specd("generate", "--draft-vocab", "-5", "hi")
    assert r.returncode == 2 and "-5 is out of range (at least 0)" in r.stderr, r.stderr


def test_sampled_requests_draft_probabilistically_unless_told_not_to() -> None:
    from specd.daemon.cli.generate import params_from_args
    from specd.daemon.cli.main import build_parser

    parser = build_parser()
    assert params_from_args(parser.parse_args(["generate", "hi"])).draft.probabilistic
    off = parser.parse_args(["generate", "--no-spec-draft-probabilistic", "hi"])
    assert not params_from_args(off).draft.probabilistic


def test_fit_plans_the_slots_serve_starts() -> None:
    """`specd fit` with no --slots plans what `specd serve` with none would start."""
    from specd.daemon.cli.main import build_parser
    from specd.daemon.control.config import DEFAULT_SLOTS

    parser = build_parser()
    assert parser.parse_args(["fit"]).slots == parser.parse_args(["serve"]).slots \
        == DEFAULT_SLOTS == 2
    assert parser.parse_args(["fit", "--slots", "3"]).slots == 3


def test_serve_keep_alive_reads_durations() -> None:
    from specd.daemon.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).keep_alive == 300.0  # Ollama's 5 minutes
    for given, seconds in (("0", 0.0), ("-1", -1.0), ("90s", 90.0), ("1h", 3600.0)):
        assert parser.parse_args(["serve", "--keep-alive", given]).keep_alive == seconds
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--keep-alive", "soon"])


def test_serve_takes_api_keys_from_the_flag_and_a_file(tmp_path) -> None:
    from specd.daemon.cli.main import build_parser
    from specd.daemon.cli.serve import api_keys

    keys = tmp_path / "keys"
    keys.write_text("# the editor's\nkey-three\n\n  key-four  \n")
    parser = build_parser()
    args = parser.parse_args(["serve", "--api-key", "key-one, key-two,",
                              "--api-key-file", str(keys)])
    assert api_keys(args) == {"key-one", "key-two", "key-three", "key-four"}
    assert api_keys(parser.parse_args(["serve"])) == frozenset()


def test_serve_upstreams(tmp_path) -> None:
    from specd.daemon.cli.main import build_parser
    from specd.daemon.cli.serve import upstreams

    token = tmp_path / "big.token"
    token.write_text("tok-123\n")
    token.chmod(0o600)
    parser = build_parser()
    args = parser.parse_args(["serve", "--upstream", "big=http://gpu:8000", "--upstream",
                              "small=http://cpu:8080/v1", "--upstream-token-file",
                              f"big={token}"])
    big, small = upstreams(args)
    assert (big.name, big.url, big.token) == ("big", "http://gpu:8000", "tok-123")
    assert small.token is None and "tok-123" not in repr(big)
    assert upstreams(parser.parse_args(["serve"])) == []
    token.chmod(0o644)  # readable by others: refused, the token not in the message
    with pytest.raises(ValueError, match="chmod 600") as err:
        upstreams(args)
    assert "tok-123" not in str(err.value)
    for bad, says in ((["--upstream", "big=http://a", "--upstream", "big=http://b"], "twice"),
                      (["--upstream-token-file", f"other={token}"], "no --upstream"),
                      (["--upstream", "big"], "NAME=URL")):
        token.chmod(0o600)
        with pytest.raises(ValueError, match=says):
            upstreams(parser.parse_args(["serve", *bad]))


def test_serve_chat_template_options(tmp_path) -> None:
    from specd.daemon.cli.main import build_parser
    from specd.daemon.cli.serve import chat_template_options

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    parser = build_parser()
    args = parser.parse_args(["serve", "--chat-template-file", str(template), "--reasoning",
                              "off", "--chat-template-kwargs", '{"flavour": "mint"}'])
    assert chat_template_options(args) == ("{{ messages[0].content }}",
                                           {"flavour": "mint", "enable_thinking": False})
    assert chat_template_options(parser.parse_args(["serve"])) == (None, {})
    with pytest.raises(ValueError, match="not a JSON object"):
        chat_template_options(parser.parse_args(["serve", "--chat-template-kwargs", "[1]"]))


def test_serve_names_the_model_by_its_aliases_and_tags(tiny_model_factory, tmp_path) -> None:
    """--alias / --tags: /v1/models lists them, the first alias in sorted order is the
    model's id and what responses call it, and a request may name any alias."""
    import os
    import socket
    import time
    import urllib.request

    path = str(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SPECD_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specd.daemon.cli", "serve", "-m", path, "--no-socket",
         "--no-fit", "--port", str(port), "-c", "512", "-b", "64", "--strict-model-name",
         "--alias", "tiny-2,fim,code", "--tags", "chat, fim,small"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def call(route: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + route, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    try:
        for _ in range(600):
            try:
                call("/health")
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.2)
        card = call("/v1/models")["data"][0]
        assert card["id"] == "code" and card["aliases"] == ["code", "fim", "tiny-2"]
        assert card["tags"] == ["chat", "fim", "small"]
        assert call("/props")["model_alias"] == "code"
        out = call("/v1/completions", {"model": "tiny-2", "prompt": "a b", "max_tokens": 2})
        assert out["model"] == "code"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
