"""`specd fit`: measure the models on the device and show the context/slots that fit
(`specd.daemon.models.building.fit_models`, the same path `specd serve` starts with)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from specd.daemon.control.config import DEFAULT_SLOTS, RANGES
from specd.daemon.models.building import fit_models
from specd.memory_fit.measure import MeasureError
from specd.memory_fit.plan import DEFAULT_MARGIN_BYTES, DEFAULT_MIN_CTX, FitError
from specd.memory_fit.probes import ProbeError

from .options import (
    add_draft_build_args,
    add_history_args,
    build_progress,
    draft_files,
    history_bound_bytes,
    int_at_least,
)

EXIT_OK, EXIT_ERROR = 0, 1


def _megabytes(text: str) -> float:
    """An argparse type: a finite number of MiB, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a size in MiB (a finite number >= 0)")
    return value


def add_fit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `specd fit` to the `specd` subparsers; the handler is `args.func(args) -> int`."""
    from specd.daemon.models.catalog import DEFAULT_TARGET

    p = subparsers.add_parser("fit", help="measure the models and show what fits in memory")
    p.add_argument("-m", "--model", default=DEFAULT_TARGET,
                   help=f"target GGUF path or catalog name (default {DEFAULT_TARGET})")
    p.add_argument("-md", "--model-draft", dest="draft", action="append", default=None,
                   help="draft GGUF path or catalog name (a draft model or a drafter head; "
                        "given twice, a head and a draft model, planned together)")
    add_draft_build_args(p)
    p.add_argument("--slots", type=int_at_least(*RANGES["slots"]), default=DEFAULT_SLOTS,
                   help=f"parallel sequences (default {DEFAULT_SLOTS}, as specd serve's)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu or cuda:N (default auto: $SPECD_DEVICE if set, else CUDA "
                   "where onnxruntime-gpu finds a GPU)")
    p.add_argument("--margin-mb", type=_megabytes, default=DEFAULT_MARGIN_BYTES / 2**20,
                   help=f"memory left free, MiB (default {DEFAULT_MARGIN_BYTES >> 20})")
    p.add_argument("--min-ctx", type=int, default=DEFAULT_MIN_CTX,
                   help=f"smallest acceptable context (default {DEFAULT_MIN_CTX})")
    p.add_argument("--max-ctx", type=int, default=None,
                   help="largest context wanted (default: the models' trained context)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("--remeasure", action="store_true", help="ignore cached measurements")
    p.add_argument("--no-fetch", action="store_true", help="never download catalog models")
    add_history_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_fit)
    return p


def run_fit(args: argparse.Namespace) -> int:
    from specd.daemon.models.store import ModelStoreError, ProgressBar
    from specd.ort_models.gguf_file import GGUFError

    try:
        draft, also = draft_files(args.draft)
        plan, _ = fit_models(args.model, draft, also_draft=also, device=args.device,
                             slots=args.slots, margin_bytes=int(args.margin_mb * 2**20),
                             min_ctx=args.min_ctx,
                             max_ctx=args.max_ctx, threads=args.threads,
                             fetch=not args.no_fetch, use_cache=not args.remeasure,
                             build_progress=build_progress, draft_quant=args.draft_quant,
                             draft_vocab=args.draft_vocab,
                             progress=ProgressBar(),
                             history_bytes=history_bound_bytes(args))
    except (FitError, MeasureError, ProbeError, ModelStoreError, GGUFError, ValueError,
            RuntimeError, OSError) as exc:
        if getattr(args, "verbose", False):
            raise
        print(f"specd: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(plan.as_dict(), indent=1))
    else:
        print(plan.table())
    return EXIT_OK
