"""Architecture registry: GGUF `general.architecture` -> hyper-parameter reader."""

from collections.abc import Callable

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from . import gemma3, gpt_oss, llama, muse_glimmer, qwen2, qwen2vl, qwen3, qwen3moe
from .base import HParams, MoeParams

READERS: dict[str, Callable[[GGUFFile], HParams]] = {
    "gemma3": gemma3.read_hparams,
    "gpt-oss": gpt_oss.read_hparams,
    "llama": llama.read_hparams,
    "muse-glimmer": muse_glimmer.read_hparams,
    "qwen2": qwen2.read_hparams,
    "qwen2vl": qwen2vl.read_hparams,
    "qwen3": qwen3.read_hparams,
    "qwen3moe": qwen3moe.read_hparams,
}


def read_hparams(f: GGUFFile) -> HParams:
    reader = READERS.get(f.arch)
    if reader is None:
        raise GGUFError(
            f"{f.path}: unsupported architecture {f.arch!r} "
            f"(supported: {', '.join(sorted(READERS))})"
        )
    return reader(f)


__all__ = ["HParams", "MoeParams", "READERS", "read_hparams"]
