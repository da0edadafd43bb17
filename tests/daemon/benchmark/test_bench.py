"""daemon.bench: the benchmark suite on a tiny real engine (no peer: llama.cpp is optional)."""

from __future__ import annotations

import json

import pytest

from specd.daemon.benchmark import report as bench_report
from specd.daemon.benchmark import run as bench
from specd.daemon.serving.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    return Engine(EngineConfig(target=str(path), spec_type="ngram", n_ctx=512))


def test_run_summarize_and_write(engine, tmp_path) -> None:
    configs = bench.default_configs(has_draft=False)
    assert [c.name for c in configs] == ["target-only", "ngram n_max=8", "ngram adaptive"]
    lines: list[str] = []
    result = bench.run_bench(engine, prompts={"p": "hello world hello world"},
                             temperatures=(0.0,), max_tokens=24, repeats=2, configs=configs,
                             log=lines.append)
    # a warm-up run each, then the timed ones, and target-only again closing each group
    assert len(lines) == 3 * len(configs) + 2
    assert sum("target-only (closing)" in line for line in lines) == 2
    cells = result["cells"]
    assert len(cells[("p", 0.0, "target-only")].closing_runs) == 2
    greedy = {cell.config: cell.runs + cell.closing_runs for cell in cells.values()}
    # greedy speculation is exact: every configuration emits the same tokens
    hashes = {r.text_hash for runs in greedy.values() for r in runs}
    assert len(hashes) == 1
    weights = {"target": 10**6, bench_report.PEER_TARGET: 5 * 10**5}
    summary = bench_report.summarize(result, bandwidth=20e9, weight_bytes=weights,
                                     machine="test", command="pytest")
    rows = {r["config"]: r for r in summary["rows"]}
    drift = summary["machine_drift"]  # target-only's closing runs over its opening ones
    assert len(drift) == 2 and drift == sorted(drift) and all(d > 0 for d in drift)
    assert rows["target-only"]["vs_target_only_range"] == [drift[0], drift[-1]]
    assert rows["target-only"]["vs_llama_cpp"] is None
    for r in rows.values():
        assert r["decode_tps"] > 0
        draft, verify, other = r["split_ms_per_token"]
        assert verify > 0 and draft >= 0 and other >= 0
        # both are rounded from the unrounded rate (0.2375 may become 0.237 or 0.238)
        assert abs(r["vs_bound"] - r["decode_tps"] / 20000.0) <= 0.00051
        # at least the target's resident growth at load; the run's own peak comes on top
        assert r["memory_mb"] >= round(engine.target.resident_bytes / 1e6)
    assert engine.target.resident_bytes > 0
    assert summary["peak_rss_mb"] * 1e6 >= engine.target.resident_bytes
    assert rows["ngram n_max=8"]["mean_acceptance_length"] >= 1.0
    assert summary["bound_tps"] == {"target": 20000.0, bench_report.PEER_TARGET: 40000.0}
    paths = bench_report.write_outputs(summary, tmp_path)
    assert json.loads(paths[0].read_text())["rows"] == summary["rows"]
    assert paths[2].name == "bench.png"  # matplotlib is a test dependency
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(paths[2]).shape
    assert width > 1000 and height > 400
    table = [line for line in paths[1].read_text().splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(configs)
    assert all(line.count("|") == table[0].count("|") for line in table)
    lookup = table[0].split("|").index(" lookup share ")
    assert [line.split("|")[lookup].strip() for line in table[2:]] == [
        "", str(rows["ngram n_max=8"]["lookup_share"]), str(rows["ngram adaptive"]["lookup_share"])]
    assert "memory MB: process RSS" in paths[1].read_text()
    assert "ran at both ends of each repeat's group" in paths[1].read_text()
    no_memory = {**summary, "rows": [{**r, "memory_mb": None} for r in summary["rows"]]}
    assert "memory MB: not measured" in bench_report.markdown_table(no_memory)


def _speeds(config: str, tps: list[float]) -> bench.Cell:
    runs = [bench.RunResult(1.0, t, 0.1, 1.0, [], {}, 1, 0) for t in tps]
    return bench.Cell("p", 0.0, config, runs)


def test_ratios_pair_the_runs_of_one_repeat() -> None:
    """The host slowed down in repeat 2 for both configurations: run by run the second is
    1.1x the first every time, which the ratio of the medians (27 / 30) would hide."""
    base = _speeds("target-only", [30.0, 20.0, 31.0])
    cell = _speeds("draft+ngram adaptive", [33.0, 22.0, 34.1])
    result = {"cells": {("p", 0.0, c.config): c for c in (base, cell)}, "peak_rss": 0}
    summary = bench_report.summarize(result, bandwidth=None, weight_bytes={},
                                     machine="test", command="pytest")
    row = {r["config"]: r for r in summary["rows"]}["draft+ngram adaptive"]
    assert row["vs_target_only"] == 1.1 and row["vs_target_only_range"] == [1.1, 1.1]
    assert row["decode_tps_runs"] == [33.0, 22.0, 34.1]
    assert row["vs_llama_cpp"] is None and row["vs_llama_cpp_range"] is None
    assert "| 1.1 |" in bench_report.markdown_table(summary)  # one value: no range
    uneven = _speeds("ngram adaptive", [27.0, 22.0, 37.2])
    assert bench_report.paired_ratio("x", uneven, base) == {"x": 1.1, "x_range": [0.9, 1.2]}


def test_ratios_to_target_only_take_the_runs_around_them() -> None:
    """Target-only opened and closed each group: the host slowed steadily through repeat
    1 (30 -> 24 tok/s) and sped up through repeat 2 (20 -> 25); a configuration that ran
    between them at 1.1x the machine's speed there reads 1.1x against the geometric mean
    of the two, and target-only's own ratio is the closing run over the opening one."""
    base = _speeds("target-only", [30.0, 20.0])
    base.closing_runs = _speeds("target-only", [24.0, 25.0]).runs
    cell = _speeds("ngram adaptive", [1.1 * (30 * 24) ** 0.5, 1.1 * (20 * 25) ** 0.5])
    assert bench_report.paired_ratio("x", cell, base) == {"x": 1.1, "x_range": [1.1, 1.1]}
    assert bench_report.paired_ratio("x", base, base) == {"x": 1.025, "x_range": [0.8, 1.25]}
    cells = {("p", 0.0, c.config): c for c in (base, cell)}
    assert bench_report.machine_drift(cells) == [0.8, 1.25]
    summary = bench_report.summarize({"cells": cells, "peak_rss": 0}, bandwidth=None,
                                     weight_bytes={}, machine="test", command="pytest")
    assert summary["machine_drift"] == [0.8, 1.25]
    assert "1.025 (median), 0.800–1.250" in bench_report.footnote(summary)


def test_bandwidth_is_measured() -> None:
    bw = bench.measure_bandwidth(gib=0.05, repeats=2)
    assert 1e8 < bw < 1e13


def _run(start: int, peak: int, growth: int) -> bench.RunResult:
    return bench.RunResult(1.0, 1.0, 0.1, 1.0, [], {}, 1, 0, peak_bytes=peak,
                           start_bytes=start, growth_bytes=growth)


def test_footprint_charges_lasting_growth_to_what_ran_cold() -> None:
    fp = bench.Footprint()
    fp.loaded("target", 1000)
    fp.loaded("draft", 300)
    target, both = frozenset({"target"}), frozenset({"target", "draft"})
    fp.grew("target-only", target, 50)  # the target's arena grew on its first run
    fp.grew("draft n_max=2", both, 20)  # then only the draft ran for the first time
    fp.grew("draft n_max=8", both, 40)  # a longer verify block grew the arena again
    fp.grew("draft n_max=2", both, -5)  # memory handed back is not credited
    assert fp.of("target-only", target, _run(5000, 5007, 0)) == 1057
    assert fp.of("draft n_max=2", both, _run(5000, 5007, 0)) == 1377
    assert fp.of("draft n_max=8", both, _run(5000, 5000, 0)) == 1410
    first = bench.Footprint()
    first.loaded("target", 1000)
    first.loaded("draft", 300)
    first.grew("draft n_max=2", both, 70)  # both cold in one run: charged to the pair
    assert first.of("target-only", target, _run(0, 0, 0)) == 1000
    assert first.of("draft n_max=2", both, _run(0, 0, 0)) == 1370


@pytest.mark.parametrize("name, spec, n_max, adaptive", [
    ("target-only", "none", 0, False), ("draft n_max=3", "draft", 3, False),
    ("draft adaptive", "draft", 8, True), ("ngram n_max=12", "ngram", 12, False),
    ("ngram adaptive", "ngram", 8, True), ("draft+ngram n_max=3", "draft+ngram", 3, False),
    ("draft+ngram adaptive", "draft+ngram", 8, True)])
def test_configs_parse_from_their_names(name, spec, n_max, adaptive) -> None:
    cfg = bench.parse_config(name)
    assert (cfg.name, cfg.spec, cfg.n_max, cfg.adaptive) == (name, spec, n_max, adaptive)


def test_draft_configs_take_a_p_min() -> None:
    cfg = bench.parse_config("draft n_max=4 p_min=0.50")
    assert (cfg.name, cfg.n_max, cfg.p_min, cfg.adaptive) == ("draft n_max=4 p_min=0.5", 4,
                                                               0.5, False)
    cfg = bench.parse_config("draft adaptive p_min=0.3")
    assert (cfg.name, cfg.n_max, cfg.p_min, cfg.adaptive) == ("draft adaptive p_min=0.3", 8,
                                                               0.3, True)


@pytest.mark.parametrize("name", ["draft", "draft n_max=0", "draft n=2", "eagle n_max=2",
                                  "target-only n_max=2", "draft n_max=2 p_min=0",
                                  "draft n_max=2 p_min=x", "ngram n_max=2 p_min=0.5",
                                  "draft p_min=0.5"])
def test_unknown_configs_are_named_in_the_error(name) -> None:
    with pytest.raises(ValueError, match="unknown bench configuration"):
        bench.parse_config(name)
