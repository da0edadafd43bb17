"""Which multimodal projector (mmproj GGUF) goes with a target model.

In order: the one asked for (`-mm/--mmproj FILE`, a path or a catalog name; "none" for
no images), the one the catalog names for the model, else one found beside the model
file under llama.cpp's naming (mmproj*.gguf in its folder) whose projection width is the
model's embedding width (a folder may hold other models' projectors). The encoder itself
is opened by `specd.ort_models.vision.load_vision_encoder`.
"""

from __future__ import annotations

import os
from pathlib import Path

from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.vision.mmproj import MMPROJ_ARCH

from .catalog import CATALOG
from .store import ModelStoreError, resolve_model

NO_MMPROJ = "none"
PATTERN = "mmproj*.gguf"


def find_mmproj(model: str | os.PathLike[str], model_path: Path, asked: str | None = None,
                *, fetch: bool = True) -> Path | None:
    """The mmproj for the target `model` (its catalog name or path as given) at
    `model_path`, or None (module doc). ModelStoreError where the one asked for, or the
    catalog's, cannot be had."""
    if asked is not None:
        if asked == NO_MMPROJ:
            return None
        return resolve_model(asked, fetch=fetch)
    entry = CATALOG.get(str(model))
    if entry is not None and entry.mmproj is not None:
        return resolve_model(entry.mmproj, fetch=fetch)
    return mmproj_beside(model_path)


def mmproj_beside(model_path: Path) -> Path | None:
    """An mmproj*.gguf in the model's folder whose clip.vision.projection_dim is the
    model's embedding width: the one whose name shares the most with the model's, where
    several do (None: none does, or the model cannot be read)."""
    try:
        f = GGUFFile(model_path)
    except GGUFError:
        return None
    width = f.arch_key("embedding_length")
    fits = [p for p in sorted(model_path.parent.glob(PATTERN))
            if p != model_path and _projection_width(p) == width]
    if not fits:
        return None
    stem = model_path.stem.lower()

    def shared(p: Path) -> int:
        name = p.stem.lower().removeprefix("mmproj").lstrip("-_.")
        return len(os.path.commonprefix([name, stem]))

    return max(fits, key=shared)


def _projection_width(path: Path) -> int | None:
    try:
        f = GGUFFile(path)
    except GGUFError:
        return None
    if f.arch != MMPROJ_ARCH:
        return None
    width = f.get("clip.vision.projection_dim")
    return width if isinstance(width, int) else None


__all__ = ["NO_MMPROJ", "ModelStoreError", "find_mmproj", "mmproj_beside"]
