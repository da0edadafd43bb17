"""`specd convert-draft`: a drafter head's Hugging Face checkpoint (safetensors) -> the
GGUF llama.cpp's convert_hf_to_gguf.py (build 11434) writes for it, so that specd and
llama.cpp load it.

Kinds: DFlash, DFlash2, DSpark and the muse-glimmer drafter (architecture `dflash`,
`dflash.py`) and EAGLE-3 (`eagle3`, `eagle3.py`). Where llama.cpp's converter reads the
target model's Hugging Face folder (`--target-model-dir`), this reads the target's GGUF
(`target.py`): its width, depth and vocabulary, and the tokenizer keys every head carries.
No torch: the checkpoint is read by `safetensors.py`, tensors are encoded by the gguf
package as llama.cpp encodes them (`common.py`).

The result is checked by specd's own head reader and against the target before it takes
the output's name.
"""

from __future__ import annotations

import os
from pathlib import Path

from specd.daemon.models.compat import head_incompatibilities
from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.heads import HeadFormatError, HeadParams, read_head

from . import dflash, eagle3
from .common import OUTTYPES, load_checkpoint
from .errors import ConvertError
from .target import read_target

DFLASH_KIND_ARCHS = (*dflash.DFLASH_ARCHS, *dflash.DSPARK_ARCHS, *dflash.MUSE_GLIMMER_ARCHS)
ARCHITECTURES = (*DFLASH_KIND_ARCHS, *eagle3.EAGLE3_ARCHS)
DEFAULT_OUTTYPE = "f16"  # llama.cpp's default


def convert_draft(checkpoint: str | os.PathLike[str], target: str | os.PathLike[str],
                  out: str | os.PathLike[str], outtype: str = DEFAULT_OUTTYPE) -> HeadParams:
    """Convert the head checkpoint in folder `checkpoint` for the target GGUF `target` into
    `out`; returns the head as specd reads it. ConvertError: the checkpoint cannot be
    converted, or the head would not fit the target (nothing is written then)."""
    ck_dir, target_path, out_path = Path(checkpoint), Path(target), Path(out)
    if outtype not in OUTTYPES:
        raise ConvertError(f"unknown --outtype {outtype!r} (one of {', '.join(OUTTYPES)})")
    ck = load_checkpoint(ck_dir.resolve())
    tgt = read_target(target_path)
    if ck.arch in DFLASH_KIND_ARCHS:
        writer = dflash.convert(ck, tgt, outtype)
    elif ck.arch in eagle3.EAGLE3_ARCHS:
        writer = eagle3.convert(ck, tgt, outtype)
    else:
        raise ConvertError(f"{ck_dir}: architecture {ck.arch!r} is not a drafter head this "
                           f"converts (one of {', '.join(ARCHITECTURES)})")
    partial = out_path.with_name(out_path.name + ".partial")
    try:
        writer.write(partial)
        head = _check(partial, ck_dir, tgt.path)
        partial.replace(out_path)
    finally:
        partial.unlink(missing_ok=True)
    return head


def _check(path: Path, ck_dir: Path, target: Path) -> HeadParams:
    """The written head, read back by specd's head reader and checked against the target
    (whose architecture specd may not run: then only the reader's checks)."""
    from specd.ort_models.arch import READERS, read_hparams

    f = GGUFFile(path)
    try:
        head = read_head(f)
    except HeadFormatError as exc:
        raise ConvertError(f"{ck_dir}: the converted head is malformed: "
                           f"{str(exc).removeprefix(f'{path}: ')}") from None
    t = GGUFFile(target)
    if t.arch in READERS:
        try:
            hparams = read_hparams(t)
        except GGUFError as exc:
            raise ConvertError(str(exc)) from None
        problems = head_incompatibilities(head, hparams, t.metadata, f.metadata)
        if problems:
            raise ConvertError(f"{ck_dir}: the head does not fit the target {target}: "
                               + "; ".join(problems))
    return head


__all__ = ["ARCHITECTURES", "DEFAULT_OUTTYPE", "OUTTYPES", "ConvertError", "convert_draft"]
