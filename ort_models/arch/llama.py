"""`llama` (Llama 2/3, SmolLM2): llama.cpp NORM rope over adjacent pairs."""

from specd.ort_models.gguf_file import GGUFFile

from .base import HParams, read_common


def read_hparams(f: GGUFFile) -> HParams:
    return read_common(f, rope_interleaved=True)
