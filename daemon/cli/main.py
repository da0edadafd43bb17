"""`specd` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from . import bench as cli_bench
from . import convert as cli_convert
from . import fit as cli_fit
from . import generate as cli_generate
from . import serve as cli_serve
from . import train as cli_train
from .options import add_draft_build_args, add_spin_arg, int_at_least

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from specd.daemon.models.catalog import DEFAULT_TARGET

    p.add_argument("-m", "--model", default=DEFAULT_TARGET,
                   help=f"target GGUF path or catalog name (default {DEFAULT_TARGET})")
    p.add_argument("-md", "--model-draft", dest="draft", action="append", default=None,
                   help="draft GGUF path or catalog name (a draft model or a drafter head); "
                        "given twice, a head and a draft model, each round drafting with the "
                        "one predicted faster (head+draft); left out, a catalog target gets "
                        "the drafter measured fastest beside it, where one was; none: no "
                        "draft")
    p.add_argument("-mm", "--mmproj", default=None,
                   help="multimodal projector GGUF (path or catalog name) for images in the "
                        "context; left out: the catalog's for the model, else an mmproj*.gguf "
                        "beside the model file that fits it; none: no images")
    add_draft_build_args(p)
    add_spin_arg(p)
    from specd.daemon.drafters.registry import SPEC_TYPES

    p.add_argument("--spec-type", default="auto", choices=SPEC_TYPES,
                   help="speculation: draft+ngram = the draft model and prompt lookup (each "
                        "round verifies the faster-predicted one); draft-dflash = a DFlash "
                        "head (-md head.gguf) and prompt lookup; head+draft = a head and a "
                        "draft model (-md twice) and prompt lookup; auto = picked by the -md "
                        "files (a head's kind, draft+ngram, head+draft), none without -md")
    p.add_argument("--spec-draft-n-max", dest="n_max", type=int, default=8,
                   help="most tokens drafted per round (default 8)")
    p.add_argument("--spec-draft-n-min", dest="n_min", type=int, default=0,
                   help="drafts shorter than this are not verified (default 0)")
    p.add_argument("--spec-draft-p-min", dest="p_min", type=float, default=0.0,
                   help="stop drafting when the draft's top probability is below this")
    p.add_argument("--spec-draft-probabilistic", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="sampled requests: sample drafts and verify by rejection sampling "
                        "(default; the target's distribution). --no-spec-draft-probabilistic"
                        ": propose the draft's argmax and keep it where the target's own draw "
                        "agrees (the tokens target-only decoding draws from the same seed, "
                        "accepted less often)")
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="choose the draft length (and source) per round from measured "
                        "acceptance and costs, up to --spec-draft-n-max (default: on; "
                        "--no-spec-adaptive drafts n-max every round)")
    p.add_argument("--spec-ngram-min", type=int, default=2)
    p.add_argument("--spec-ngram-max", type=int, default=4)
    p.add_argument("--spec-synthetic-rates", default=None,
                   help="synthetic acceptance: comma-separated per-position rates")
    p.add_argument("--spec-synthetic-mean", type=float, default=None,
                   help="synthetic acceptance: target mean acceptance length")
    from specd.daemon.control.config import RANGES
    from specd.daemon.serving.engine import DEFAULT_N_CTX

    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=int_at_least(*RANGES["n_ctx"]),
                   default=DEFAULT_N_CTX, help=f"context length per sequence (default "
                   f"{DEFAULT_N_CTX}; at most the model's trained context)")
    p.add_argument("-t", "--threads", type=int_at_least(0), default=None,
                   help="CPU threads (default, or 0: all the cores this process may use)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu or cuda[:N] (auto: $SPECD_DEVICE if set, else CUDA where "
                   "onnxruntime-gpu finds a GPU)")
    p.add_argument("--no-fetch", action="store_true", help="never download catalog models")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int_at_least(0), default=256,
                   help="most tokens to generate (default 256; 0: only evaluate the prompt)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0,
                   help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--backend-sampling", action=argparse.BooleanOptionalAction, default=True,
                   help="decide tokens in the models' graphs where specd's kernels run "
                        "(default: on; the same distributions, greedy the same tokens; only "
                        "token ids leave the session). --no-backend-sampling: on the host "
                        "from the logits. A request's \"backend_sampling\" overrides it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=(
        "Local speculative-decoding daemon: GGUF models on ONNX Runtime."))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("prompt", nargs="?", default=None, help="raw prompt text")
    g.add_argument("--chat", default=None, help="a user message, through the chat template")
    g.add_argument("--prompt-file", default=None, help="raw prompt text from a file (verbatim)")
    g.add_argument("--json", action="store_true", help="print the stats as JSON on stderr")
    g.set_defaults(func=cli_generate.run)

    sv = sub.add_parser("serve", help="run the daemon in the foreground")
    _add_model_args(sv)
    _add_sampling_args(sv)
    cli_serve.add_serve_args(sv)
    sv.add_argument("--log-file", default=None,
                    help="the file stdout and stderr are appended to, rotated to <file>.1 "
                    "past 10 MB (`specd start` passes its log)")
    sv.set_defaults(func=cli_serve.run)

    from specd.tray.app import add_tray_command

    from .service import add_service_commands

    add_service_commands(sub, _add_model_args, _add_sampling_args, cli_serve.add_serve_args)
    add_tray_command(sub)

    cli_bench.add_bench_parser(sub)
    cli_fit.add_fit_parser(sub)
    cli_convert.add_convert_parser(sub)
    cli_train.add_train_parser(sub)

    models = sub.add_parser("models", help="the model catalog and local store")
    models.set_defaults(func=lambda a: _usage(models))
    msub = models.add_subparsers(dest="models_command", metavar="ACTION")
    ml = msub.add_parser("list", help="catalog models and which are downloaded")
    ml.add_argument("--json", action="store_true")
    ml.set_defaults(func=_models_list)
    mp = msub.add_parser("pull", help="download a catalog model (sha256 verified)")
    mp.add_argument("name")
    mp.set_defaults(func=_models_pull)
    mi = msub.add_parser("info", help="architecture, quant types, vocabulary, chat template; "
                                      "with --draft: can it draft for this model, and why not")
    mi.add_argument("name", help="catalog name or GGUF path")
    mi.add_argument("--draft", default=None, help="a draft model to check against it")
    mi.add_argument("--json", action="store_true")
    mi.add_argument("--no-fetch", action="store_true")
    mi.set_defaults(func=_models_info)
    mr = msub.add_parser("rm", help="remove a downloaded model")
    mr.add_argument("name")
    mr.set_defaults(func=_models_rm)
    return parser


def _models_list(args: argparse.Namespace) -> int:
    from specd.daemon.models.catalog import CATALOG
    from specd.daemon.models.store import model_path

    rows = [{"name": e.name, "size": e.size, "downloaded": model_path(e.name).is_file(),
             "packaged": e.packaged is not None, "description": e.description,
             "runnable": e.runnable}
            for e in CATALOG.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r, e in zip(rows, CATALOG.values(), strict=True):
            mark = "*" if r["downloaded"] else " "
            note = ("  [ships with specd]" if r["packaged"] else "" if r["runnable"] else
                    f"  [specd cannot run {e.arch} models yet: its tokenizer only]")
            print(f"{mark} {r['name']:32s} {e.size / 1e6:8.1f} MB  {r['description']}{note}")
    return EXIT_OK


def model_info(path: object) -> dict[str, object]:
    from collections import Counter

    from specd.ort_models.arch import READERS, read_hparams
    from specd.ort_models.gguf_file import GGUFFile

    f = GGUFFile(path)  # type: ignore[arg-type]
    types = Counter(t.type_name for t in f.tensors.values())
    tokens = f.get("tokenizer.ggml.tokens") or []
    if f.arch in READERS:
        hp = read_hparams(f)
        shape = {"layers": hp.n_layer, "embedding": hp.n_embd, "heads": hp.n_head,
                 "kv_heads": hp.n_head_kv, "head_dim": hp.head_dim,
                 "context_length": hp.n_ctx_train}
    else:  # what the metadata says, unchecked: specd cannot run it
        heads = f.arch_key("attention.head_count", None)
        shape = {"layers": f.arch_key("block_count", None),
                 "embedding": f.arch_key("embedding_length", None), "heads": heads,
                 "kv_heads": f.arch_key("attention.head_count_kv", heads),
                 "head_dim": f.arch_key("attention.key_length", None),
                 "context_length": f.arch_key("context_length", None)}
    return {
        "path": str(f.path), "files": [str(part.path) for part in f.parts],
        "file_bytes": f.file_bytes, "name": f.name, "architecture": f.arch,
        "runnable": f.arch in READERS, **shape,
        "tensor_types": dict(types.most_common()),
        "vocab": {"type": f.get("tokenizer.ggml.model"), "pre": f.get("tokenizer.ggml.pre"),
                  "size": len(tokens), "bos_id": f.get("tokenizer.ggml.bos_token_id"),
                  "eos_id": f.get("tokenizer.ggml.eos_token_id")},
        "chat_template": f.get("tokenizer.chat_template"),
    }


def _models_info(args: argparse.Namespace) -> int:
    from specd.daemon.models.compat import draft_incompatibilities
    from specd.daemon.models.store import ProgressBar, resolve_model
    from specd.ort_models.gguf_file import GGUFFile

    path = resolve_model(args.name, fetch=not args.no_fetch, progress=ProgressBar())
    info = model_info(path)
    problems = None
    if args.draft:
        dpath = resolve_model(args.draft, fetch=not args.no_fetch, progress=ProgressBar())
        problems = draft_incompatibilities(GGUFFile(path).metadata, GGUFFile(dpath).metadata)
        info["draft"] = {"path": str(dpath), "compatible": not problems, "problems": problems}
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        v = info["vocab"]
        assert isinstance(v, dict)
        files = info["files"]
        assert isinstance(files, list)
        split = f", {len(files)} parts" if len(files) > 1 else ""
        print(f"{info['name']}  ({info['path']}{split}, {info['file_bytes']:,} bytes)")
        print(f"  architecture   {info['architecture']}: {info['layers']} layers, embedding "
              f"{info['embedding']}, {info['heads']} heads / {info['kv_heads']} kv, head dim "
              f"{info['head_dim']}, trained context {info['context_length']}"
              + ("" if info["runnable"] else f"  [specd cannot run {info['architecture']} "
                 "models yet]"))
        types = info["tensor_types"]
        assert isinstance(types, dict)
        print("  tensor types   " + ", ".join(f"{k} x{n}" for k, n in types.items()))
        print(f"  vocabulary     {v['type']} (pre {v['pre']}), {v['size']} tokens, "
              f"BOS {v['bos_id']}, EOS {v['eos_id']}")
        tmpl = info["chat_template"]
        print("  chat template  " + ("none" if not tmpl else f"{len(str(tmpl))} chars"))
        if problems is not None:
            if problems:
                print(f"  draft {args.draft}: NOT compatible:")
                for p in problems:
                    print(f"    - {p}")
            else:
                print(f"  draft {args.draft}: compatible")
    return EXIT_OK if not problems else EXIT_ERROR


def _models_pull(args: argparse.Namespace) -> int:
    from specd.daemon.models.store import ProgressBar, pull

    print(pull(args.name, progress=ProgressBar()))
    return EXIT_OK


def _models_rm(args: argparse.Namespace) -> int:
    from specd.daemon.models.store import remove

    if remove(args.name):
        print(f"removed {args.name}")
        return EXIT_OK
    print(f"{args.name} is not downloaded", file=sys.stderr)
    return EXIT_ERROR


def _usage(parser: argparse.ArgumentParser) -> int:
    """A command given without its action: that command's help."""
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="specd: %(message)s", stream=sys.stderr)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `specd generate ... | head`: the reader has what it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return EXIT_OK
    except Exception as exc:  # one clear line, no traceback for users
        from specd.daemon.models.store import ModelStoreError
        from specd.daemon.serving.engine import EngineError
        from specd.daemon.spec.generation import RequestError
        from specd.memory_fit.measure import MeasureError
        from specd.memory_fit.plan import FitError
        from specd.memory_fit.probes import ProbeError
        from specd.ort_models.gguf_file import GGUFError
        from specd.ort_models.providers import DeviceUnavailable
        from specd.ort_models.runner import GraphLoadError

        if args.verbose or not isinstance(
                exc, GGUFError | EngineError | ModelStoreError | RequestError | FitError
                | ProbeError | MeasureError | GraphLoadError | DeviceUnavailable | ValueError
                | OSError | ImportError):
            raise
        print(f"specd: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
