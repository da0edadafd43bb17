"""daemon.bench: the benchmark suite on a tiny real engine (no peer: llama.cpp is optional)."""

from __future__ import annotations

import json

import pytest

from specd.daemon import bench
from specd.daemon.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_model_factory):  # noqa: ANN001, ANN201
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    return Engine(EngineConfig(target=str(path), spec_type="ngram", n_ctx=512))


def test_run_summarize_and_write(engine, tmp_path) -> None:  # noqa: ANN001
    configs = bench.default_configs(has_draft=False)
    assert [c.name for c in configs] == ["target-only", "ngram n_max=8", "ngram adaptive"]
    lines: list[str] = []
    result = bench.run_bench(engine, prompts={"p": "hello world hello world"},
                             temperatures=(0.0,), max_tokens=24, repeats=2, configs=configs,
                             log=lines.append)
    assert len(lines) == 2 * len(configs)  # warm-up runs are not logged
    cells = result["cells"]
    greedy = {cell.config: cell.runs for cell in cells.values()}
    # greedy speculation is exact: every configuration emits the same tokens
    hashes = {r.text_hash for runs in greedy.values() for r in runs}
    assert len(hashes) == 1
    summary = bench.summarize(result, bandwidth=20e9,
                              weight_bytes={"target": 10**6, bench.PEER_TARGET: 5 * 10**5},
                              machine="test", command="pytest")
    rows = {r["config"]: r for r in summary["rows"]}
    assert rows["target-only"]["vs_target_only"] == 1.0
    assert rows["target-only"]["vs_llama_cpp"] is None
    for r in rows.values():
        assert r["decode_tps"] > 0
        draft, verify, other = r["split_ms_per_token"]
        assert verify > 0 and draft >= 0 and other >= 0
        assert r["vs_bound"] == round(r["decode_tps"] / 20000.0, 3)
        # at least the target's resident growth at load; the run's own peak comes on top
        assert r["memory_mb"] >= round(engine.target.resident_bytes / 1e6)
    assert engine.target.resident_bytes > 0
    assert summary["peak_rss_mb"] * 1e6 >= engine.target.resident_bytes
    assert rows["ngram n_max=8"]["mean_acceptance_length"] >= 1.0
    assert summary["bound_tps"] == {"target": 20000.0, bench.PEER_TARGET: 40000.0}
    paths = bench.write_outputs(summary, tmp_path)
    assert json.loads(paths[0].read_text())["rows"] == summary["rows"]
    assert paths[2].name == "bench.png"  # matplotlib is a test dependency
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(paths[2]).shape
    assert width > 1000 and height > 400
    table = paths[1].read_text().splitlines()
    assert len(table) == 2 + len(configs)
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_bandwidth_is_measured() -> None:
    bw = bench.measure_bandwidth(gib=0.05, repeats=2)
    assert 1e8 < bw < 1e13


def test_footprint_charges_first_runs_to_the_models_that_ran_cold() -> None:
    fp = bench.Footprint()
    fp.loaded("target", 1000)
    fp.loaded("draft", 300)
    target, both = frozenset({"target"}), frozenset({"target", "draft"})
    fp.warmed(target, 50)  # the target's arena grew on its first run
    fp.warmed(both, 20)  # then only the draft ran for the first time
    fp.warmed(both, 999)  # later growth is a run's own, not the models'
    assert fp.of(target, 7) == 1057
    assert fp.of(both, 7) == 1377
    fp2 = bench.Footprint()
    fp2.loaded("target", 1000)
    fp2.loaded("draft", 300)
    fp2.warmed(both, 70)  # both cold in one run: charged to the pair
    assert fp2.of(target, 0) == 1000 and fp2.of(both, 0) == 1370


@pytest.mark.parametrize("name, spec, n_max, adaptive", [
    ("target-only", "none", 0, False), ("draft n_max=3", "draft", 3, False),
    ("draft adaptive", "draft", 8, True), ("ngram n_max=12", "ngram", 12, False),
    ("ngram adaptive", "ngram", 8, True)])
def test_configs_parse_from_their_names(name, spec, n_max, adaptive) -> None:  # noqa: ANN001
    cfg = bench.parse_config(name)
    assert (cfg.name, cfg.spec, cfg.n_max, cfg.adaptive) == (name, spec, n_max, adaptive)


@pytest.mark.parametrize("name", ["draft", "draft n_max=0", "draft n=2", "eagle n_max=2",
                                  "target-only n_max=2"])
def test_unknown_configs_are_named_in_the_error(name) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="unknown bench configuration"):
        bench.parse_config(name)
