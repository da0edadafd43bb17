"""Projector type (clip.projector_type) -> the vision family that encodes it."""

from __future__ import annotations

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .family import VisionFamily
from .gemma3 import Gemma3Vision
from .mmproj import projector_type
from .muse_glimmer import MuseGlimmerVision
from .qwen25vl import Qwen25VLVision

FAMILIES: dict[str, VisionFamily] = {
    family.projector: family
    for family in (Gemma3Vision(), Qwen25VLVision(), MuseGlimmerVision())}


def family_of(f: GGUFFile) -> VisionFamily:
    """The family of an mmproj file; GGUFError naming the projector type if none."""
    kind = projector_type(f)
    family = FAMILIES.get(kind)
    if family is None:
        raise GGUFError(f"{f.path}: specd has no vision encoder for projector type "
                        f"{kind!r} (supported: {', '.join(sorted(FAMILIES))})")
    return family
