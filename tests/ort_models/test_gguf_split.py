"""Split GGUF models (`*-00001-of-0000N.gguf`): a model split by llama.cpp's own
llama-gguf-split (skipped where it is not built) loads in specd from its first part and
gives the single file's logits, `models info` and memory plan; damaged parts, written
here part by part, each give one GGUFError naming the file at fault."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from specd.daemon.cli.main import model_info
from specd.daemon.models.building import build_options, fit_models
from specd.memory_fit.probes import FakeProbe
from specd.ort_models.gguf_file import GGUFError, GGUFFile, content_hash
from specd.ort_models.gguf_split import split_path
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

import llama_cpp_oracle

SPLIT_TOOL = "llama-gguf-split"
PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]
# big enough for --split-max-size's smallest unit (1 MB) to cut it in several parts,
# every tensor below it
MB_MODEL: dict[str, Any] = {"arch": "qwen2", "weight_type": "F16", "n_layer": 4,
                            "n_embd": 256, "n_ff": 768, "seed": 3}
SMALL_MODEL: dict[str, Any] = {"arch": "qwen2", "weight_type": "Q8_0", "seed": 4}


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))  # graphs, hashes


def split_by_llama_cpp(src: Path, out: Path, *args: str) -> Path:
    """`src` split by llama-gguf-split with `args` into `out` (at least two parts); the
    first part's path. Skips where llama-gguf-split is not built."""
    if reason := llama_cpp_oracle.missing(SPLIT_TOOL):
        pytest.skip(reason)
    first = llama_cpp_oracle.split_gguf(src, out, *args)
    assert not first.name.endswith("-00001-of-00001.gguf"), "llama-gguf-split wrote one file"
    return first


def write_parts(src: Path, prefix: Path, groups: Sequence[Sequence[str]], *,
                keys: Callable[[int], dict[str, int | None]] | None = None,
                donor: Path | None = None, donor_part: int = -1) -> list[Path]:
    """`src`'s tensors written as a split model by gguf's writer, one file a group of
    tensor names, laid out as llama-gguf-split lays them out: all metadata in the first
    part, the split keys in every part. `keys(i)` changes part i's split keys (None:
    leaves the key out); part `donor_part` takes its tensors from `donor` (another model
    with the same tensor names) instead."""
    f = GGUFFile(src)
    paths = []
    n_tensors = sum(len(g) for g in groups)
    for i, names in enumerate(groups):
        path = split_path(str(prefix), i, len(groups))
        w = GGUFWriter(str(path), f.arch)
        if i == 0:
            for key, value in f.metadata.items():
                vtype, etype = f.value_types[key]
                if key != "general.architecture":
                    w.add_key_value(key, value, GGUFValueType(vtype),
                                    None if etype is None else GGUFValueType(etype))
        else:  # the parts after the first hold only the split keys
            w.kv_data[0].pop("general.architecture")
        split: dict[str, int | None] = {"split.no": i, "split.count": len(groups),
                                        "split.tensors.count": n_tensors}
        for key, value in (split | (keys(i) if keys else {})).items():
            if value is None:
                continue
            w.add_key_value(key, value, GGUFValueType.INT32 if key == "split.tensors.count"
                            else GGUFValueType.UINT16)
        holder = GGUFFile(donor) if donor is not None and i == donor_part % len(groups) else f
        for name in names:
            t = holder.tensors[name]
            raw = np.asarray(t.data)
            w.add_tensor(name, raw.reshape(*t.shape[:-1], -1),
                         raw_dtype=GGMLQuantizationType[t.type_name])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def thirds(path: Path) -> list[list[str]]:
    """The model's tensor names, in order, in three groups."""
    names = list(GGUFFile(path).tensors)
    k = len(names) // 3
    return [names[:k], names[k:2 * k], names[2 * k:]]


def logits(path: Path) -> np.ndarray:
    """specd's logits [len(PROMPT), vocab] along PROMPT (the default target graph)."""
    r = ModelRunner(load_or_build(path, build_options("target")), n_ctx=256)
    return r.forward(0, PROMPT, 0, list(range(len(PROMPT))))


# ----------------------------------------------------------------------- llama.cpp's splits

@pytest.mark.llama_cpp_oracle
@pytest.mark.parametrize("model, args", [
    (SMALL_MODEL, ["--split-max-tensors", "7"]),
    (MB_MODEL, ["--split-max-size", "1M"]),
], ids=["max-tensors", "max-size"])
@pytest.mark.usefixtures("own_cache")
def test_llama_cpp_split_gives_the_single_files_logits(
        tiny_model_factory: Callable[..., Path], tmp_path: Path, model: dict[str, Any],
        args: list[str]) -> None:
    single = tiny_model_factory(**model)
    first = split_by_llama_cpp(single, tmp_path / "split", *args)
    f, whole = GGUFFile(first), GGUFFile(single)
    assert len(f.parts) > 2 and f.metadata["split.count"] == len(f.parts)
    assert list(f.tensors) == list(whole.tensors)
    assert all(np.array_equal(f.tensors[n].data, t.data) for n, t in whole.tensors.items())
    assert f.file_bytes == sum(p.stat().st_size for p in first.parent.glob("model-*.gguf"))
    assert content_hash(first) == f.content_hash() != content_hash(single)
    want = logits(single)
    got = logits(first)  # [len(PROMPT), vocab]
    assert np.array_equal(got, want)
    built = load_or_build(first, build_options("target"))
    assert built.gguf_sha256 == f.content_hash()  # its graphs keyed by all parts' bytes


@pytest.mark.llama_cpp_oracle
@pytest.mark.usefixtures("own_cache")
def test_split_models_info_and_memory_fit_equal_the_single_files(
        tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """`models info` reads the split model whole (files and bytes: all parts); memory fit
    builds the same graph from it (byte for byte) and plans the same context and KV."""
    single = tiny_model_factory(**SMALL_MODEL, context_length=1024)
    first = split_by_llama_cpp(single, tmp_path / "split", "--split-max-tensors", "10")
    parts = sorted(first.parent.glob("model-*.gguf"))
    info, want = model_info(first), model_info(single)
    assert info["files"] == [str(p) for p in parts]
    assert info["file_bytes"] == sum(p.stat().st_size for p in parts)
    ignored = ("path", "files", "file_bytes")
    assert {k: v for k, v in info.items() if k not in ignored} == {
        k: v for k, v in want.items() if k not in ignored}
    r = subprocess.run([sys.executable, "-m", "specd.daemon.cli", "models", "info",
                        str(first), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(json.dumps(info))

    probe = FakeProbe(total=64 << 30, free=64 << 30)
    plans = [fit_models(str(p), device="cpu", threads=1, max_ctx=1024, margin_bytes=0,
                        probe=probe) for p in (single, first)]
    (plan_single, costs_single), (plan_split, costs_split) = plans
    for a, b in zip(plan_single.rows, plan_split.rows, strict=True):
        assert (a.role, a.kv_bytes_per_token, a.kv_bytes) == (b.role, b.kv_bytes_per_token,
                                                             b.kv_bytes)
    assert (plan_split.n_ctx, plan_split.slots) == (plan_single.n_ctx, plan_single.slots)
    assert costs_split[0].n_ctx_train == costs_single[0].n_ctx_train == 1024
    graphs = [load_or_build(p, build_options("target")) for p in (single, first)]
    for name in ("model.onnx", "weights.bin"):  # what the plan measured: the same session
        assert (graphs[0].folder / name).read_bytes() == (graphs[1].folder / name).read_bytes()


@pytest.mark.llama_cpp_oracle
@pytest.mark.usefixtures("own_cache")
def test_a_later_part_is_refused_naming_the_first(tiny_model_factory: Callable[..., Path],
                                                  tmp_path: Path) -> None:
    """As llama.cpp: a model is opened by its first part, which names the others."""
    first = split_by_llama_cpp(tiny_model_factory(**SMALL_MODEL), tmp_path / "split",
                               "--split-max-tensors", "10")
    second = first.with_name(first.name.replace("-00001-", "-00002-"))
    with pytest.raises(GGUFError, match=f"{second}: this is part 2 of a split model of 3 "
                       f"parts; pass its first part, {first},"):
        GGUFFile(second)
    r = subprocess.run([sys.executable, "-m", "specd.daemon.cli", "models", "info",
                        str(second)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and f"pass its first part, {first}" in r.stderr


# ------------------------------------------------------------------------- damaged parts

@pytest.mark.usefixtures("own_cache")
def test_parts_written_here_load_as_the_single_file(tiny_model_factory: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    """The writer the damaged cases below start from gives a good split when undamaged."""
    single = tiny_model_factory(**SMALL_MODEL)
    first = write_parts(single, tmp_path / "m", thirds(single))[0]
    assert len(GGUFFile(first).parts) == 3
    assert np.array_equal(logits(first), logits(single))


def _damaged(case: str, single: Path, other_shape: Path, other_layers: Path, tmp_path: Path
             ) -> tuple[Path, str]:
    """A split model of `single` damaged as `case` says, and the start of the error it
    must give (`other_shape`: a model with the same tensor names, other shapes;
    `other_layers`: one with more layers)."""
    groups = thirds(single)
    prefix = tmp_path / "m"
    name = [split_path(str(prefix), i, 3) for i in range(3)]
    if case == "missing part":
        write_parts(single, prefix, groups)[2].unlink()
        return name[0], f"{name[0]}: part 3 of this split model of 3 parts is missing: " \
                        f"no file {name[2]}"
    if case == "wrong split.no":
        write_parts(single, prefix, groups, keys=lambda i: {"split.no": 2} if i == 1 else {})
        return name[0], f"{name[1]}: split.no is 2, but its name makes it part 2 (split.no 1)"
    if case == "wrong split.count":
        write_parts(single, prefix, groups, keys=lambda i: {"split.count": 4} if i == 2
                    else {})
        return name[0], f"{name[2]}: split.count is 4, but the first part " \
                        "(m-00001-of-00003.gguf) says 3: the parts are not of one split model"
    if case == "no split.no":
        write_parts(single, prefix, groups, keys=lambda i: {"split.no": None} if i == 1
                    else {})
        return name[0], f"{name[1]}: no split.no key: not a part of a split model"
    if case == "part of another model":  # the second part of a split of a 3-layer model
        bigger = write_parts(other_layers, tmp_path / "other", thirds(other_layers))
        write_parts(single, prefix, groups)
        name[1].write_bytes(bigger[1].read_bytes())
        n = len(GGUFFile(other_layers).tensors)
        return name[0], f"{name[1]}: split.tensors.count is {n}, but the first part " \
                        f"(m-00001-of-00003.gguf) says {sum(map(len, groups))}: the parts " \
                        "are not of one split model"
    if case == "part of another shape":  # the same names and counts, other shapes
        write_parts(single, prefix, groups, donor=other_shape, donor_part=1)
        return name[0], f"{name[1]}: tensor "
    if case == "duplicated tensor":
        write_parts(single, prefix, [groups[0], groups[1] + groups[2][:1], groups[2]])
        return name[0], f"{name[2]}: tensor {groups[2][0]!r} is also in {name[1]}: the " \
                        "parts are not of one split model"
    if case == "missing tensor":
        n = sum(map(len, groups))
        write_parts(single, prefix, [groups[0], groups[1], groups[2][:-1]],
                    keys=lambda i: {"split.tensors.count": n})
        return name[0], f"{name[0]}: split.tensors.count is {n}, but the 3 parts hold " \
                        f"{n - 1} tensors"
    if case == "misnamed first part":
        paths = write_parts(single, prefix, groups)
        renamed = paths[0].with_name("model.gguf")
        paths[0].rename(renamed)
        return renamed, f"{renamed}: the first part of a split model of 3 parts must be " \
                        "named <name>-00001-of-00003.gguf"
    raise AssertionError(case)


DAMAGE = ["missing part", "wrong split.no", "wrong split.count", "no split.no",
          "part of another model", "part of another shape", "duplicated tensor",
          "missing tensor", "misnamed first part"]


@pytest.mark.parametrize("case", DAMAGE)
@pytest.mark.usefixtures("own_cache")
def test_a_damaged_split_is_refused_naming_the_file(tiny_model_factory: Callable[..., Path],
                                                    tmp_path: Path, case: str) -> None:
    single = tiny_model_factory(**SMALL_MODEL)
    other_shape = tiny_model_factory(**{**SMALL_MODEL, "n_ff": 160, "seed": 9})
    other_layers = tiny_model_factory(**{**SMALL_MODEL, "n_layer": 3})
    first, message = _damaged(case, single, other_shape, other_layers, tmp_path)
    with pytest.raises(GGUFError) as err:
        load_or_build(first, build_options("target"))
    assert str(err.value).startswith(message), str(err.value)
    assert not (tmp_path / "cache" / "graphs").exists() or not any(
        (tmp_path / "cache" / "graphs").iterdir())  # refused before anything was built


# ------------------------------------------------------------------------- a real model

@pytest.mark.llama_cpp_oracle
@pytest.mark.slow
def test_a_split_copy_of_the_1_5b_target_decodes_as_the_single_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Qwen2.5-Coder 1.5B target split by llama-gguf-split in parts of at most 300 MB
    decodes a chat prompt greedily to the single file's 32 tokens (the engine's own
    target graph, loaded from the first part)."""
    from conftest import fetched_model

    from specd.daemon.serving.engine import Engine, EngineConfig
    from specd.daemon.spec.generation import Generation, GenerationParams

    from speculation_checks import decode_all

    if reason := llama_cpp_oracle.missing(SPLIT_TOOL):
        pytest.skip(reason)
    single = fetched_model("qwen2.5-coder-1.5b-instruct")
    first = split_by_llama_cpp(single, tmp_path / "split", "--split-max-size", "300M")

    def greedy(path: Path) -> list[int]:
        engine = Engine(EngineConfig(target=str(path), n_ctx=1024))
        prompt = engine.encode_prompt("Write a Python function that reverses a list.",
                                      chat=True)
        gen = Generation(engine.target.runner, 0, prompt,
                         GenerationParams(max_tokens=32, ignore_eos=True), eog=engine.eog_ids)
        return decode_all(gen)

    want = greedy(single)  # its graphs where the other slow tests keep them
    assert len(GGUFFile(first).parts) >= 4
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))  # the copy's: removed
    try:
        assert greedy(first) == want
    finally:
        shutil.rmtree(tmp_path)  # gigabytes: a split copy and its built graphs
