"""Shared pytest fixtures, and the plugin that counts the external oracles' tests.

External oracles: tests that check specd against something outside the project, which a
machine may lack, skip saying why where it is missing. Each such test carries its group's
marker, so that a run can say how many of them ran and fail where they did not:

    @pytest.mark.llama_cpp_oracle   # runs a llama.cpp binary (tests/support/llama_cpp_oracle.py)
    @pytest.mark.needs_torch        # imports torch (specd train-draft's tests)
    @pytest.mark.needs_transformers # compares with Hugging Face transformers

(on a test, a class, or a whole module as `pytestmark = pytest.mark.llama_cpp_oracle`; a
test may carry several). The test still skips by itself where its oracle is missing (for
llama.cpp: `if reason := llama_cpp_oracle.missing("llama-server"): pytest.skip(reason)`).

Every run ends with a line per group: how many of its tests ran, passed and skipped.
SPECD_REQUIRE_ORACLES=1 (or a comma list of group names) makes the groups required, as
.ci/run and `installers/quickstart.py test` set it: a skipped test of a required group
fails, and so does a required group of which no test ran in a run of the whole suite (a
module that skips at import, as test_training.py does without torch, collects no test).
The plugin: tests/support/oracle_groups.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiny_gguf import write_tiny_gguf

pytest_plugins = ["oracle_groups"]

# The suite checks the CPU path, also where a GPU is (ORT's CUDA kernels multiply in TF32
# and pick algorithms by shape; the reference tolerances and batch-invariance tests here
# are the CPU's). tests/ort_models/test_cuda.py asks for CUDA explicitly.
os.environ["SPECD_DEVICE"] = "cpu"
# A drafter's exception fails its request (the daemon logs it, counts it and goes on
# target-only, which a test comparing output with target-only cannot notice).
# tests/daemon/spec/test_drafter_failures.py turns it off to test the daemon's way.
os.environ["SPECD_RAISE_DRAFTER_ERRORS"] = "1"


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(**write_tiny_gguf_kwargs) -> Path`, one file per distinct kwargs per session.

    The files are shared between tests: open them read-only, never modify them.
    """
    root = tmp_path_factory.mktemp("tiny_gguf")
    cache: dict[str, Path] = {}

    def make(**kwargs: Any) -> Path:
        key = json.dumps(kwargs, sort_keys=True, default=repr)
        path = cache.get(key)
        if path is None:
            name = hashlib.sha256(key.encode()).hexdigest()[:16]
            path = write_tiny_gguf(root / f"tiny-{name}.gguf", **kwargs)
            cache[key] = path
        return path

    return make


@pytest.fixture(scope="session")
def tiny_tok(tiny_model_factory: Callable[..., Path]) -> Any:
    """The tiny qwen2 model's tokenizer (byte tokens: any text can be spelled)."""
    from specd.daemon.text.tokenizer import Tokenizer
    from specd.ort_models.gguf_file import GGUFFile

    return Tokenizer.from_metadata(GGUFFile(tiny_model_factory(arch="qwen2")).metadata)


def fetched_model(name: str) -> Path:
    """The catalog model `name` from the store, downloaded (sha256 checked, cached in the
    platformdirs data dir) if it is not there yet; skips the test only where it cannot be
    had (offline). Tests that need a real model call this rather than skipping when it
    happens not to be downloaded yet: the suite must test them on a fresh machine too."""
    from specd.daemon.models.store import ModelStoreError, model_path, resolve_model

    if model_path(name).is_file():
        return model_path(name)
    try:
        return resolve_model(name)
    except ModelStoreError as exc:
        pytest.skip(f"{name} could not be downloaded: {exc}")

