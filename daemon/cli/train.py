"""`specd train-draft`: train a drafter head for a target on this machine
(`specd.daemon.training`; PyTorch from the `specd[train]` extra)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .options import int_at_least

EXIT_OK, EXIT_ERROR = 0, 1


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer ids: {text!r}"
                                         ) from None


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `specd train-draft` to the `specd` subparsers; the handler is
    `args.func(args) -> int`."""
    from specd.daemon.models.catalog import DEFAULT_TARGET
    from specd.daemon.training.config import (
        DEFAULT_BLOCK,
        DEFAULT_DRAFT_VOCAB,
        DEFAULT_FEATURE_LAYERS,
        DEFAULT_GAMMA,
        DEFAULT_HEAD_LAYERS,
        DEFAULT_MARKOV_RANK,
        DEFAULT_PARALLEL,
    )

    p = subparsers.add_parser(
        "train-draft", help="train a DFlash, DSpark or EAGLE-3 drafter head for a target "
        "(self-distillation; needs specd[train])",
        description="Train a drafter head for TARGET by self-distillation: the target "
        "answers instructions made of the Python standard library's source and docs "
        "(PSF licence) and story prompts, its hidden states and greedy replies are what the "
        "head learns from; the head is written as llama.cpp's GGUF. Every stage keeps its "
        "state in the work folder: --resume goes on after an interruption. See "
        "docs/training.md.")
    p.add_argument("-m", "--model", default=DEFAULT_TARGET,
                   help=f"target GGUF path or catalog name (default {DEFAULT_TARGET})")
    p.add_argument("--kind", default="dflash", help="head kind: dflash; dspark (anchor-"
                   "first, with Markov and confidence heads); eagle3 (one autoregressive "
                   "layer over three target layers, trained by the training-time test)")
    p.add_argument("-o", "--outfile", required=True, help="the head GGUF to write")
    p.add_argument("--work-dir", default=None,
                   help="data and checkpoints (default: OUTFILE.work)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the run in the work folder (its data and checkpoint)")
    d = p.add_argument_group("data")
    d.add_argument("--samples", type=int_at_least(1), default=2000,
                   help="training replies to distill (default 2000)")
    d.add_argument("--eval-samples", type=int_at_least(1), default=64,
                   help="held-out replies (default 64)")
    d.add_argument("--max-prompt", type=int_at_least(16), default=768,
                   help="longer instructions are skipped (tokens, default 768)")
    d.add_argument("--max-reply", type=int_at_least(2), default=256,
                   help="reply length cap (tokens, default 256)")
    d.add_argument("--parallel", type=int_at_least(1), default=DEFAULT_PARALLEL,
                   help=f"replies distilled at once, their rows in one pass of the target "
                   f"(default {DEFAULT_PARALLEL})")
    h = p.add_argument_group("head")
    h.add_argument("--layers", type=int_at_least(1), default=None,
                   help=f"head layers (default {DEFAULT_HEAD_LAYERS}; eagle3: 1)")
    h.add_argument("--ffn", type=int_at_least(1), default=None,
                   help="feed-forward width (default: the target's)")
    h.add_argument("--block", type=int_at_least(2), default=None,
                   help=f"block size: drafts per pass + 1 (default {DEFAULT_BLOCK}; eagle3: "
                   "the unrolled steps of the training-time test + 1, default 8)")
    h.add_argument("--gamma", type=float, default=None,
                   help=f"loss decay over block slots, exp(-(k-1)/gamma) (default "
                   f"{DEFAULT_GAMMA}; eagle3: 4.48, step k weighted 0.8^k)")
    h.add_argument("--feature-layers", type=int_at_least(1), default=DEFAULT_FEATURE_LAYERS,
                   help=f"target layers read, spread by z-lab's rule (default "
                   f"{DEFAULT_FEATURE_LAYERS})")
    h.add_argument("--target-layers", type=_layers, default=None,
                   help="the target layers read, llama.cpp's ids (L: the stream entering "
                   "layer L), comma-separated; overrides --feature-layers")
    h.add_argument("--mask-token-id", type=int_at_least(0), default=None,
                   help="block filler token (default: the target's mask token, else its "
                   "first unused one)")
    h.add_argument("--draft-vocab", type=int_at_least(0), default=DEFAULT_DRAFT_VOCAB,
                   help=f"draft vocabulary: the most frequent reply tokens, with d2t "
                   f"(default {DEFAULT_DRAFT_VOCAB}; 0: the target's whole vocabulary)")
    h.add_argument("--markov-rank", type=int_at_least(1), default=DEFAULT_MARKOV_RANK,
                   help=f"DSpark: the Markov head's rank (default {DEFAULT_MARKOV_RANK})")
    h.add_argument("--outtype", choices=("f32", "f16", "bf16", "q8_0"), default="f16",
                   help="type of the head's matrices in the GGUF (default f16)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int_at_least(0), default=2000,
                   help="optimizer steps (default 2000)")
    t.add_argument("--stop-at", type=int_at_least(0), default=0,
                   help="end this invocation at this step, checkpointed (a run in parts: "
                   "--resume goes on); 0: run to --steps")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    t.add_argument("--batch-seqs", type=int_at_least(1), default=2,
                   help="sequences per step (default 2)")
    t.add_argument("--anchors", type=int_at_least(1), default=16,
                   help="blocks per sequence per step (default 16)")
    t.add_argument("--eval-blocks", type=int_at_least(1), default=256,
                   help="held-out blocks per acceptance estimate (default 256)")
    t.add_argument("--eval-every", type=int_at_least(0), default=0,
                   help="steps between estimates (default: a tenth of the run)")
    t.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto (default): bfloat16 autocast where the device computes it "
                   "natively (CUDA, CPUs with AVX-512 BF16), else float32")
    t.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto",
                   help="where specd runs the target while distilling: auto, cpu, cuda[:N]")
    p.add_argument("--train-device", default="auto",
                   help="where torch trains: auto (a CUDA GPU where torch sees one), cpu, "
                   "cuda[:N]")
    p.add_argument("-t", "--threads", type=int_at_least(0), default=None,
                   help="CPU threads (default, or 0: all the cores this process may use)")
    p.add_argument("--no-fetch", action="store_true", help="never download catalog models")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from specd.daemon.benchmark.run import PROMPTS
    from specd.daemon.models.building import resolve_device
    from specd.daemon.models.store import ModelStoreError, ProgressBar, resolve_model
    from specd.daemon.training import TrainError, require_torch
    from specd.daemon.training.run import TrainRequest, check_kind, train_draft
    from specd.ort_models.gguf_file import GGUFError

    out = Path(args.outfile)
    try:
        check_kind(args.kind)
        require_torch()
        from specd.daemon.training.trainer import TrainSettings

        target = resolve_model(args.model, fetch=not args.no_fetch, progress=ProgressBar())
        settings = TrainSettings(steps=args.steps, stop_at=args.stop_at, lr=args.lr,
                                 batch_seqs=args.batch_seqs, anchors=args.anchors,
                                 eval_blocks=args.eval_blocks, eval_every=args.eval_every,
                                 precision=args.precision, seed=args.seed)
        req = TrainRequest(
            target=Path(target), out=out,
            work=Path(args.work_dir) if args.work_dir else out.with_name(out.name + ".work"),
            kind=args.kind, samples=args.samples, eval_samples=args.eval_samples,
            max_prompt=args.max_prompt, max_reply=args.max_reply, n_layer=args.layers,
            n_ff=args.ffn, block_size=args.block, gamma=args.gamma,
            feature_layers=args.feature_layers, target_layers=args.target_layers,
            mask_token_id=args.mask_token_id, draft_vocab=args.draft_vocab,
            markov_rank=args.markov_rank, outtype=args.outtype, device=resolve_device(args.device),
            train_device=args.train_device, threads=args.threads or None,
            parallel=args.parallel, seed=args.seed,
            resume=args.resume, exclude=tuple(PROMPTS.values()), settings=settings)
        result = train_draft(req)
    except (TrainError, ModelStoreError, GGUFError, OSError, ValueError) as exc:
        if getattr(args, "verbose", False):
            raise
        print(f"specd: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if result.head_path is None:
        print(f"specd: stopped at step {args.stop_at}, checkpointed: --resume goes on",
              file=sys.stderr)
    return EXIT_OK
