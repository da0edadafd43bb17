"""A model the engine serves: its file and built graph, always there, and its runner
(the ONNX Runtime session and KV cache), there only while the model is loaded.

The engine opens the runner from the built graph and drops it to unload the model; what
a runner needed to open the first time (its row shapes, measured then) is kept, so that
every reopening runs the same configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.model_cache import BuiltModel
from specd.ort_models.runner import ModelRunner


class ModelUnloaded(RuntimeError):
    """A model's runner was asked for while the model is unloaded."""


@dataclass
class LoadedModel:
    path: Path
    gguf: GGUFFile
    built: BuiltModel
    # a verified row must equal a single step bit for bit (the target); a draft's need not
    exact: bool = True
    n_seq: int = 1
    # RSS growth while its session (weights, KV buffers) was first created; the target's
    # also counts the tokenizer
    resident_bytes: int = 0
    n_ctx: int = 0  # the runner's context per sequence (known while unloaded too)
    # the runner's rows for a short call, measured at its first opening (None: not yet)
    min_rows: int | None = None
    session: ModelRunner | None = None  # None while unloaded

    @property
    def name(self) -> str:
        return self.gguf.name

    @property
    def runner(self) -> ModelRunner:
        if self.session is None:
            raise ModelUnloaded(f"{self.path.name} is not loaded")
        return self.session

    def opened(self, runner: ModelRunner) -> ModelRunner:
        """Take `runner` as the model's session, remembering its settings for reopening."""
        self.session, self.n_ctx, self.min_rows = runner, runner.n_ctx, runner.min_rows
        return runner
