"""`specd bench`: the benchmark suite (JSON, markdown table, PNG plot)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from .catalog import DEFAULT_DRAFT, DEFAULT_TARGET
    from .cli_fit import add_draft_quant_arg, add_spin_arg

    b = sub.add_parser("bench", help="benchmark speculation configurations (and llama.cpp)")
    b.add_argument("-m", "--model", default=DEFAULT_TARGET)
    b.add_argument("-md", "--model-draft", dest="draft", default=DEFAULT_DRAFT)
    b.add_argument("--no-draft", action="store_true", help="benchmark without a draft model")
    add_draft_quant_arg(b)
    add_spin_arg(b)
    b.add_argument("-t", "--threads", type=int, default=None)
    b.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=2048)
    b.add_argument("-n", "--max-tokens", type=int, default=256)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--prompts", default="code,refactor,prose")
    b.add_argument("--temperatures", default="0,0.7")
    b.add_argument("--configs", default=None,
                   help="comma-separated: target-only, draft n_max=K, draft adaptive, "
                        "ngram n_max=K, ngram adaptive (default: a set of each)")
    b.add_argument("--peer", action="store_true", help="also run llama.cpp (llama-cpp-python)")
    b.add_argument("--peer-lookup", action="store_true",
                   help="also run llama-cpp-python's prompt-lookup decoding")
    b.add_argument("--peer-draft", action="store_true",
                   help="also run llama-cpp-python's speculative decoding with the same draft")
    b.add_argument("--out", default="bench-results", help="output folder")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..ort_models.runner import default_threads
    from . import bench
    from .engine import Engine, EngineConfig
    from .model_store import ProgressBar

    threads = args.threads or default_threads()
    draft = None if args.no_draft else args.draft
    engine = Engine(EngineConfig(target=args.model, draft=draft,
                                 spec_type="draft" if draft else "none", n_ctx=args.n_ctx,
                                 threads=threads, draft_quant=args.draft_quant,
                                 spin=args.spin),
                    progress=ProgressBar())
    print(f"specd: {engine.runtime.describe()}", file=sys.stderr)
    prompts = {k: bench.PROMPTS[k] for k in args.prompts.split(",")}
    temps = tuple(float(t) for t in args.temperatures.split(","))
    configs = bench.default_configs(draft is not None)
    if args.configs:
        try:
            configs = [bench.parse_config(n) for n in args.configs.split(",")]
        except ValueError as exc:
            print(f"specd bench: {exc}", file=sys.stderr)
            return 2
        if draft is None and any(c.spec == "draft" for c in configs):
            print("specd bench: draft configurations need a draft model", file=sys.stderr)
            return 2
    peer = (bench.PeerRunner(engine.target.path, threads, args.n_ctx,
                             draft_path=engine.draft.path if engine.draft else None)
            if args.peer else None)
    modes = ("target-only",) + (("lookup",) if args.peer_lookup else ()) + (
        (bench.PeerRunner.MODES[2],) if args.peer_draft and engine.draft else ())
    result = bench.run_bench(engine, prompts=prompts, temperatures=temps,
                             max_tokens=args.max_tokens, repeats=args.repeats,
                             configs=configs, peer=peer, peer_modes=modes,
                             log=lambda s: print(s, file=sys.stderr, flush=True))
    weights = {"target": engine.target.built.read_bytes_per_token,
               bench.PEER_TARGET: engine.target.gguf.bytes_read_per_token()}
    if engine.draft is not None:
        weights["draft"] = engine.draft.built.read_bytes_per_token
    summary = bench.summarize(result, bandwidth=bench.measure_bandwidth(),
                              weight_bytes=weights, machine=bench.machine_description(),
                              command="specd " + shlex.join(sys.argv[1:]))
    for p in bench.write_outputs(summary, Path(args.out)):
        print(f"specd: wrote {p}", file=sys.stderr)
    print(bench.markdown_table(summary))
    return 0
