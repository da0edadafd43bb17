"""What a vision family supplies (one subclass per llama.cpp projector type), and what
preprocessing hands the encoder."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from specd.ort_models.gguf_file import GGUFFile

from .image_input import DecodedImage
from .mmproj import VisionHParams
from .vit_graph import VisionGraph

PIXELS = "pixels"  # the graph's pixel input, [3, H, W] float32
EMBEDDINGS = "embeddings"  # its output, [n_tokens, projection_dim] float32


@dataclass(frozen=True)
class PreparedImage:
    """An image preprocessed for one encoder."""

    pixels: np.ndarray  # [3, H, W] float32, normalised as the family wants
    grid: tuple[int, int]  # the image's token grid (rows, cols), after merging
    n_tokens: int  # embeddings the encoder returns for it
    digest: str  # sha256 of the original file's bytes


class VisionFamily(ABC):
    """A vision tower and projector: its keys, tensors, preprocessing and graph."""

    projector: ClassVar[str]  # clip.projector_type
    # the text mtmd puts around an image's tokens (tokenized with specials parsed)
    image_begin: ClassVar[str] = ""
    image_end: ClassVar[str] = ""

    @abstractmethod
    def read_hparams(self, f: GGUFFile) -> VisionHParams:
        """The hyper-parameters with this family's defaults; GGUFError if unusable."""

    @abstractmethod
    def tensor_shapes(self, hp: VisionHParams) -> dict[str, tuple[int, ...]]:
        """Every tensor the graph reads, with its numpy shape."""

    @abstractmethod
    def prepare(self, image: DecodedImage, hp: VisionHParams) -> PreparedImage:
        """Resize and normalise as llama.cpp's preprocessor for this projector does."""

    @abstractmethod
    def build(self, vg: VisionGraph) -> None:
        """The encoder graph: input PIXELS (and `feeds`' names), output EMBEDDINGS."""

    def feeds(self, image: PreparedImage, hp: VisionHParams) -> dict[str, np.ndarray]:
        """The graph's inputs besides the pixels (positions, masks), from the grid."""
        return {}


def vit_layer_shapes(hp: VisionHParams, *, biases: bool, norm_bias: bool, gate: bool
                     ) -> dict[str, tuple[int, ...]]:
    """The tensors of build_vit's layers: norms, attention, FFN (with a gate or not)."""
    e, ff = hp.n_embd, hp.n_ff
    out: dict[str, tuple[int, ...]] = {}
    for il in range(hp.n_layer):
        p = f"v.blk.{il}"
        for n in ("ln1", "ln2"):
            out[f"{p}.{n}.weight"] = (e,)
            if norm_bias:
                out[f"{p}.{n}.bias"] = (e,)
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out[f"{p}.{n}.weight"] = (e, e)
        mats = {"ffn_up": (ff, e), "ffn_down": (e, ff)} | ({"ffn_gate": (ff, e)} if gate else {})
        for n, shape in mats.items():
            out[f"{p}.{n}.weight"] = shape
        if biases:
            for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
                out[f"{p}.{n}.bias"] = (e,)
            for n, shape in mats.items():
                out[f"{p}.{n}.bias"] = (shape[0],)
    return out
