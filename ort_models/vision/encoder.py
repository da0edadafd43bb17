"""Vision encoders on ONNX Runtime: `load_vision_encoder(mmproj)` is the one entry point.

The mmproj is read and checked (`mmproj.py`), its family found by projector type
(`registry.py`), its graph built once into the graph cache (a folder per file hash and
`VISION_BUILDER_VERSION`, completed and locked as `model_cache` does for decoders) and
opened as an InferenceSession. `prepare` decodes and preprocesses an upload; `encode`
runs the tower and projector: one row per image token, in the text model's width.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.model_cache import (
    META_FILE,
    MODEL_FILE,
    WEIGHTS_FILE,
    build_folder,
    is_complete,
)
from specd.ort_models.onnx_writer import GraphWriter
from specd.ort_models.paths import cache_dir, exclusive_lock
from specd.ort_models.tensor_checks import check_values

from .family import EMBEDDINGS, PIXELS, PreparedImage, VisionFamily
from .image_input import decode_image
from .mmproj import VisionHParams, check_tensors, open_mmproj
from .registry import family_of
from .vit_graph import GELU_TANH_OPSET, VisionGraph

# names the bytes a vision build writes (part of the cached folder's name)
VISION_BUILDER_VERSION = "1"

__all__ = ["META_FILE", "VisionEncoder", "OrtVisionEncoder", "load_vision_encoder"]


class VisionEncoder(Protocol):
    """Images in, embeddings for the text model out."""

    n_embd: int  # the text model's embedding width

    def prepare(self, data: bytes) -> PreparedImage:
        """Decode and preprocess an image file's bytes; ImageError on bad input."""
        ...

    def encode(self, image: PreparedImage) -> np.ndarray:
        """[n_tokens, n_embd] float32 embeddings of a prepared image."""
        ...


class OrtVisionEncoder:
    """A family's encoder graph in an ONNX Runtime session."""

    def __init__(self, family: VisionFamily, hp: VisionHParams, model_path: Path,
                 providers: Sequence[Any]):
        import onnxruntime as ort

        self.family, self.hp, self.model_path = family, hp, model_path
        self.n_embd = hp.projection_dim
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(model_path), so, providers=list(providers))

    @property
    def projector(self) -> str:
        return self.family.projector

    def prepare(self, data: bytes) -> PreparedImage:
        return self.family.prepare(decode_image(data), self.hp)

    def encode(self, image: PreparedImage) -> np.ndarray:
        feeds = {PIXELS: np.ascontiguousarray(image.pixels, np.float32),
                 **self.family.feeds(image, self.hp)}
        out = self.session.run([EMBEDDINGS], feeds)[0]  # [n_tokens, n_embd]
        if out.shape != (image.n_tokens, self.n_embd):  # the family's own contract
            raise RuntimeError(f"the {self.projector} encoder returned {out.shape}, expected "
                               f"({image.n_tokens}, {self.n_embd})")
        return np.asarray(out, np.float32)


def read_checked(path: str | os.PathLike[str]) -> tuple[GGUFFile, VisionFamily, VisionHParams]:
    """The mmproj at `path`, its family and hyper-parameters, every tensor the graph
    reads checked (GGUFError naming the first problem)."""
    f = open_mmproj(path)
    family = family_of(f)
    hp = family.read_hparams(f)
    check_tensors(f, family.tensor_shapes(hp))
    return f, family, hp


def vision_graph_folder(sha256: str) -> Path:
    return cache_dir() / "graphs" / f"{sha256[:24]}-vision{VISION_BUILDER_VERSION}"


def build_vision_graph(f: GGUFFile, family: VisionFamily, hp: VisionHParams) -> Path:
    """The encoder's graph folder for `f`, built unless complete in the cache."""
    folder = vision_graph_folder(f.content_hash())
    if is_complete(folder):
        return folder
    check_values(f)  # a pass over the weights: only where they are built
    with exclusive_lock(folder.with_name(f"{folder.name}.lock")):
        if not is_complete(folder):
            def write(tmp: Path) -> list[str]:
                with open(tmp / WEIGHTS_FILE, "wb") as wf:
                    g = GraphWriter(wf, WEIGHTS_FILE)
                    family.build(VisionGraph(g, f, hp))
                g.save(tmp / MODEL_FILE, opset=max(GELU_TANH_OPSET, 24))
                return [MODEL_FILE, WEIGHTS_FILE]

            build_folder(folder, write, {"vision_builder_version": VISION_BUILDER_VERSION,
                                         "mmproj": str(f.path), "projector": hp.projector},
                         f.path.name)
    return folder


def load_vision_encoder(mmproj_path: str | os.PathLike[str],
                        providers: Sequence[Any] = ("CPUExecutionProvider",)
                        ) -> OrtVisionEncoder:
    """The encoder of an mmproj GGUF (GGUFError if it is not one specd can run)."""
    f, family, hp = read_checked(mmproj_path)
    folder = build_vision_graph(f, family, hp)
    return OrtVisionEncoder(family, hp, folder / MODEL_FILE, providers)
