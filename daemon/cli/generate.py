"""`specd generate`: text to stdout as it is produced, stats to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.sampling import SamplerParams

from .options import build_progress, settle_draft


def params_from_args(args: argparse.Namespace) -> GenerationParams:
    return GenerationParams(
        max_tokens=args.max_tokens,
        sampling=SamplerParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                               seed=args.seed).validate(),
        draft=DraftParams(n_max=args.n_max, n_min=args.n_min, p_min=args.p_min,
                          probabilistic=args.spec_draft_probabilistic).validate(),
        adaptive=args.spec_adaptive,
        ignore_eos=args.ignore_eos,
        backend_sampling=args.backend_sampling,
    )


def engine_config_from_args(args: argparse.Namespace, *, slots: int = 1):
    from specd.daemon.serving.engine import EngineConfig

    rates = None
    if args.spec_synthetic_rates:
        try:
            rates = [float(x) for x in args.spec_synthetic_rates.split(",")]
        except ValueError:
            raise ValueError(f"--spec-synthetic-rates: not a list of numbers: "
                             f"{args.spec_synthetic_rates!r}") from None
    spec_type = args.spec_type
    if spec_type == "synthetic" and rates is None and args.spec_synthetic_mean is None:
        raise ValueError("--spec-type synthetic needs --spec-synthetic-rates or "
                         "--spec-synthetic-mean")
    return EngineConfig(
        target=args.model, draft=args.draft, also_draft=getattr(args, "also_draft", None),
        spec_type=spec_type, n_ctx=args.n_ctx,
        slots=slots, threads=args.threads, device=args.device, ngram_min=args.spec_ngram_min,
        ngram_max=args.spec_ngram_max, synthetic_rates=rates,
        synthetic_mean=args.spec_synthetic_mean, fetch=not args.no_fetch,
        draft_quant=args.draft_quant, draft_vocab=args.draft_vocab, spin=args.spin,
        mmproj=getattr(args, "mmproj", None) or "auto", defaults=params_from_args(args))


def _prompt_text(args: argparse.Namespace) -> tuple[str, bool]:
    given = [x is not None for x in (args.prompt, args.chat, args.prompt_file)]
    if sum(given) != 1:
        raise ValueError("give exactly one of: a prompt, --chat TEXT, --prompt-file FILE")
    if args.chat is not None:
        return args.chat, True
    if args.prompt_file is not None:
        return Path(args.prompt_file).read_text(encoding="utf-8"), False
    return args.prompt, False


def run(args: argparse.Namespace) -> int:
    from specd.daemon.drafters.registry import SPEC_TYPE_REGISTRY
    from specd.daemon.models.store import ProgressBar
    from specd.daemon.serving.engine import Engine
    from specd.daemon.text.detokenize import IncrementalDetokenizer

    text, chat = _prompt_text(args)
    settle_draft(args)
    cfg = engine_config_from_args(args)
    engine = Engine(cfg, progress=ProgressBar(), build_progress=build_progress)
    print(f"specd: {engine.runtime.describe()}", file=sys.stderr)
    if engine.draft_choice:
        print(f"specd: {engine.draft_choice}", file=sys.stderr)
    prompt = engine.encode_prompt(text, chat=chat)
    params = cfg.defaults
    gen = engine.start(0, prompt, params)
    detok = IncrementalDetokenizer(engine.tokenizer, skip_special=True)  # as the server
    out = sys.stdout
    eog = engine.eog_ids

    def write(tokens: list[int]) -> None:
        for t in tokens:
            if t in eog:
                continue
            piece = detok.push(t)
            if piece:
                out.write(piece)
        out.flush()

    t0 = time.perf_counter()
    write(gen.prefill())
    while not gen.done:
        write(gen.step())
    out.write(detok.flush())
    out.write("\n")
    out.flush()
    total = time.perf_counter() - t0
    gen.close()
    s = gen.stats
    if args.json:
        print(json.dumps({"finish_reason": gen.finish_reason, "total_s": round(total, 3),
                          "spec_type": engine.spec_type, **s.as_dict()}), file=sys.stderr)
        return 0
    print(f"specd: prompt {s.prompt_tokens} tokens, {s.prefill_tps:.1f} tok/s; "
          f"generated {s.generated_tokens} tokens, {s.decode_tps:.1f} tok/s "
          f"({gen.finish_reason})", file=sys.stderr)
    if engine.spec_type != "none":
        acc = ", ".join(f"{x:.2f}" for x in s.per_position_acceptance())
        lengths = ", ".join(f"{n}:{c}" for n, c in sorted(s.draft_lengths.items()))
        print(f"specd: speculation {engine.spec_type}: {s.rounds} rounds, drafted {s.drafted},"
              f" accepted {s.accepted} ({s.acceptance_rate:.2f}), mean acceptance length "
              f"{s.mean_acceptance_length:.2f}; draft {s.draft_s:.2f}s, verify "
              f"{s.verify_s:.2f}s"
              + (f"; {s.lookup_rounds} rounds by prompt lookup ({s.lookup_accepted} accepted)"
                 if SPEC_TYPE_REGISTRY[engine.spec_type].chains_lookup else "")
              + ("; drafted by " + ", ".join(f"{name} {c}×" for name, c
                                               in sorted(s.source_calls.items()))
                 if len(s.source_calls) > 1 else ""),
              file=sys.stderr)
        print(f"specd: per-position acceptance [{acc}]; draft lengths {{{lengths}}}"
              + ("" if s.valid else "; SYNTHETIC: output not valid"), file=sys.stderr)
    return 0
