"""`specd train-draft`: a drafter head trained for a target by self-distillation, on this
machine, written as the GGUF llama.cpp's converter writes (so specd and llama.cpp load it).

The stages, each resumable from its work folder:

1. `corpus.py`: instructions built from text that ships with Python itself (the standard
   library's source and its documentation topics, PSF licence) and from story prompts
   written here; an evaluation split disjoint from the training one, by source.
2. `distill.py`: the target's own greedy replies to them (specd's runner, prompt lookup
   in front, so the replies are exactly what the target says), with the hidden states of
   the layers the head reads for every token, stored as shards of numpy arrays.
3. `trainer.py` (PyTorch, the optional `specd[train]` extra): the DFlash (or DSpark)
   recipe on those shards, checkpointed; `model.py` is the head in torch, the same
   computation as specd's head graphs (`ort_models/graph_builder/dflash.py`, `dspark.py`).
4. `export.py`: the head GGUF, through `convert_draft`'s writer, checked by specd's head
   reader against the target.

torch is imported only by `model.py` and `trainer.py`, which only `run.py` imports, when
training starts (`require_torch` says how to install it where it is missing).
"""

from __future__ import annotations

import os

KINDS = ("dflash", "dspark", "eagle3")  # head kinds train-draft makes
INSTALL_HINT = "pip install 'specd[train]'"


class TrainError(Exception):
    """A training run that cannot go on; the message says why, for the user."""


def require_torch() -> None:
    """Raise TrainError naming the extra to install where torch cannot be imported.

    Before torch loads its OpenMP runtime: idle OpenMP threads sleep rather than spin
    (OMP_WAIT_POLICY PASSIVE, unless set), since spinning threads on a machine whose
    cores other programs use make each step many times slower (measured: 20x on 2
    shared cores)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise TrainError(f"training needs PyTorch, which is not installed ({exc}): "
                         f"{INSTALL_HINT} (on a machine without an NVIDIA GPU, PyTorch's "
                         "CPU-only wheels are far smaller: see docs/training.md)") from None


__all__ = ["INSTALL_HINT", "KINDS", "TrainError", "require_torch"]
