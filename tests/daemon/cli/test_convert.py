"""`specd convert-draft` as a user runs it: exit codes, one-line errors, the target as a
path or a catalog name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specd.daemon.cli.main import main
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import read_head

import tiny_hf_heads as hf


@pytest.fixture
def target(tiny_model_factory) -> Path:
    return tiny_model_factory(arch="qwen3")


def test_convert_draft_writes_a_head(tmp_path: Path, target: Path) -> None:
    out = tmp_path / "head.gguf"
    r = subprocess.run([sys.executable, "-m", "specd.daemon.cli", "convert-draft",
                        str(hf.dspark(tmp_path)), "--target", str(target), "-o", str(out),
                        "--outtype", "q8_0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"wrote {out}: dspark head, 2 layer(s), width 64, target layers "
                        "[1, 2], draft vocabulary 100\n")
    head = read_head(GGUFFile(out))
    assert head.kind == "dspark" and GGUFFile(out).tensor("fc.weight").type_name == "Q8_0"


def test_errors_are_one_line(tmp_path: Path, target: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    ck = hf.eagle3(tmp_path)
    config = json.loads((ck / "config.json").read_text())
    config["architectures"] = ["SomethingElse"]
    (ck / "config.json").write_text(json.dumps(config))
    out = tmp_path / "head.gguf"
    assert main(["convert-draft", str(ck), "--target", str(target), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"specd: error: {ck}: architecture 'SomethingElse' is not a "
                          "drafter head this converts")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_target_by_catalog_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A name that is no file is looked up in the catalog and the store, as -m is."""
    monkeypatch.setenv("SPECD_DATA_DIR", str(tmp_path / "data"))
    ck = hf.dflash(tmp_path)
    args = ["convert-draft", str(ck), "-o", str(tmp_path / "h.gguf"), "--no-fetch"]
    assert main([*args, "--target", "qwen2.5-coder-0.5b-instruct"]) == 1
    assert ("model 'qwen2.5-coder-0.5b-instruct' is not in the store; run `specd models "
            "pull qwen2.5-coder-0.5b-instruct`") in capsys.readouterr().err
    assert main([*args, "--target", "no-such-model"]) == 1
    assert "'no-such-model' is neither an existing file nor a catalog model" in (
        capsys.readouterr().err)


def test_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["convert-draft", str(tmp_path), "-o", str(tmp_path / "h.gguf")])
    assert info.value.code == 2  # no --target
    with pytest.raises(SystemExit) as info:
        main(["convert-draft", str(tmp_path), "--target", "t", "-o", "h", "--outtype", "q4_0"])
    assert info.value.code == 2
