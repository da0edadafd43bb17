"""Vision encoders for images in the context: llama.cpp's mmproj GGUFs as ONNX graphs.

`load_vision_encoder(mmproj_path)` -> a `VisionEncoder`: `prepare(bytes)` decodes and
preprocesses an image as llama.cpp's mtmd does (`ImageError` on bad input), `encode`
returns its embeddings [n_tokens, n_embd] for the text model. One module per family
(`gemma3.py`, `qwen25vl.py`, `muse_glimmer.py`), chosen by `clip.projector_type` (`registry.py`).
"""

from .encoder import OrtVisionEncoder, VisionEncoder, load_vision_encoder
from .family import PreparedImage
from .image_input import MAX_IMAGE_PIXELS, ImageError
from .registry import FAMILIES

__all__ = ["FAMILIES", "MAX_IMAGE_PIXELS", "ImageError", "OrtVisionEncoder", "PreparedImage",
           "VisionEncoder", "load_vision_encoder"]
