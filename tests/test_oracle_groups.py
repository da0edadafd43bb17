"""The external oracles' plugin (tests/support/oracle_groups.py) in a pytest of its own on
small test files: each group's count in the summary, and SPECD_REQUIRE_ORACLES failing a
required group's skipped test and a required group of which no test ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"

TESTS = '''
import pytest

@pytest.mark.llama_cpp_oracle
def test_runs():
    pass

@pytest.mark.llama_cpp_oracle
def test_skips():
    pytest.skip("llama-server is not built")

@pytest.mark.needs_torch
@pytest.mark.llama_cpp_oracle
def test_both():
    pass

def test_plain():
    pass
'''


def _pytest(folder: Path, *args: str, require: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SPECD_REQUIRE_ORACLES"}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), env.get("PYTHONPATH", "")])
    if require is not None:
        env["SPECD_REQUIRE_ORACLES"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "oracle_groups", "-p",
                           "no:cacheprovider", "-rs", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "test_groups.py").write_text(TESTS)
    return tmp_path


def test_the_summary_counts_each_group(folder: Path) -> None:
    r = _pytest(folder)
    assert r.returncode == 0, r.stdout
    assert "llama_cpp_oracle: 2 ran (2 passed), 1 skipped" in r.stdout
    assert "needs_torch: 1 ran (1 passed), 0 skipped" in r.stdout
    assert "needs_transformers: 0 ran (0 passed), 0 skipped" in r.stdout


def test_a_required_groups_skip_fails(folder: Path) -> None:
    r = _pytest(folder, require="llama_cpp_oracle")
    assert r.returncode == 1, r.stdout
    assert "llama_cpp_oracle (required): 2 ran (2 passed), 1 skipped" in r.stdout
    assert ("SPECD_REQUIRE_ORACLES requires llama_cpp_oracle, and this test skipped: "
            "Skipped: llama-server is not built") in r.stdout
    assert "1 failed, 3 passed" in r.stdout


def test_a_required_group_that_ran_none_fails_the_whole_suite(folder: Path) -> None:
    r = _pytest(folder, require="1")  # no needs_transformers test at all
    assert r.returncode == 1, r.stdout
    assert "SPECD_REQUIRE_ORACLES: no needs_transformers test ran, so the run fails" in r.stdout
    # naming tests picks a part of the suite: a group with none selected is not missing
    r = _pytest(folder, "test_groups.py::test_plain", require="needs_transformers")
    assert r.returncode == 0, r.stdout
    # but one whose selected tests all skipped is
    r = _pytest(folder, "test_groups.py::test_skips", require="llama_cpp_oracle")
    assert r.returncode == 1 and "no llama_cpp_oracle test ran" in r.stdout, r.stdout


def test_deselecting_a_group_is_not_missing_it(folder: Path) -> None:
    r = _pytest(folder, "-k", "plain", require="needs_torch")
    assert r.returncode == 0, r.stdout


def test_an_unknown_group_is_a_usage_error(folder: Path) -> None:
    r = _pytest(folder, require="llama_cpp_oracle,torch")
    assert r.returncode == 4
    assert "SPECD_REQUIRE_ORACLES: unknown group torch" in r.stderr
