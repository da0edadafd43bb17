"""The state one build threads through every module: writer, model, options, loaded weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specd.ort_models.arch import HParams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.onnx_writer import GraphWriter
from specd.ort_models.quant import dense_float32

from .options import BuildOptions, Progress

if TYPE_CHECKING:
    from .weights import Weight


@dataclass
class BuildContext:
    g: GraphWriter
    hp: HParams
    f: GGUFFile
    options: BuildOptions
    progress: Progress | None
    done: int = 0
    total: int = 0
    # matrices loaded for the current layer (and stacked ones made from them), by name;
    # cleared after each layer so only one layer's weights are held at a time
    shared: dict[str, Weight] = field(default_factory=dict)
    # each mixture-of-experts layer's router ids [S, top_k], in layer order: the graph
    # outputs them (EXPERT_IDS) so a pass can report the experts its rows woke
    expert_ids: list[str] = field(default_factory=list)

    def tick(self, label: str) -> None:
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total, label)

    def vector(self, name: str) -> str:
        """The GGUF vector `name` (a norm's weight) as a float32 initializer [n]."""
        return self.g.weight(name, dense_float32(self.f.tensor(name)).reshape(-1))
