"""`qwen3`: NEOX rope, per-head RMSNorm of q and k, no biases."""

from specd.ort_models.gguf_file import GGUFFile

from .base import HParams, read_common


def read_hparams(f: GGUFFile) -> HParams:
    return read_common(f, rope_interleaved=False, qk_norm=True)
