"""Options and helpers the `specd` commands share (argparse types, build options)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from specd.daemon.drafters.history import DEFAULT_MAX_TOKENS, HistoryStore
from specd.daemon.drafters.suffix_index import MIN_CAPACITY
from specd.daemon.models.building import DRAFT_QUANTS, DRAFT_VOCAB_ROWS


def int_at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi], else a usage error naming the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < lo or hi is not None and value > hi:
            raise argparse.ArgumentTypeError(
                f"{value} is out of range (at least {lo}" + (f", at most {hi})" if hi is not None
                                                             else ")"))
        return value
    return parse


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


NO_DRAFT = "none"  # `-md none`: decode without a draft file


def settle_draft(args: argparse.Namespace) -> None:
    """Settle `-md` (given up to twice) into `args.draft` and `args.also_draft`: `none` is
    no draft file; left out under --spec-type auto, a catalog target speculates with the
    drafter measured fastest beside it, the reason said (and `args.draft_fallbacks` lists
    the next fastest, for a memory plan it does not fit). A measured drafter named `a+b`
    is two draft files run side by side (a head and a draft model)."""
    given = args.draft if isinstance(args.draft, list) else [args.draft] * (args.draft is not None)
    args.draft_fallbacks = ()
    if given == [NO_DRAFT]:
        args.draft, args.also_draft = None, None
        return
    if NO_DRAFT in given:
        raise ValueError(f"-md {NO_DRAFT} runs without a draft and names no other")
    if given or args.spec_type != "auto":
        args.draft, args.also_draft = draft_files(given)
        return
    args.draft, args.also_draft = None, None
    from specd.daemon.models.default_drafter import default_drafter

    choice = default_drafter(args.model)
    if choice is not None:
        print(f"specd: {choice.reason}", file=sys.stderr)
        args.draft, args.also_draft = split_drafter(choice.draft)
        args.draft_fallbacks = choice.fallbacks


def draft_files(given: list[str] | None) -> tuple[str | None, str | None]:
    """`-md` as given (up to twice): (the first draft file, the second), None for each one
    not given; more than two refused."""
    given = given or []
    if len(given) > 2:
        raise ValueError("-md: at most two draft files (a drafter head and a draft model), "
                         f"got {len(given)}")
    first, second = [*given, None, None][:2]
    return first, second


def split_drafter(name: str | None) -> tuple[str | None, str | None]:
    """A measured drafter's draft files (catalog names): `a` alone, or `a+b` (a head and a
    draft model side by side)."""
    if not name:
        return None, None
    first, _, second = name.partition("+")
    return first, second or None


def add_spin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spin", action="store_true",
                   help="CPU threads busy-wait during a forward pass: faster on an idle "
                        "machine, much slower when other programs use the cores")


def build_progress(label: str) -> Callable[[int, int, str], None]:
    """A graph build's progress bar for the target or the draft (said once, on the first step)."""
    from specd.daemon.models.store import ProgressBar

    bar = ProgressBar(unit="steps")

    def report(done: int, total: int, what: str) -> None:
        if done == 1:
            print(f"specd: building the ONNX graph of the {label} (first use only)",
                  file=sys.stderr)
        bar(done, total, what)

    return report




def add_history_args(p: argparse.ArgumentParser) -> None:
    """--history / --no-history and --history-tokens (serve's, and fit's to plan for)."""
    p.add_argument("--history", action=argparse.BooleanOptionalAction, default=True,
                   help="draft from each user's own earlier requests (their prompts and "
                   "outputs, kept per user and cache key, never drafting for another); "
                   "--no-history: off, nothing kept (default on)")
    p.add_argument("--history-tokens", type=int_at_least(MIN_CAPACITY), default=None,
                   metavar="N", help="tokens of history kept per user, the oldest dropped "
                   f"({HistoryStore.bytes_per_token} bytes each at most; default "
                   f"{DEFAULT_MAX_TOKENS})")


def history_bound_bytes(args: argparse.Namespace) -> int:
    """The most bytes the daemon user's history may hold under `args` (0: --no-history)."""
    if not args.history:
        return 0
    return HistoryStore.bound_bytes(args.history_tokens or DEFAULT_MAX_TOKENS)
