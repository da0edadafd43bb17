"""Memory fit: probes, the planner on synthetic costs, and one real measurement (tiny model)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.history import HistoryStore
from specd.memory_fit import (
    CpuProbe,
    FakeProbe,
    FitError,
    ModelCost,
    Plan,
    ProbeError,
    fit,
    measure,
    probe_for,
)
from specd.memory_fit.measure import COST_FILE, default_points, measure_in_process
from specd.memory_fit.plan import _configs

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MARGIN = 256 * MiB

# shaped like the Qwen2.5-Coder 1.5B / 0.5B pair as measured on CPU
TARGET = ModelCost(weights_bytes=1800 * MiB, kv_bytes_per_token=56 * KiB,
                   workspace_base=240 * MiB, workspace_per_ctx=40_000.0, n_ctx_train=32768,
                   load_extra_bytes=130 * MiB, metadata_bytes=40 * MiB,
                   tokenizer_bytes=60 * MiB, name="target-1.5b")
DRAFT = ModelCost(weights_bytes=670 * MiB, kv_bytes_per_token=24 * KiB,
                  workspace_base=155 * MiB, workspace_per_ctx=54_000.0, n_ctx_train=32768,
                  load_extra_bytes=130 * MiB, metadata_bytes=25 * MiB,
                  tokenizer_bytes=60 * MiB, name="draft-0.5b")


def steady(n_ctx: int, slots: int, *costs: ModelCost, shared: bool = False) -> int:
    total = 0
    for i, c in enumerate(costs):
        w = 0 if (shared and i > 0) else c.weights_bytes
        host = c.metadata_bytes + (c.tokenizer_bytes if i == 0 else 0)  # 1 tokenizer
        total += w + c.kv_bytes(n_ctx, slots) + c.workspace_bytes_at(n_ctx) + host
    return total


def probe(free: int) -> FakeProbe:
    return FakeProbe(total=max(free, 64 * GiB), free=free)


# ----------------------------------------------------------------------------- probes

def test_probes() -> None:
    m = CpuProbe().read()
    assert m.device == "cpu" and m.total_bytes >= m.free_bytes > 0
    assert isinstance(probe_for("cpu"), CpuProbe)
    with pytest.raises(ValueError):
        probe_for("tpu")
    with pytest.raises(ValueError):
        FakeProbe(total=1, free=2)
    try:
        import pynvml  # noqa: F401
    except ImportError:
        with pytest.raises(ProbeError, match="nvidia-ml-py"):
            probe_for("cuda:0")
    snap = FakeProbe.snapshot(FakeProbe(10, 4, "cuda:1")).read()
    assert (snap.device, snap.total_bytes, snap.free_bytes) == ("cuda:1", 10, 4)


def test_cost_from_points() -> None:
    c = ModelCost.from_points(100, 8, [(2048, 3000), (512, 1500)])
    assert c.workspace_bytes_at(512) == 1500 and c.workspace_bytes_at(2048) == 3000
    assert c.workspace_bytes_at(4096) == 5000  # extrapolated linearly
    flat = ModelCost.from_points(100, 8, [(512, 1500), (2048, 1400)])  # noise: never < points
    assert flat.workspace_per_ctx == 0 and flat.workspace_bytes_at(512) == 1500
    assert ModelCost.from_dict(json.loads(json.dumps(c.as_dict()))) == c


def test_sliding_window_rings_hold_their_rows_not_the_context() -> None:
    """kv_bytes: the ring layers' share of a token's bytes counts min(n_ctx, ring) rows."""
    c = ModelCost(100, kv_bytes_per_token=18, kv_ring_rows=768, kv_ring_bytes_per_row=15)
    assert c.kv_bytes(512, 1) == 18 * 512  # shorter than the ring: as full layers
    assert c.kv_bytes(32768, 2) == (3 * 32768 + 15 * 768) * 2
    assert ModelCost.from_dict(json.loads(json.dumps(c.as_dict()))) == c


def test_two_drafts_loaded_together_cost_their_sum() -> None:
    """A head beside a draft model is planned as one draft: its bytes at any context are
    the two models' together, and it is dropped or kept whole."""
    head = ModelCost(weights_bytes=60 * MiB, kv_bytes_per_token=4 * KiB, workspace_base=9 * MiB,
                     workspace_per_ctx=1000.0, n_ctx_train=4096, load_extra_bytes=10 * MiB,
                     metadata_bytes=1 * MiB, name="head")
    both = head.beside(DRAFT)
    assert both.name == "head + draft-0.5b" and both.n_ctx_train == 4096
    assert steady(2048, 2, TARGET, both) == steady(2048, 2, TARGET, head, DRAFT)
    plan = fit(TARGET, both, probe=probe(64 * GiB), margin_bytes=MARGIN)
    assert plan.n_ctx == 4096 and not plan.draft_dropped
    tight = steady(4096, 1, TARGET, DRAFT) + MARGIN
    assert fit(TARGET, both, probe=probe(tight), margin_bytes=MARGIN, max_ctx=4096,
               min_ctx=4096).draft_dropped
    ring = ModelCost(100, kv_bytes_per_token=18, kv_ring_rows=768, kv_ring_bytes_per_row=15)
    assert ring.beside(DRAFT).kv_bytes(4096, 1) == ring.kv_bytes(4096, 1) + DRAFT.kv_bytes(4096, 1)
    with pytest.raises(ValueError, match="both have sliding-window caches"):
        ring.beside(ring)


def test_a_measured_gemma3_counts_its_rings(tiny_model_factory: Any) -> None:
    """A sliding-window model built for specd's kernel: the measured cost knows its rings,
    and its KV bytes at a context are what a runner of that context allocates."""
    from specd.ort_models import native_ops
    from specd.ort_models.graph_builder import BuildOptions
    from specd.ort_models.model_cache import load_or_build
    from specd.ort_models.runner import ModelRunner

    if native_ops.library() is None:
        pytest.skip(f"specd's kernels are off: {native_ops.unavailable_reason()}")
    path = tiny_model_factory(arch="gemma3", weight_type="Q8_0", n_layer=4, head_dim=32,
                              sliding_window=5, swa_pattern=2, context_length=2048)
    built = load_or_build(path, BuildOptions(kernels="gguf", attention="native",
                                             kv_dtype="f16"))
    cost = measure_in_process(built, "cpu", 1, (256, 512))
    assert cost.kv_ring_rows == 264
    runner = ModelRunner(built, n_ctx=2048)
    assert runner.ring == 264
    assert cost.kv_bytes(2048, 1) == pytest.approx(runner.kv_bytes, rel=0.01)


# ----------------------------------------------------------------------------- planner

def test_fits_as_asked() -> None:
    plan = fit(TARGET, DRAFT, probe=probe(60 * GiB), slots=2, margin_bytes=MARGIN)
    assert (plan.n_ctx, plan.slots, plan.draft_dropped, plan.warnings) == (32768, 2, False, [])
    t, d = plan.rows
    assert t.kv_bytes == TARGET.kv_bytes_per_token * 32768 * 2
    assert d.kv_bytes == DRAFT.kv_bytes_per_token * 32768 * 2  # same n_ctx, same slots
    assert d.workspace_bytes == DRAFT.workspace_bytes_at(32768)
    assert plan.total_bytes == steady(32768, 2, TARGET, DRAFT)
    assert plan.free_after_bytes == 60 * GiB - plan.total_bytes
    d = plan.as_dict()
    assert json.loads(json.dumps(d))["n_ctx"] == 32768 and len(d["models"]) == 2
    table = plan.table()
    for word in ("n_ctx 32768", "target-1.5b", "draft-0.5b", "workspace", "free after"):
        assert word in table


def test_context_shrinks() -> None:
    need_8k = steady(8192, 1, TARGET, DRAFT)
    plan = fit(TARGET, DRAFT, probe=probe(need_8k + MARGIN + 1000), slots=1, margin_bytes=MARGIN)
    assert plan.n_ctx == 8192 and plan.slots == 1 and not plan.draft_dropped
    assert plan.total_bytes <= need_8k
    assert any("context limited to 8192" in w for w in plan.warnings)
    plan = fit(TARGET, DRAFT, probe=probe(need_8k + MARGIN - 1), slots=1, margin_bytes=MARGIN)
    assert plan.n_ctx == 8192 - 256


def test_slots_shrink() -> None:
    free = steady(512, 2, TARGET, DRAFT) + MARGIN + 1  # 2 slots fit at min_ctx, 3 do not
    plan = fit(TARGET, DRAFT, probe=probe(free), slots=4, margin_bytes=MARGIN)
    assert (plan.slots, plan.requested_slots, plan.draft_dropped) == (2, 4, False)
    assert plan.n_ctx >= 512
    assert any("slots reduced from 4 to 2" in w for w in plan.warnings)


def test_draft_dropped_with_reason() -> None:
    free = steady(512, 1, TARGET) + MARGIN + 10 * MiB  # the target alone fits, not the pair
    plan = fit(TARGET, DRAFT, probe=probe(free), slots=1, margin_bytes=MARGIN)
    assert plan.draft_dropped and not plan.has_draft and [r.role for r in plan.rows] == ["target"]
    (warning,) = [w for w in plan.warnings if "draft" in w]
    assert "draft model dropped" in warning and "do not fit" in warning
    assert "needs" in warning and "free" in warning


EMBEDDER = ModelCost(weights_bytes=300 * MiB, kv_bytes_per_token=12 * KiB,
                     workspace_base=50 * MiB, workspace_per_ctx=10_000.0, n_ctx_train=8192,
                     metadata_bytes=10 * MiB, tokenizer_bytes=30 * MiB, name="embedder")


def test_an_embedding_model_is_counted_beside_the_others() -> None:
    """`--embedding-model`: its weights, one sequence's KV at the context (as far as its
    training goes), its workspace and its own tokenizer count in every configuration, so a
    plan that fits the pair alone gives up context for it (or the draft, before slots)."""
    plan = fit(TARGET, DRAFT, probe=probe(60 * GiB), slots=2, margin_bytes=MARGIN,
               beside=EMBEDDER)
    t, d, e = plan.rows
    assert (e.role, e.name, plan.n_ctx) == ("embedding", "embedder", 32768)
    assert e.kv_bytes == EMBEDDER.kv_bytes_per_token * 8192  # one sequence, its 8k
    assert e.workspace_bytes == EMBEDDER.workspace_bytes_at(8192)
    assert e.host_bytes == 40 * MiB
    assert plan.total_bytes == steady(32768, 2, TARGET, DRAFT) + e.total_bytes
    need_8k = steady(8192, 1, TARGET, DRAFT)
    alone = fit(TARGET, DRAFT, probe=probe(need_8k + MARGIN + 1000), margin_bytes=MARGIN)
    beside = fit(TARGET, DRAFT, probe=probe(need_8k + MARGIN + 1000), margin_bytes=MARGIN,
                 beside=EMBEDDER)
    assert alone.n_ctx == 8192 and beside.n_ctx < 8192
    assert beside.total_bytes <= need_8k + 1000 and "embedding" in beside.table()


def test_on_fail_order() -> None:
    free = steady(512, 2, TARGET) + MARGIN + 10 * MiB  # target x 2 slots fits, pair x 1 not
    keep_draft_first = fit(TARGET, DRAFT, probe=probe(free), slots=2, margin_bytes=MARGIN)
    assert keep_draft_first.draft_dropped and keep_draft_first.slots == 2
    free = steady(512, 1, TARGET, DRAFT) + MARGIN + 10 * MiB  # pair x 1 fits, pair x 2 not
    a = fit(TARGET, DRAFT, probe=probe(free), slots=2, margin_bytes=MARGIN)
    assert (a.slots, a.draft_dropped) == (1, False)
    b = fit(TARGET, DRAFT, probe=probe(free), slots=2, margin_bytes=MARGIN,
            on_fail=("drop_draft", "fewer_slots"))
    assert (b.slots, b.draft_dropped) == (2, True)
    with pytest.raises(FitError):
        fit(TARGET, DRAFT, probe=probe(free), slots=2, margin_bytes=MARGIN, on_fail=())
    assert _configs(3, True, ("fewer_slots", "drop_draft")) == [
        (3, True), (2, True), (1, True), (3, False), (2, False), (1, False)]
    assert _configs(2, True, ("drop_draft", "fewer_slots")) == [(2, True), (2, False),
                                                                (1, False)]
    with pytest.raises(ValueError):
        fit(TARGET, probe=probe(free), on_fail=("shrug",))


def test_nothing_fits() -> None:
    free = 1 * GiB
    with pytest.raises(FitError) as e:
        fit(TARGET, DRAFT, probe=probe(free), slots=2, margin_bytes=MARGIN)
    msg = str(e.value)
    assert "nothing fits on cpu" in msg and "needs" in msg and "1.00 GiB is free" in msg
    assert "n_ctx 512" in msg


def test_shared_weights_drafter() -> None:
    head = ModelCost(weights_bytes=TARGET.weights_bytes, kv_bytes_per_token=4 * KiB,
                     workspace_base=20 * MiB, workspace_per_ctx=1000.0, n_ctx_train=32768,
                     name="head")
    plan = fit(TARGET, head, probe=probe(60 * GiB), margin_bytes=MARGIN,
               shares_target_weights=True)
    t, h = plan.rows
    assert h.weights_bytes == 0 and h.weights_shared and t.weights_bytes == TARGET.weights_bytes
    assert plan.total_bytes == steady(32768, 1, TARGET, head, shared=True)
    assert "shared" in plan.table()
    # fits only because no second copy of the weights is counted
    free = steady(512, 1, TARGET, head, shared=True) + MARGIN + 1
    assert not fit(TARGET, head, probe=probe(free), margin_bytes=MARGIN,
                   shares_target_weights=True).draft_dropped
    assert fit(TARGET, head, probe=probe(free), margin_bytes=MARGIN).draft_dropped


@pytest.mark.parametrize("min_ctx,max_ctx", [(512, None), (600, 5000), (1, 300), (4096, 4096)])
def test_context_multiple_of_256_within_bounds(min_ctx: int, max_ctx: int | None) -> None:
    short_draft = ModelCost(**{**DRAFT.as_dict(), "n_ctx_train": 20000, "points": ()})
    hi = min(max_ctx or 32768, 20000) // 256 * 256
    lo = min(-(-min_ctx // 256) * 256, hi)
    for free in np.linspace(2 * GiB, 12 * GiB, 41):
        try:
            plan: Plan = fit(TARGET, short_draft, probe=probe(int(free)), slots=2,
                             margin_bytes=MARGIN, min_ctx=min_ctx, max_ctx=max_ctx)
        except FitError:
            continue
        top = hi if plan.has_draft else min(max_ctx or 32768, 32768) // 256 * 256
        assert plan.n_ctx % 256 == 0 and lo <= plan.n_ctx <= top
        assert plan.total_bytes <= int(free) - MARGIN


def test_load_peak_counted() -> None:
    big_load = ModelCost(**{**TARGET.as_dict(), "load_extra_bytes": 4 * GiB, "points": ()})
    plan = fit(big_load, probe=probe(60 * GiB), margin_bytes=MARGIN, max_ctx=1024)
    host = TARGET.metadata_bytes + TARGET.tokenizer_bytes
    assert plan.total_bytes == plan.load_peak_bytes == host + TARGET.weights_bytes + 4 * GiB
    assert "load peak" in plan.table()


# ----------------------------------------------------------------------------- real models

@pytest.fixture(scope="module")
def tiny_cost(tiny_model_factory: Any, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Any, ModelCost]]:
    from specd.ort_models.model_cache import load_or_build

    with pytest.MonkeyPatch.context() as mp:  # a private graph cache for this module
        mp.setenv("SPECD_CACHE_DIR", str(tmp_path_factory.mktemp("fit_cache")))
        path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", context_length=1024)
        built = load_or_build(path)
        yield built, measure(built, "cpu", threads=1, use_cache=False)


def test_real_measurement(tiny_cost: tuple[Any, ModelCost]) -> None:
    built, cost = tiny_cost
    hp = built.hparams
    # weights a session maps in place count as weights once resident, not as workspace
    assert cost.weights_bytes >= 0.8 * built.weights_bytes
    assert cost.kv_bytes_per_token == hp.n_layer * hp.n_head_kv * hp.head_dim * 2 * 4
    assert cost.n_ctx_train == 1024
    assert [n for n, _ in cost.points] == list(default_points(1024)) == [256, 1024]
    (_, w_a), (_, w_b) = cost.points
    assert w_b > w_a > 0  # the workspace grows with the context
    assert cost.workspace_bytes_at(1024) > cost.workspace_bytes_at(256)
    # the second time comes from the graph folder's cache, instantly
    assert (Path(built.folder) / COST_FILE).is_file()
    t0 = time.perf_counter()
    assert measure(built, "cpu", threads=1) == cost
    assert time.perf_counter() - t0 < 0.5


def test_planned_context_can_be_filled(tiny_cost: tuple[Any, ModelCost]) -> None:
    from specd.ort_models.runner import ModelRunner

    built, cost = tiny_cost
    cost = dataclasses.replace(cost, load_extra_bytes=0)  # the steady total decides here
    free = steady(768, 1, cost) + MARGIN + 1  # room for 768 tokens, not 1024
    plan = fit(cost, probe=probe(free), margin_bytes=MARGIN, min_ctx=256)
    assert plan.n_ctx == 768
    runner = ModelRunner(built, n_ctx=plan.n_ctx, threads=1)
    assert runner.n_ctx == plan.n_ctx
    tokens = np.random.default_rng(0).integers(0, built.hparams.n_vocab, plan.n_ctx - 1)
    logits = runner.prefill(0, tokens.tolist())
    assert logits.shape == (built.hparams.n_vocab,) and np.isfinite(logits).all()


def test_cli_fit(tiny_cost: tuple[Any, ModelCost], capsys: pytest.CaptureFixture[str]) -> None:
    from specd.daemon.cli.fit import add_fit_parser

    built, _ = tiny_cost
    parser = argparse.ArgumentParser(prog="specd")
    add_fit_parser(parser.add_subparsers())

    def run(*argv: str) -> int:
        args = parser.parse_args(["fit", "-m", str(built.gguf_path), "--device", "cpu",
                                  "-t", "1", *argv])
        return args.func(args)

    assert run("--json", "--margin-mb", "16") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_ctx"] == 1024 and out["slots"] == 2  # serve's default slots (DEFAULT_SLOTS)
    # the history index's bound, as serve plans it (default on; 16 bytes a token)
    history = [m for m in out["models"] if m["role"] == "history"]
    assert [m["host_bytes"] for m in history] == [16 * (1 << 22)]
    assert run("--json", "--margin-mb", "16", "--history-tokens", "4096") == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["host_bytes"] for m in out["models"] if m["role"] == "history"] == [16 * 4096]
    assert run("--json", "--margin-mb", "16", "--no-history") == 0
    out = json.loads(capsys.readouterr().out)
    assert all(m["role"] != "history" for m in out["models"])
    assert run("--margin-mb", "16") == 0
    assert "suffix index" in capsys.readouterr().out
    assert run("-md", str(built.gguf_path), "--slots", "2", "--margin-mb", "16") == 0
    assert "n_ctx 1024" in capsys.readouterr().out
    assert run("--margin-mb", str(10**9)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specd: error: nothing fits")


def test_draft_trained_context_caps() -> None:
    short = dataclasses.replace(DRAFT, n_ctx_train=20000)
    plan = fit(TARGET, short, probe=probe(60 * GiB), margin_bytes=MARGIN)
    assert plan.n_ctx == 19968 and plan.has_draft
    assert any("draft's trained context (20000)" in w for w in plan.warnings)


def _resident(n: int) -> mmap.mmap:
    """n bytes of fresh, resident memory: an anonymous mapping written through. (A numpy
    array may be served from heap pages an earlier test freed and left resident, and then
    the RSS does not move.)"""
    m = mmap.mmap(-1, n)
    m.write(b"\x01" * n)
    return m


def test_peak_rss_nests_and_reports_growth() -> None:
    from specd.memory_fit.rss import PeakRss, lifetime_peak

    mib = 1 << 20
    with PeakRss() as outer:
        with PeakRss() as inner:
            scratch = _resident(64 * mib)
            scratch.close()  # unmapped: no longer resident
        kept = _resident(32 * mib)
    assert inner.peak - inner.start >= 60 * mib
    assert outer.peak >= inner.peak  # the inner block's reset did not lose the outer's peak
    assert outer.growth >= 30 * mib
    assert lifetime_peak() >= outer.start
    kept.close()


def test_models_trained_on_one_bucket_are_measured_at_it(tiny_model_factory: Any,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A trained context under two buckets (256, 300) is measured at its one bucket: a
    second point past it would not fit the context."""
    from specd.ort_models.model_cache import load_or_build

    assert default_points(256) == default_points(300) == (256,)
    assert default_points(512) == (256, 512)
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    built = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0",
                                             context_length=300))
    cost = measure(built, "cpu", threads=1, use_cache=False)
    assert [n for n, _ in cost.points] == [256] and cost.workspace_per_ctx == 0
    plan = fit(cost, probe=probe(64 * GiB), margin_bytes=MARGIN)
    assert plan.n_ctx == 256


def test_a_killed_measurement_says_so(tiny_cost: tuple[Any, ModelCost], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The measuring process killed (the out-of-memory killer's SIGKILL) is named as such,
    with the model's file, not reported as 'no output'."""
    import sys

    from specd.memory_fit.measure import MeasureError

    built, _ = tiny_cost
    killer = tmp_path / "python"
    killer.write_text("#!/bin/sh\nkill -9 $$\n")
    killer.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(killer))
    with pytest.raises(MeasureError) as info:
        measure(built, "cpu", threads=1, use_cache=False)
    msg = str(info.value)
    assert "killed by SIGKILL (out of memory?)" in msg and Path(built.gguf_path).name in msg


def test_a_cached_measurement_takes_the_file_s_current_name(
        tiny_cost: tuple[Any, ModelCost], tmp_path: Path) -> None:
    built, cost = tiny_cost
    renamed = dataclasses.replace(built, gguf_path=tmp_path / "my-renamed-model.gguf")
    assert measure(renamed, "cpu", threads=1).name == "my-renamed-model"
    assert measure(built, "cpu", threads=1).name == cost.name


def test_cli_fit_rejects_bad_slots_and_margins(tiny_cost: tuple[Any, ModelCost],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from specd.daemon.cli.fit import add_fit_parser

    built, _ = tiny_cost
    parser = argparse.ArgumentParser(prog="specd")
    add_fit_parser(parser.add_subparsers())
    for bad in (["--slots", "0"], ["--slots", "100000000"], ["--margin-mb", "inf"],
                ["--margin-mb", "nan"], ["--margin-mb", "-100000"], ["--draft-vocab", "-1"],
                ["--draft-vocab", "many"]):
        with pytest.raises(SystemExit) as info:  # a usage error, before any measuring
            parser.parse_args(["fit", "-m", str(built.gguf_path), *bad])
        assert info.value.code == 2
        assert bad[0] in capsys.readouterr().err


def test_serve_plan_keeps_lookup_and_takes_c_as_the_runner_does(
        tiny_cost: tuple[Any, ModelCost], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`serve -c` is rounded up to whole buckets as the runner rounds it; when the draft
    is dropped, `--spec-type auto` keeps prompt lookup (it needs no memory)."""
    from specd.daemon.cli.main import build_parser
    from specd.daemon.cli.options import settle_draft
    from specd.daemon.cli.serve import plan_memory
    from specd.daemon.models import building
    from specd.memory_fit.plan import DEFAULT_MARGIN_BYTES

    built, _ = tiny_cost
    gguf = str(built.gguf_path)
    monkeypatch.setattr(building, "probe_for", lambda dev: probe(64 * GiB))

    def planned(*argv: str) -> argparse.Namespace:
        args = build_parser().parse_args(["serve", "-m", gguf, "--device", "cpu", "-t", "1",
                                          *argv])
        settle_draft(args)
        plan_memory(args)
        return args

    assert planned("-c", "1000").n_ctx == 1024
    assert planned("-c", "300").n_ctx == 512
    assert planned("-c", "100").n_ctx == 256
    capsys.readouterr()
    alone = building.fit_models(gguf, device="cpu", threads=1, max_ctx=1024, margin_bytes=0,
                                probe=probe(64 * GiB),
                                history_bytes=HistoryStore.bound_bytes())[0].total_bytes
    room = alone + DEFAULT_MARGIN_BYTES + (64 << 10)  # the target alone, not with the draft
    monkeypatch.setattr(building, "probe_for", lambda dev: probe(room))
    args = planned("-md", gguf, "-c", "1024")
    assert args.draft is None and args.spec_type == "ngram"
    assert "draft model dropped" in capsys.readouterr().err


def test_serve_plan_falls_back_to_the_next_measured_drafter_that_fits(
        tiny_cost: tuple[Any, ModelCost], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A drafter chosen by measurement (`settle_draft`) that does not fit beside the target
    gives way to the next fastest measured one that does (a small head), not to lookup."""
    from specd.daemon.cli.main import build_parser
    from specd.daemon.cli.options import settle_draft
    from specd.daemon.cli.serve import plan_memory
    from specd.daemon.models import building
    from specd.memory_fit.plan import DEFAULT_MARGIN_BYTES

    from tiny_heads import write_tiny_head

    built, _ = tiny_cost
    gguf = str(built.gguf_path)
    head = str(write_tiny_head(tmp_path / "head.gguf", seed=5, target_arch="qwen2"))

    def total(draft: str) -> int:
        return building.fit_models(gguf, draft, device="cpu", threads=1, max_ctx=1024,
                                   margin_bytes=0, probe=probe(64 * GiB),
                                   history_bytes=HistoryStore.bound_bytes())[0].total_bytes

    assert total(head) < total(gguf)  # the head fits where the model draft does not
    room = total(head) + DEFAULT_MARGIN_BYTES + (64 << 10)
    monkeypatch.setattr(building, "probe_for", lambda dev: probe(room))
    args = build_parser().parse_args(["serve", "-m", gguf, "-md", gguf, "--device", "cpu",
                                      "-t", "1", "-c", "1024"])
    settle_draft(args)
    args.draft_fallbacks = (head,)  # as settle_draft sets it from the measured table
    plan = plan_memory(args)
    assert args.draft == head and args.spec_type == "auto"
    assert plan is not None and [m["role"] for m in plan["models"]] == [
        "target", "draft", "history"]
    assert "measured next fastest, does" in capsys.readouterr().err


def test_fit_models_measures_the_embedding_model(tiny_cost: tuple[Any, ModelCost]) -> None:
    """fit_models builds the embedding model as the engine loads it (its last hidden state
    out, no sampler), measures it and fits it beside the target."""
    from specd.daemon.models import building

    built, _ = tiny_cost
    gguf = str(built.gguf_path)
    alone, _ = building.fit_models(gguf, device="cpu", threads=1, max_ctx=512,
                                   margin_bytes=0, probe=probe(64 * GiB))
    plan, costs = building.fit_models(gguf, device="cpu", threads=1, max_ctx=512,
                                      margin_bytes=0, probe=probe(64 * GiB),
                                      embedding_model=gguf)
    assert [r.role for r in plan.rows] == ["target", "embedding"] and len(costs) == 2
    assert plan.rows[1].weights_bytes > 0
    assert plan.total_bytes > alone.total_bytes


def test_weights_mapped_in_place_count_as_weights(tiny_model_factory: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """specd's kernels read their initializers where ORT maps them, so they become
    resident in the first run, not at load: they still show as weights (the 1.5B's
    showed 3 MiB of weights and 1.1 GiB of workspace)."""
    from specd.daemon.models.building import build_options
    from specd.ort_models.model_cache import load_or_build

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    built = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q4_K", n_embd=256,
                                             n_ff=512, context_length=1024),
                          build_options("target"))
    cost = measure(built, "cpu", threads=1, use_cache=False)
    assert cost.weights_bytes >= 0.8 * built.weights_bytes


def test_built_model_finds_a_whole_vocabulary_cut_under_no_cut(tiny_model_factory: Any,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """A cut at or past the vocabulary is cached as no cut: `built_model` reads that
    folder's meta (no GGUF parsing, no build); a real cut is not served by it."""
    from specd.daemon.models.building import built_model
    from specd.ort_models import model_cache
    from specd.ort_models.graph_builder import BuildOptions

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5)
    whole = model_cache.load_or_build(path)
    n_vocab = whole.hparams.n_vocab
    real = model_cache.load_or_build

    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("built_model should not have parsed or built the GGUF")

    monkeypatch.setattr(model_cache, "load_or_build", refuse)
    got = built_model(path, options=BuildOptions(vocab_rows=n_vocab + 7))
    assert got.folder == whole.folder and got.options.vocab_rows == 0
    monkeypatch.setattr(model_cache, "load_or_build", real)
    cut = built_model(path, options=BuildOptions(vocab_rows=n_vocab // 2))
    assert cut.folder != whole.folder and cut.options.vocab_rows == n_vocab // 2


_MEASURING_PARENT = """
import sys
from specd.memory_fit.measure import built_from_folder, measure
measure(built_from_folder(sys.argv[1]), "cpu", threads=1, use_cache=False)
"""


def test_the_measuring_child_ends_with_a_killed_parent(tiny_cost: tuple[Any, ModelCost]
                                                       ) -> None:
    """Before: the measuring child outlived a killed `specd serve` (and held the model's
    memory). Here its parent is killed while it is stopped mid-measurement (so it cannot
    finish on its own): the kernel ends it too."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    built, _ = tiny_cost
    parent = subprocess.Popen([sys.executable, "-c", _MEASURING_PARENT, str(built.folder)],
                              env={**os.environ})
    child: psutil.Process | None = None
    try:
        deadline = time.monotonic() + 60
        while child is None and time.monotonic() < deadline:
            kids = psutil.Process(parent.pid).children()
            child = next((k for k in kids if "specd.memory_fit.measure" in " ".join(
                k.cmdline())), None)
            time.sleep(0.05)
        assert child is not None, "no measuring child"
        while time.monotonic() < deadline:  # measuring (ORT loaded): past its start
            if any("onnxruntime" in m.path for m in child.memory_maps()):
                break
            time.sleep(0.05)
        child.send_signal(signal.SIGSTOP)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        gone, _ = psutil.wait_procs([child], timeout=10)
        assert gone, "the measuring child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and child.is_running():
            child.kill()


def test_the_vision_encoder_is_counted_beside_the_others() -> None:
    """--mmproj: the encoder's built weights and the activations of its largest image
    count in every configuration (no KV: it runs one image at a time), so the context
    gives up room for it."""

    from specd.memory_fit.vision import max_patches, vision_cost
    from specd.ort_models.vision.encoder import read_checked

    mmproj = Path(__file__).parents[1] / "fixtures" / "vision" / "gemma3-mmproj.gguf"
    vision = vision_cost(mmproj)
    hp = read_checked(mmproj)[2]
    n = max_patches(hp)
    assert n == (hp.image_size // hp.patch_size) ** 2
    assert vision.weights_bytes > 0 and vision.kv_bytes_per_token == 0
    assert vision.workspace_bytes_at(0) >= 4 * hp.n_head * n * n
    plan = fit(TARGET, DRAFT, probe=probe(60 * GiB), slots=2, margin_bytes=MARGIN,
               vision=vision)
    v = plan.rows[-1]
    assert (v.role, v.kv_bytes) == ("vision", 0)
    assert plan.total_bytes == steady(plan.n_ctx, 2, TARGET, DRAFT) + v.total_bytes
    need_8k = steady(8192, 1, TARGET, DRAFT)
    big = dataclasses.replace(vision, weights_bytes=512 * MiB)
    squeezed = fit(TARGET, DRAFT, probe=probe(need_8k + MARGIN + 1000), margin_bytes=MARGIN,
                   vision=big)
    assert squeezed.n_ctx < 8192 and "vision" in squeezed.table()


def test_the_history_index_bound_is_counted_in_every_configuration() -> None:
    """The history index's bound (HistoryStore.bound_bytes) is a row of host memory that
    every configuration counts: a plan that fits the pair alone gives up context for it,
    and the table names it."""
    from specd.daemon.drafters.history import HistoryStore

    bound = HistoryStore.bound_bytes(1 << 22)
    assert bound == 64 * MiB  # 16 bytes a token
    plan = fit(TARGET, DRAFT, probe=probe(60 * GiB), slots=2, margin_bytes=MARGIN,
               history_bytes=bound)
    t, d, h = plan.rows
    assert (h.role, h.host_bytes, h.total_bytes) == ("history", bound, bound)
    assert plan.total_bytes == steady(32768, 2, TARGET, DRAFT) + bound
    assert "history" in plan.table() and "64.00 MiB" in plan.table()
    assert plan.as_dict()["models"][2]["host_bytes"] == bound
    need_8k = steady(8192, 1, TARGET, DRAFT)
    alone = fit(TARGET, DRAFT, probe=probe(need_8k + MARGIN + 1000), margin_bytes=MARGIN)
    with_history = fit(TARGET, DRAFT, probe=probe(need_8k + MARGIN + 1000),
                       margin_bytes=MARGIN, history_bytes=bound)
    assert alone.n_ctx == 8192 and with_history.n_ctx < 8192
    assert with_history.total_bytes <= need_8k + 1000
    # no history: no row
    assert [r.role for r in fit(TARGET, probe=probe(60 * GiB)).rows] == ["target"]
    with pytest.raises(ValueError, match="history_bytes"):
        fit(TARGET, probe=probe(60 * GiB), history_bytes=-1)
