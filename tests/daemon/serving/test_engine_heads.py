"""A drafter head as `-md`: recognised from its metadata, refused where it does not fit,
and drafting through the engine with the target's own output."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from specd.daemon.serving.engine import Engine, EngineConfig, EngineError
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.policy import AdaptiveDraftLength

from speculation_checks import assert_drafted, decode_all
from tiny_heads import write_tiny_head

PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]


@pytest.fixture(scope="module")
def files(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Path, Path]:
    target = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, context_length=512)
    head = write_tiny_head(tmp_path_factory.mktemp("heads") / "dflash.gguf", seed=5)
    return target, head


def _engine(target: Path, draft: Path | None, spec_type: str = "auto") -> Engine:
    return Engine(EngineConfig(target=str(target), draft=None if draft is None else str(draft),
                               spec_type=spec_type, n_ctx=512, fetch=False, device="cpu"))


def _generate(engine: Engine, **params: object) -> list[int]:
    """The engine's greedy output for PROMPT; where it has a drafter, the request drafted
    (a random head's drafts are rarely accepted: only drafting is checked)."""
    params = {"draft": DraftParams(n_max=4), "max_tokens": 40, **params}
    gen = engine.start(0, PROMPT, GenerationParams(ignore_eos=True, **params))
    out = decode_all(gen)
    if engine.drafter is not None:
        assert_drafted(gen.stats)
    return out


def test_auto_picks_dflash_for_a_head_and_says_so(files: tuple[Path, Path]) -> None:
    target, head = files
    engine = _engine(target, head)
    assert engine.spec_type == "draft-dflash" and engine.draft_kind == "dflash"
    assert engine.head is not None and engine.draft is None
    assert "dflash.gguf is a dflash head" in engine.draft_choice
    assert "chosen by --spec-type auto" in engine.draft_choice
    assert engine.target.runner.feature_layers == (0, 1)  # target layers 1, 2 -> hidden 0, 1
    assert engine.describe()["draft"]["kind"] == "dflash"
    want = _generate(_engine(target, None, "none"))
    assert _generate(engine) == want
    assert _generate(engine, adaptive=True) == want


def test_a_head_and_a_draft_model_run_side_by_side(
        files: tuple[Path, Path], tiny_model_factory: Callable[..., Path]) -> None:
    """Two draft files, a head and a draft model (in either order): head+draft, each
    round drafting with one of them, the output the target's own; the adaptive policy
    tries both."""
    target, head = files
    model = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=4, context_length=512)
    engine = Engine(EngineConfig(target=str(target), draft=str(model), also_draft=str(head),
                                 n_ctx=512, fetch=False, device="cpu"))
    assert engine.spec_type == "head+draft" and engine.draft_kind == "dflash"
    assert engine.head is not None and engine.draft is not None
    assert "beside the draft model" in engine.draft_choice
    d = engine.describe()
    assert d["head"]["kind"] == "dflash" and d["draft"]["name"] == engine.draft.name
    want = _generate(_engine(target, None, "none"))
    assert _generate(engine) == want
    gen = engine.start(0, PROMPT, GenerationParams(max_tokens=60, ignore_eos=True,
                                                   draft=DraftParams(n_max=4), adaptive=True))
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    gen.close()
    assert out == _generate(_engine(target, None, "none"), max_tokens=60)
    assert set(gen.stats.source_calls) == {"dflash", "draft"}, gen.stats.source_calls
    # the engine's next request starts from this one's estimates of both sources
    after = engine.start(0, PROMPT, GenerationParams(max_tokens=60, ignore_eos=True,
                                                     draft=DraftParams(n_max=4), adaptive=True))
    assert isinstance(after.policy, AdaptiveDraftLength)
    assert all(after.policy.draft_cost(2, s) is not None for s in (0, 1))
    again = after.prefill()
    while not after.done:
        again += after.step()
    after.close()
    assert again == out


def test_two_draft_files_must_be_a_head_and_a_model(
        files: tuple[Path, Path], tiny_model_factory: Callable[..., Path]) -> None:
    target, head = files
    model = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=4, context_length=512)
    for first, second in ((head, head), (model, model)):
        with pytest.raises(EngineError, match="must be a drafter head and a draft model"):
            Engine(EngineConfig(target=str(target), draft=str(first), also_draft=str(second),
                                n_ctx=512, fetch=False, device="cpu"))
    with pytest.raises(EngineError, match="draft-dflash runs one draft file"):
        Engine(EngineConfig(target=str(target), draft=str(head), also_draft=str(model),
                            spec_type="draft-dflash", n_ctx=512, fetch=False, device="cpu"))


def test_the_target_outputs_hidden_states_only_with_a_head(files: tuple[Path, Path]) -> None:
    target, _ = files
    assert _engine(target, None, "none").target.runner.feature_layers == ()


@pytest.mark.parametrize("spec_type,draft_is_head,message", [
    ("draft", True, "needs a draft model, and .* is a dflash head"),
    ("draft+ngram", True, "needs a draft model, and .* is a dflash head"),
    ("draft-dflash", False, "needs a dflash head, and .* is a draft model"),
])
def test_a_spec_type_for_another_kind_of_draft_is_refused(
        files: tuple[Path, Path], tiny_model_factory: Callable[..., Path], spec_type: str,
        draft_is_head: bool, message: str) -> None:
    target, head = files
    draft = head if draft_is_head else tiny_model_factory(arch="qwen3", weight_type="Q8_0",
                                                          seed=4, context_length=512)
    with pytest.raises(EngineError, match=message):
        _engine(target, draft, spec_type)


def test_heads_that_do_not_fit_or_run_are_refused(files: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    target, _ = files
    wide = write_tiny_head(tmp_path / "wide.gguf", n_embd=96, target_hidden_size=96)
    with pytest.raises(EngineError, match="cannot draft for"):
        _engine(target, wide)
    yarn = write_tiny_head(tmp_path / "yarn.gguf", meta={
        "dflash.rope.scaling.type": "yarn", "dflash.rope.scaling.factor": 4.0,
        "dflash.rope.dimension_sections": [8, 0, 0, 0]})
    with pytest.raises(EngineError, match="does not run this head: rope scaling yarn; "
                                          "M-RoPE sections"):
        _engine(target, yarn)
    # what llama.cpp's eagle3 graph has not either
    scaled = write_tiny_head(tmp_path / "scaled.gguf", kind="eagle3", meta={
        "eagle3.embedding_scale": 8.0, "eagle3.attention.sliding_window": 8,
        "eagle3.attention.sliding_window_pattern": [True]})
    with pytest.raises(EngineError, match=r"sliding-window attention \(llama.cpp's eagle3 "
                                          r"graph has none\); embedding scale"):
        _engine(target, scaled)


@pytest.mark.parametrize("kind", ["dspark", "dflash2", "eagle3"])
def test_auto_picks_the_spec_type_of_each_head_kind(files: tuple[Path, Path], tmp_path: Path,
                                                    kind: str) -> None:
    target, _ = files
    head = write_tiny_head(tmp_path / f"{kind}.gguf", kind=kind, seed=5)
    engine = _engine(target, head)
    assert engine.spec_type == f"draft-{kind}" and engine.draft_kind == kind
    assert f"{kind}.gguf is a {kind} head" in engine.draft_choice
    want = _generate(_engine(target, None, "none"))
    assert _generate(engine) == want
    assert _generate(engine, draft=DraftParams(n_max=4, p_min=0.5)) == want


def test_generate_with_a_head_from_the_cli(files: tuple[Path, Path]) -> None:
    target, head = files
    r = subprocess.run([sys.executable, "-m", "specd.daemon.cli", "generate", "-m",
                        str(target), "-md", str(head), "hello", "-n", "16", "--ignore-eos",
                        "--device", "cpu", "--no-fetch"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dflash.gguf is a dflash head" in r.stderr
    assert "speculation draft-dflash:" in r.stderr


def test_generate_with_a_head_and_a_draft_model_from_the_cli(
        files: tuple[Path, Path], tiny_model_factory: Callable[..., Path]) -> None:
    target, head = files
    model = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=4, context_length=512)
    base = [sys.executable, "-m", "specd.daemon.cli", "generate", "-m", str(target), "hello",
            "-n", "24", "--ignore-eos", "--device", "cpu", "--no-fetch", "--temp", "0"]
    alone = subprocess.run([*base, "-md", "none"], capture_output=True, text=True, timeout=300)
    r = subprocess.run([*base, "-md", str(head), "-md", str(model)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and alone.returncode == 0, r.stderr + alone.stderr
    assert r.stdout == alone.stdout
    assert "beside the draft model" in r.stderr and "speculation head+draft:" in r.stderr
    three = subprocess.run([*base, "-md", str(head), "-md", str(model), "-md", str(model)],
                           capture_output=True, text=True, timeout=300)
    assert three.returncode != 0 and "at most two draft files" in three.stderr


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_fit_counts_the_head_and_its_cache(files: tuple[Path, Path], tmp_path: Path,
                                           kind: str) -> None:
    import json

    target, _ = files
    head = write_tiny_head(tmp_path / f"{kind}.gguf", kind=kind, seed=5)
    r = subprocess.run([sys.executable, "-m", "specd.daemon.cli", "fit", "-m", str(target),
                        "-md", str(head), "--device", "cpu", "--no-fetch", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    draft = json.loads(r.stdout)["models"][1]
    assert draft["role"] == "draft" and draft["name"] == f"{kind}.gguf"
    # layers x 2 kv heads x 16 dims x K and V x float32; EAGLE-3: 1 layer, and its g row
    want = 2 * 2 * 16 * 2 * 4 if kind == "dflash" else 2 * 16 * 2 * 4 + 64 * 4
    assert draft["kv_bytes_per_token"] == want
    assert draft["weights_bytes"] > 0


def test_fit_plans_a_head_and_a_draft_model_as_one_draft(
        files: tuple[Path, Path], tiny_model_factory: Callable[..., Path]) -> None:
    import json

    target, head = files
    model = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=4, context_length=512)
    base = [sys.executable, "-m", "specd.daemon.cli", "fit", "-m", str(target), "--device",
            "cpu", "--no-fetch", "--json"]
    rows = {}
    for name, extra in (("head", ["-md", str(head)]), ("model", ["-md", str(model)]),
                        ("both", ["-md", str(head), "-md", str(model)])):
        r = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        rows[name] = json.loads(r.stdout)["models"][1]
    assert rows["both"]["name"] == f"{head.name} + {rows['model']['name']}"
    for key in ("weights_bytes", "kv_bytes_per_token"):
        assert rows["both"][key] == rows["head"][key] + rows["model"][key]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_heads_draft_for_every_target_architecture(arch: str,
                                                   tiny_model_factory: Callable[..., Path],
                                                   tmp_path: Path) -> None:
    """qwen2 included, where llama.cpp's graph does not capture layer inputs for a head."""
    target = tiny_model_factory(arch=arch, weight_type="Q8_0", seed=3, context_length=512)
    head = write_tiny_head(tmp_path / "dflash.gguf", seed=5, target_arch=arch)
    engine = _engine(target, head)
    assert engine.spec_type == "draft-dflash"
    assert _generate(engine) == _generate(_engine(target, None, "none"))


def test_slots_do_not_copy_prefixes_beside_a_head(files: tuple[Path, Path]) -> None:
    """A head keeps the target's features of each slot's context in its own cache: a
    prefix copied from another slot would leave that context behind (and the head
    dropped for the request), so with a head two requests on one prompt each evaluate
    it, and both draft."""
    import threading

    from specd.daemon.serving.scheduler import Request, Scheduler

    target, head = files
    engine = Engine(EngineConfig(target=str(target), draft=str(head), n_ctx=512, slots=2,
                                 fetch=False, device="cpu"))
    scheduler = Scheduler(engine)
    try:
        done = [threading.Event(), threading.Event()]
        reqs = [Request(prompt=PROMPT * 4, params=GenerationParams(
                    max_tokens=12, ignore_eos=True, draft=DraftParams(n_max=4)),
                    on_tokens=lambda t: None, on_done=lambda r, e=e: e.set()) for e in done]
        for r in reqs:
            scheduler.submit(r)
        assert all(e.wait(60) for e in done)
        for r in reqs:
            assert r.error is None and r.gen is not None
            assert r.gen.stats.cached_tokens == 0 and r.gen.stats.drafted > 0
    finally:
        scheduler.stop()


def test_serve_runs_a_head_and_a_draft_model_for_the_openai_client(
        files: tuple[Path, Path], tiny_model_factory: Callable[..., Path]) -> None:
    """`specd serve -md HEAD -md MODEL` on loopback: its startup line names both, and a
    greedy completion through the official SDK is the target's own text."""
    import time

    import openai

    from live_server import call, free_port

    target, head = files
    model = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=4, context_length=512)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specd.daemon.cli", "serve", "-m",
                             str(target), "-md", str(head), "-md", str(model), "--port",
                             str(port), "--no-socket", "--device", "cpu", "--no-fetch",
                             "-c", "512"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if call(port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        else:
            raise AssertionError("specd serve did not come up")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        got = client.completions.create(model="any", prompt="hello world", max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert f"head {head.name}" in err and "spec head+draft" in err, err
    alone = _engine(target, None, "none")
    ids = alone.encode_prompt("hello world")
    gen = alone.start(0, ids, GenerationParams(max_tokens=24, ignore_eos=True))
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    assert got.choices[0].text == alone.tokenizer.decode(out)
