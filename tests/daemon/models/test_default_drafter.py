"""The drafter a catalog target gets when none is named: the measured fastest."""

from __future__ import annotations

import argparse
import json

import pytest

from specd.daemon.cli.options import settle_draft
from specd.daemon.models import default_drafter as dd
from specd.daemon.models.catalog import CATALOG, CatalogEntry
from specd.daemon.models.default_drafter import choice_table, default_drafter

TARGET, DRAFT, HEAD = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                       "qwen2.5-coder-1.5b-dflash")


@pytest.fixture(autouse=True)
def head_in_catalog(monkeypatch):
    """The head as a catalog entry, whatever the catalog ships (only its name counts)."""
    monkeypatch.setitem(CATALOG, HEAD, CatalogEntry(
        name=HEAD, description="a head", arch="dflash", wheels=(), size=1, sha256="0",
        license="none", packaged="head.gguf", head_for=TARGET))


def table(draft: dict[str, float], head: dict[str, float]) -> dict:
    return {TARGET: {"measured": "a test run", "workloads": ["code T 0", "prose T 0"],
                     "speedup": {DRAFT: draft, HEAD: head}}}


def test_the_fastest_by_geometric_mean_is_chosen_and_the_reason_gives_both():
    # the head wins one workload by more, the draft both by a steadier margin
    t = table({"code T 0": 1.4, "prose T 0": 1.1}, {"code T 0": 1.7, "prose T 0": 0.8})
    choice = default_drafter(TARGET, t)
    assert choice is not None and choice.draft == DRAFT
    assert f"{DRAFT} 1.24×" in choice.reason and f"{HEAD} 1.17×" in choice.reason
    assert "a test run" in choice.reason and "-md none" in choice.reason
    assert choice.fallbacks == (HEAD,)  # also faster than the target alone


def test_no_drafter_where_none_beats_the_target_alone():
    t = table({"code T 0": 0.9, "prose T 0": 1.0}, {"code T 0": 0.95, "prose T 0": 0.99})
    choice = default_drafter(TARGET, t)
    assert choice is not None and choice.draft is None
    assert "no speculation" in choice.reason


def test_unmeasured_targets_and_uncatalogued_drafters_choose_nothing():
    t = table({"code T 0": 1.4, "prose T 0": 1.1}, {"code T 0": 1.7, "prose T 0": 0.8})
    assert default_drafter("smollm2-135m-instruct", t) is None
    t[TARGET]["speedup"] = {"some-file.gguf": {"code T 0": 2.0}}
    assert default_drafter(TARGET, t) is None
    assert default_drafter(TARGET, {}) is None


def test_the_table_is_read_from_a_file(tmp_path):
    t = table({"code T 0": 1.4, "prose T 0": 1.1}, {"code T 0": 1.7, "prose T 0": 0.8})
    path = tmp_path / "speculation.json"
    path.write_text(json.dumps(t))
    assert choice_table(path) == t
    assert choice_table(tmp_path / "none.json") == {}


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"model": TARGET, "draft": None, "spec_type": "auto", **kw})


def test_settle_draft(monkeypatch, capsys):
    t = table({"code T 0": 1.4, "prose T 0": 1.1}, {"code T 0": 1.7, "prose T 0": 0.8})
    monkeypatch.setattr(dd, "choice_table", lambda path=None: t)
    a = args()
    settle_draft(a)
    assert a.draft == DRAFT and a.draft_fallbacks == (HEAD,)
    assert "the fastest measured" in capsys.readouterr().err
    for given, want in (({"draft": "none"}, None), ({"draft": "x.gguf"}, "x.gguf"),
                        ({"spec_type": "ngram"}, None), ({"model": "tiny.gguf"}, None)):
        a = args(**given)
        settle_draft(a)
        assert a.draft == want, given
    assert capsys.readouterr().err == ""


def test_a_head_and_a_draft_model_together_are_chosen_as_two_draft_files(monkeypatch,
                                                                          capsys):
    """A measured `head+draft` row names both files; settle_draft gives them to -md."""
    pair = f"{HEAD}+{DRAFT}"
    t = table({"code T 0": 1.4, "prose T 0": 1.1}, {"code T 0": 1.2, "prose T 0": 1.25})
    t[TARGET]["speedup"][pair] = {"code T 0": 1.45, "prose T 0": 1.35}
    choice = default_drafter(TARGET, t)
    assert choice is not None and choice.draft == pair
    assert choice.fallbacks == (DRAFT, HEAD)
    t[TARGET]["speedup"][f"{HEAD}+some-file.gguf"] = {"code T 0": 9.0, "prose T 0": 9.0}
    assert default_drafter(TARGET, t).draft == pair  # type: ignore[union-attr]
    monkeypatch.setattr(dd, "choice_table", lambda path=None: t)
    a = args()
    settle_draft(a)
    assert (a.draft, a.also_draft, a.draft_fallbacks) == (HEAD, DRAFT, (DRAFT, HEAD))
    assert pair in capsys.readouterr().err


def test_settle_draft_takes_md_twice_and_no_more():
    a = args(draft=["h.gguf", "m.gguf"])
    settle_draft(a)
    assert (a.draft, a.also_draft) == ("h.gguf", "m.gguf")
    with pytest.raises(ValueError, match="at most two draft files"):
        settle_draft(args(draft=["a", "b", "c"]))
    with pytest.raises(ValueError, match="-md none runs without a draft"):
        settle_draft(args(draft=["none", "m.gguf"]))
