"""`specd bench`: the benchmark suite (JSON, markdown table, PNG plot)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specd.daemon.benchmark.run import BenchConfig


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from specd.daemon.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    from .options import add_draft_build_args, add_spin_arg

    b = sub.add_parser("bench", help="benchmark speculation configurations (and llama.cpp)")
    b.add_argument("-m", "--model", default=DEFAULT_TARGET)
    b.add_argument("-md", "--model-draft", dest="draft", default=DEFAULT_DRAFT)
    b.add_argument("--no-draft", action="store_true", help="benchmark without a draft model")
    add_draft_build_args(b)
    add_spin_arg(b)
    b.add_argument("-t", "--threads", type=int, default=None)
    b.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=2048)
    b.add_argument("-n", "--max-tokens", type=int, default=256)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--prompts", default="code,refactor,prose")
    b.add_argument("--temperatures", default="0,0.7")
    b.add_argument("--configs", default=None,
                   help="comma-separated: target-only, draft n_max=K, draft adaptive, "
                        "ngram n_max=K, ngram adaptive, draft+ngram n_max=K, draft+ngram "
                        "adaptive (default: a set of each)")
    b.add_argument("--peer", action="store_true",
                   help="also run llama.cpp: llama-server at the build specd follows, on the "
                        "same files, target-only (built into the cache first if it is not: "
                        "about 20 minutes)")
    b.add_argument("--peer-lookup", action="store_true",
                   help="also run llama-server's prompt lookup, --spec-type ngram-mod "
                        "(implies --peer)")
    b.add_argument("--peer-draft", action="store_true",
                   help="also run llama-server's speculation with the same draft model, "
                        "--spec-type draft-simple with its defaults and tuned (n_max 8, "
                        "p_min 0.5) (implies --peer)")
    b.add_argument("--out", default="bench-results", help="output folder")
    b.set_defaults(func=run)


def _choices(args: argparse.Namespace, has_draft: bool
             ) -> tuple[dict[str, str], tuple[float, ...], list[BenchConfig]]:
    """Prompts, temperatures and configurations asked for (ValueError naming a bad one)."""
    from specd.daemon.benchmark import run as bench
    from specd.daemon.drafters.registry import MODEL_SPEC_TYPES

    prompts = {}
    for k in dict.fromkeys(p.strip() for p in args.prompts.split(",")):
        if k not in bench.PROMPTS:
            raise ValueError(f"unknown prompt {k!r} (one of {', '.join(bench.PROMPTS)})")
        prompts[k] = bench.PROMPTS[k]
    try:
        temps = tuple(dict.fromkeys(float(t) for t in args.temperatures.split(",")))
    except ValueError:
        raise ValueError(f"--temperatures takes numbers, got {args.temperatures!r}") from None
    if any(not 0.0 <= t <= 5.0 for t in temps):
        raise ValueError(f"temperatures must be in [0, 5], got {args.temperatures!r}")
    configs = bench.default_configs(has_draft)
    if args.configs:
        parsed = [bench.parse_config(n) for n in args.configs.split(",")]
        configs = list({c.name: c for c in parsed}.values())
        if not has_draft and any(c.spec in MODEL_SPEC_TYPES for c in configs):
            raise ValueError("draft configurations need a draft model (-md; not --no-draft)")
    return prompts, temps, configs


def run(args: argparse.Namespace) -> int:
    from specd.daemon.benchmark import report as bench_report
    from specd.daemon.benchmark import run as bench
    from specd.daemon.models.store import ProgressBar
    from specd.daemon.serving.engine import Engine, EngineConfig
    from specd.ort_models.runner import default_threads

    threads = args.threads or default_threads()
    draft = None if args.no_draft else args.draft
    try:
        prompts, temps, configs = _choices(args, draft is not None)
    except ValueError as exc:
        print(f"specd bench: {exc}", file=sys.stderr)
        return 2
    if args.peer_draft and draft is None:
        print("specd bench: --peer-draft needs a draft model (drop --no-draft)",
              file=sys.stderr)
        return 2
    with_peer = args.peer or args.peer_lookup or args.peer_draft  # either implies --peer
    if with_peer:
        from specd.daemon.benchmark import llama_cpp

        try:
            llama_cpp.build(log=lambda s: print(f"specd bench: {s}", file=sys.stderr))
        except RuntimeError as exc:
            print(f"specd bench: --peer needs llama-server: {exc}", file=sys.stderr)
            return 1
    engine = Engine(EngineConfig(target=args.model, draft=draft,
                                 spec_type="draft" if draft else "none", n_ctx=args.n_ctx,
                                 threads=threads, draft_quant=args.draft_quant,
                                 draft_vocab=args.draft_vocab,
                                 spin=args.spin),
                    progress=ProgressBar())
    print(f"specd: {engine.runtime.describe()}", file=sys.stderr)
    from specd.daemon.benchmark.peer import DRAFT_MODES, MODES, LlamaServerPeer

    peer = (LlamaServerPeer(engine.target.path, threads, args.n_ctx,
                            draft_path=engine.draft.path if engine.draft else None)
            if with_peer else None)
    modes = (MODES[0],) + ((MODES[1],) if args.peer_lookup else ()) + (
        DRAFT_MODES if args.peer_draft and engine.draft else ())
    try:
        result = bench.run_bench(engine, prompts=prompts, temperatures=temps,
                                 max_tokens=args.max_tokens, repeats=args.repeats,
                                 configs=configs, peer=peer, peer_modes=modes,
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        if peer is not None:
            peer.close()
    weights = {"target": engine.target.built.read_bytes_per_token}
    if engine.draft is not None:
        weights["draft"] = engine.draft.built.read_bytes_per_token
    if peer is not None:
        weights[bench_report.PEER_TARGET] = engine.target.gguf.bytes_read_per_token()
    on_cpu = engine.runtime.device == "cpu"  # else RSS and host bandwidth say nothing
    summary = bench_report.summarize(
        result, bandwidth=bench.measure_bandwidth(threads=threads) if on_cpu else None,
        weight_bytes=weights, machine=bench_report.machine_description(),
        command="specd " + shlex.join(sys.argv[1:]), memory=on_cpu)
    for p in bench_report.write_outputs(summary, Path(args.out)):
        print(f"specd: wrote {p}", file=sys.stderr)
    print(bench_report.markdown_table(summary))
    return 0
