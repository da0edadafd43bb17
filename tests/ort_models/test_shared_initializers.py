"""A head's copy of the target's token embeddings, shared with the target's session: found
by its bytes, mapped once, and the head's and target's outputs unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from specd.daemon.drafters.dflash import DFlashDrafter
from specd.daemon.models.building import build_options
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.memory_fit.measure import head_cost
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.head_runner import BuiltHead, HeadRunner, load_or_build_head
from specd.ort_models.heads import read_head
from specd.ort_models.model_cache import BuiltModel, load_or_build
from specd.ort_models.runner import ModelRunner
from specd.ort_models.shared_initializers import (
    external_tensors,
    share_with_target,
    target_copies,
)

from tiny_gguf import write_tiny_gguf
from tiny_heads import write_tiny_head


def _built(tmp_path: Path) -> tuple[BuiltHead, BuiltModel]:
    target = write_tiny_gguf(tmp_path / "target.gguf", arch="qwen3", seed=3)
    head = write_tiny_head(tmp_path / "head.gguf", seed=5)
    built_target = load_or_build(target, build_options(
        "target", head=read_head(GGUFFile(head))))
    return load_or_build_head(head, target), built_target


def _graphs(head: BuiltHead) -> list[tuple[str, Path]]:
    return [(g, head.model_path(g)) for g in head.graphs]


def test_the_embedding_copy_is_found_and_shared_without_changing_outputs(tmp_path: Path):
    head, target = _built(tmp_path)
    shared = share_with_target(_graphs(head), target.model_path)
    assert shared.head_names["block"] == {
        "token_embd.weight.exact.B": "token_embd.weight.B",
        "token_embd.weight.exact.scales": "token_embd.weight.scales"}
    assert all(isinstance(a, np.memmap) for a in shared.arrays.values())  # mapped, not read
    runs = []
    for weights in (None, shared):
        runner = ModelRunner(target, n_ctx=128, initializers=None if weights is None
                             else weights.arrays)
        drafter = DFlashDrafter(HeadRunner(head, n_ctx=128, shared=weights))
        gen = Generation(runner, 0, [5, 17, 42, 100, 7, 3], GenerationParams(
            max_tokens=24, ignore_eos=True, draft=DraftParams(n_max=3), adaptive=False),
            eog=set(), drafter=drafter)
        tokens = gen.prefill()
        while not gen.done:
            tokens += gen.step()
        runs.append((tokens, gen.stats.drafted, gen.stats.accepted))
    assert runs[0] == runs[1]
    # the plan counts the head without the table it shares
    full, less = head_cost(head), head_cost(head, target.model_path)
    shared_bytes = sum(external_tensors(head.model_path("block"))[n].length
                       for n in shared.head_names["block"])
    assert full.weights_bytes - less.weights_bytes == shared_bytes > 0


def test_a_copy_whose_bytes_differ_is_not_shared(tmp_path: Path):
    head, target = _built(tmp_path)
    folder = tmp_path / "changed"
    shutil.copytree(target.folder, folder)
    tensor = external_tensors(folder / target.model_path.name)["token_embd.weight.scales"]
    data = np.memmap(tensor.path, np.uint8, "r+", tensor.offset, tensor.length)
    data[0] ^= 1
    data.flush()
    copies = target_copies(_graphs(head), folder / target.model_path.name)
    assert [(c.graph, c.name, c.target_name) for c in copies] == [
        ("block", "token_embd.weight.exact.B", "token_embd.weight.B")]
