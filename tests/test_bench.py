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
    assert len(lines) == 2 * len(configs)
    cells = result["cells"]
    greedy = {cell.config: cell.runs for cell in cells.values()}
    # greedy speculation is exact: every configuration emits the same tokens
    hashes = {r.text_hash for runs in greedy.values() for r in runs}
    assert len(hashes) == 1
    summary = bench.summarize(result, bandwidth=20e9, weight_bytes={"target": 10**6},
                              machine="test", command="pytest")
    rows = {r["config"]: r for r in summary["rows"]}
    assert rows["target-only"]["vs_target_only"] == 1.0
    assert rows["target-only"]["vs_llama_cpp"] is None
    for r in rows.values():
        assert r["decode_tps"] > 0
        draft, verify, other = r["split_ms_per_token"]
        assert verify > 0 and draft >= 0 and other >= 0
    assert rows["ngram n_max=8"]["mean_acceptance_length"] >= 1.0
    assert summary["bound_tps"] == {"target": 20000.0}
    paths = bench.write_outputs(summary, tmp_path)
    assert json.loads(paths[0].read_text())["rows"] == summary["rows"]
    table = paths[1].read_text().splitlines()
    assert len(table) == 2 + len(configs)
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_bandwidth_is_measured() -> None:
    bw = bench.measure_bandwidth(gib=0.05, repeats=2)
    assert 1e8 < bw < 1e13
