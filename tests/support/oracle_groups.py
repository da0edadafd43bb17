"""A pytest plugin (tests/conftest.py loads it; its docstring says how to use the markers):
the external oracles' test groups, one marker each, how many of each group's tests ran, and
SPECD_REQUIRE_ORACLES, which fails a required group's skipped tests, and a required group
of which none ran in a run of the whole suite."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

ORACLE_GROUPS = {
    "llama_cpp_oracle": "runs a llama.cpp binary (bench/build_llama_cpp.sh builds them)",
    "needs_torch": "imports torch (pip install torch)",
    "needs_transformers": "compares with transformers (pip install transformers)",
}
REQUIRE_ENV = "SPECD_REQUIRE_ORACLES"


def required_groups(value: str | None) -> set[str]:
    """The groups SPECD_REQUIRE_ORACLES names: "1" or "all" every group, "" or "0" none,
    else a comma list of group names (UsageError naming an unknown one)."""
    value = (value or "").strip()
    if value in ("", "0"):
        return set()
    if value in ("1", "all"):
        return set(ORACLE_GROUPS)
    names = {n.strip() for n in value.split(",") if n.strip()}
    if unknown := names - set(ORACLE_GROUPS):
        raise pytest.UsageError(f"{REQUIRE_ENV}: unknown group {', '.join(sorted(unknown))} "
                                f"(one of {', '.join(ORACLE_GROUPS)}, or 1 for all)")
    return names


class OracleCount:
    """Per group: tests selected, ran (passed or failed), passed, skipped (with reasons)."""

    def __init__(self, required: set[str]) -> None:
        self.required = required
        self.selected: Counter[str] = Counter()
        self.deselected: Counter[str] = Counter()
        self.ran: Counter[str] = Counter()
        self.passed: Counter[str] = Counter()
        self.skipped: dict[str, list[str]] = {g: [] for g in ORACLE_GROUPS}
        self.whole_suite = False

    def missing_groups(self) -> list[str]:
        """Required groups that should have run and ran none: in a run of the whole suite
        (no paths given, nothing of the group deselected), or with tests selected."""
        return [g for g in sorted(self.required) if self.ran[g] == 0
                and (self.selected[g] or (self.whole_suite and not self.deselected[g]))]


def _groups(item: pytest.Item) -> list[str]:
    return [g for g in ORACLE_GROUPS if item.get_closest_marker(g) is not None]


def pytest_configure(config: pytest.Config) -> None:
    for name, what in ORACLE_GROUPS.items():
        config.addinivalue_line("markers", f"{name}: an external oracle's test: {what}")
    config.stash[_COUNT] = OracleCount(required_groups(os.environ.get(REQUIRE_ENV)))


_COUNT = pytest.StashKey[OracleCount]()


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = config.stash[_COUNT]
    count.whole_suite = config.args_source != pytest.Config.ArgsSource.ARGS
    for item in items:
        count.selected.update(_groups(item))


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        items[0].config.stash[_COUNT].deselected.update(g for i in items for g in _groups(i))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    groups = _groups(item)
    if not groups:
        return
    count = item.config.stash[_COUNT]
    skipped = report.skipped
    if skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
            report.longrepr)
        for g in groups:
            count.skipped[g].append(f"{item.nodeid}: {reason}")
        if strict := [g for g in groups if g in count.required]:
            report.outcome = "failed"
            report.longrepr = (f"{REQUIRE_ENV} requires {', '.join(strict)}, and this test "
                               f"skipped: {reason}")
    if report.when == "call" and not skipped:
        count.ran.update(groups)
        if report.passed:
            count.passed.update(groups)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.stash[_COUNT].missing_groups():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    count = config.stash[_COUNT]
    tr = terminalreporter
    tr.section("external oracles")
    for g in ORACLE_GROUPS:
        need = " (required)" if g in count.required else ""
        tr.write_line(f"{g}{need}: {count.ran[g]} ran ({count.passed[g]} passed), "
                      f"{len(count.skipped[g])} skipped")
    for g in count.missing_groups():
        tr.write_line(f"{REQUIRE_ENV}: no {g} test ran, so the run fails (its tests "
                      f"{ORACLE_GROUPS[g]})", red=True, bold=True)
