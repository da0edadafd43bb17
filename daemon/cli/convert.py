"""`specd convert-draft`: a drafter head's Hugging Face checkpoint -> the head GGUF
llama.cpp's converter writes (`specd.daemon.models.convert_draft`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `specd convert-draft` to the `specd` subparsers; the handler is
    `args.func(args) -> int`."""
    from specd.daemon.models.convert_draft import ARCHITECTURES, DEFAULT_OUTTYPE, OUTTYPES

    p = subparsers.add_parser(
        "convert-draft", help="convert a DFlash / DFlash2 / DSpark / EAGLE-3 head "
        "checkpoint (safetensors) to the GGUF llama.cpp writes",
        description="Convert a drafter head's Hugging Face checkpoint into a head GGUF, as "
        "llama.cpp's convert_hf_to_gguf.py --target-model-dir does, taking the target's "
        "tokenizer and sizes from its GGUF. Architectures: " + ", ".join(ARCHITECTURES))
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                   help="folder with config.json and model*.safetensors")
    p.add_argument("--target", required=True,
                   help="the target model the head drafts for: GGUF path or catalog name")
    p.add_argument("-o", "--outfile", required=True, help="the head GGUF to write")
    p.add_argument("--outtype", choices=tuple(OUTTYPES), default=DEFAULT_OUTTYPE,
                   help=f"type of the weight matrices (default {DEFAULT_OUTTYPE}; norms and "
                   "vectors stay F32, d2t I64)")
    p.add_argument("--no-fetch", action="store_true", help="never download catalog models")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from specd.daemon.models.convert_draft import ConvertError, convert_draft
    from specd.daemon.models.store import ModelStoreError, ProgressBar, resolve_model
    from specd.ort_models.gguf_file import GGUFError

    try:
        target = resolve_model(args.target, fetch=not args.no_fetch, progress=ProgressBar())
        head = convert_draft(args.checkpoint, target, args.outfile, args.outtype)
    except (ConvertError, ModelStoreError, GGUFError, OSError) as exc:
        if getattr(args, "verbose", False):
            raise
        print(f"specd: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    vocab = f", draft vocabulary {head.draft_vocab}" if head.draft_vocab else ""
    print(f"wrote {args.outfile}: {head.kind} head, {head.n_layer} layer(s), width "
          f"{head.n_embd}, target layers {list(head.target_layers)}{vocab}")
    return EXIT_OK
