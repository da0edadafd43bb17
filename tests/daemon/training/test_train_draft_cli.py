"""`specd train-draft` as a user runs it: the kinds it does not know, the message where torch is
missing, and a whole (very short) run on a tiny target."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from specd.daemon.cli.main import main
from specd.daemon.training import INSTALL_HINT, TrainError, require_torch
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import read_head


@pytest.mark.parametrize("kind", ["medusa", "mtp"])
def test_other_kinds_are_refused(kind: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train-draft", "--kind", kind, "-o", str(tmp_path / "h.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"specd: error: --kind {kind}: ") and err.count("\n") == 1
    assert "unknown head kind (one of dflash, dspark, eagle3)" in err


def test_missing_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(TrainError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        require_torch()


@pytest.mark.needs_torch
def test_a_short_run_writes_a_head(tmp_path: Path, tiny_model_factory: Callable[..., Path],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    try:
        require_torch()
    except TrainError as exc:
        pytest.skip(str(exc))
    target = tiny_model_factory(arch="qwen3")
    out = tmp_path / "head.gguf"
    args = ["train-draft", "-m", str(target), "-o", str(out), "--samples", "6",
            "--eval-samples", "2", "--max-reply", "12", "--max-prompt", "384", "--layers",
            "1", "--block", "4", "--steps", "3", "-t", "1", "--train-device", "cpu",
            "--draft-vocab", "100", "--outtype", "q8_0"]
    assert main(args) == 0, capsys.readouterr().err
    head = read_head(GGUFFile(out))
    assert (head.kind, head.n_layer, head.block_size, head.draft_vocab) == ("dflash", 1, 4, 100)
    assert GGUFFile(out).tensor("fc.weight").type_name == "Q8_0"
    assert (tmp_path / "head.gguf.work" / "export" / "README.md").is_file()
    assert main(args) == 1  # the work folder holds that run
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0  # nothing left to do but the export
