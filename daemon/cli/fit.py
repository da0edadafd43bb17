"""`specd fit`: measure the models on the device and show the context/slots that fit.

`fit_models()` is the same path for `specd serve` start: snapshot the free memory first
(measuring loads the models, in a subprocess), build/load the graphs, measure (cached in
each graph folder), then plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specd.daemon.control.config import RANGES
from specd.daemon.serving.engine import DRAFT_QUANTS, DRAFT_VOCAB_ROWS, build_options
from specd.memory_fit.measure import MeasureError, ModelCost, measure
from specd.memory_fit.plan import DEFAULT_MARGIN_BYTES, DEFAULT_MIN_CTX, FitError, Plan, fit
from specd.memory_fit.probes import FakeProbe, MemoryProbe, ProbeError, probe_for
from specd.ort_models.graph_builder import ATTN_BUCKET, BuildOptions

from .generate import int_at_least

if TYPE_CHECKING:
    from specd.ort_models.model_cache import BuiltModel

EXIT_OK, EXIT_ERROR = 0, 1

BuildProgress = Callable[[str], Any]


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
    p.add_argument("-md", "--model-draft", dest="draft", default=None,
                   help="draft GGUF path or catalog name")
    add_draft_build_args(p)
    p.add_argument("--slots", type=int_at_least(*RANGES["slots"]), default=1,
                   help="parallel sequences (default 1)")
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
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_fit)
    return p


def resolve_device(device: str) -> str:
    """"auto" -> what the engine would use ("cpu" / "cuda:N"); "cuda" -> "cuda:0"."""
    from specd.ort_models.providers import choose_runtime

    if device == "auto":
        return choose_runtime("auto").device
    if device == "cuda":
        return "cuda:0"
    return device


def add_draft_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-quant", default="auto", choices=list(DRAFT_QUANTS),
                   help="draft weights: re-quantized to GGUF Q4_K blocks for specd's CPU "
                        "kernel (q4k), to 4 bits in blocks of 32 (q4) or 128 (q4g128) for "
                        "MatMulNBits, or exactly as in its GGUF; auto (default): q4k where "
                        "the kernels compiled, else q4. The output is the target's either way")
    p.add_argument("--draft-vocab", type=int_at_least(0), default=DRAFT_VOCAB_ROWS,
                   help=f"the draft proposes only ids below this (its output matrix shrinks "
                        f"to those rows; BPE and SentencePiece number tokens roughly by "
                        f"frequency); 0: all. Default {DRAFT_VOCAB_ROWS}. The output is the "
                        f"target's either way")


def add_spin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spin", action="store_true",
                   help="CPU threads busy-wait during a forward pass: ~10%% faster on an idle "
                        "machine, ~30%% slower when other programs use the cores")


def fit_models(target: str | os.PathLike[str], draft: str | os.PathLike[str] | None = None,
               *, device: str = "auto", slots: int = 1,
               margin_bytes: int = DEFAULT_MARGIN_BYTES, min_ctx: int = DEFAULT_MIN_CTX,
               max_ctx: int | None = None, threads: int | None = None, fetch: bool = True,
               use_cache: bool = True, probe: MemoryProbe | None = None,
               build_progress: BuildProgress | None = None, draft_quant: str = "auto",
               draft_vocab: int = DRAFT_VOCAB_ROWS, progress: Any = None
               ) -> tuple[Plan, list[ModelCost]]:
    """Resolve, build, measure and fit target (+ draft); returns the plan and the costs."""
    from specd.daemon.models.store import resolve_model

    dev = resolve_device(device)
    free = FakeProbe.snapshot(probe or probe_for(dev))  # before anything is loaded
    bp = build_progress or (lambda label: None)
    costs = []
    for label, name in (("target", target), ("draft", draft)):
        if name is None:
            continue
        path = resolve_model(name, fetch=fetch, progress=progress, to_run=True)  # a bar
        built = built_model(path, bp(label), build_options(label, draft_quant, dev, draft_vocab))
        trained = built.hparams.n_ctx_train
        if 0 < trained < ATTN_BUCKET:  # nothing to measure at, nothing to plan
            raise FitError(f"a context of at least {ATTN_BUCKET} tokens is needed; "
                           f"{Path(path).name} was trained on {trained}")
        costs.append(measure(built, dev, threads=threads, use_cache=use_cache))
    plan = fit(costs[0], costs[1] if len(costs) > 1 else None, probe=free, slots=slots,
               margin_bytes=margin_bytes, min_ctx=min_ctx, max_ctx=max_ctx)
    return plan, costs


def built_model(path: str | os.PathLike[str], progress: Any = None,
                options: BuildOptions | None = None) -> BuiltModel:
    """The BuiltModel of a GGUF: from its graph folder's meta.json when it is built
    already (no GGUF parsing: instant), else load_or_build (builds it)."""
    from specd.memory_fit.measure import built_from_folder
    from specd.ort_models.gguf_file import content_hash
    from specd.ort_models.model_cache import graph_folder, is_complete, load_or_build

    options = options or BuildOptions()
    sha = content_hash(path)
    # a vocabulary cut at or past the model's size is cached as no cut (for_vocab), and
    # the size is known only from a folder's meta: try the cut's folder, then the whole's
    tries = [options] + ([dataclasses.replace(options, vocab_rows=0)] if options.vocab_rows
                         else [])
    for opts in tries:
        folder = graph_folder(sha, opts)
        if not is_complete(folder):
            continue
        try:
            built = built_from_folder(folder)
        except (OSError, ValueError, KeyError, TypeError):
            break  # an unreadable meta.json: let load_or_build check and rebuild
        if options.for_vocab(built.hparams.n_vocab) == built.options:
            return dataclasses.replace(built, gguf_path=Path(path))
    return load_or_build(path, options, progress)


def run_fit(args: argparse.Namespace) -> int:
    from specd.daemon.models.store import ModelStoreError, ProgressBar
    from specd.ort_models.gguf_file import GGUFError

    from .generate import _build_progress

    try:
        plan, _ = fit_models(args.model, args.draft, device=args.device, slots=args.slots,
                             margin_bytes=int(args.margin_mb * 2**20), min_ctx=args.min_ctx,
                             max_ctx=args.max_ctx, threads=args.threads,
                             fetch=not args.no_fetch, use_cache=not args.remeasure,
                             build_progress=_build_progress, draft_quant=args.draft_quant,
                             draft_vocab=args.draft_vocab,
                             progress=ProgressBar())
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
