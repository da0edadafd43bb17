"""`qwen2` (Qwen2, Qwen2.5, Qwen2.5-Coder): NEOX rope, biases on q/k/v."""

from specd.ort_models.gguf_file import GGUFFile

from .base import HParams, read_common


def read_hparams(f: GGUFFile) -> HParams:
    return read_common(f, rope_interleaved=False, qkv_bias=True)
