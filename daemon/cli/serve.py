"""`specd serve`: the daemon in the foreground, with logs."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from specd.daemon.text.reasoning import REASONING_FORMATS

from .generate import engine_config_from_args
from .options import (
    add_history_args,
    build_progress,
    history_bound_bytes,
    int_at_least,
    settle_draft,
    split_drafter,
)

if TYPE_CHECKING:
    from specd.daemon.control.log_file import LogRotation
    from specd.daemon.serving.served_models import ServedModel
    from specd.daemon.serving.upstream import UpstreamSpec


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from specd.ipc.server import DEFAULT_PORT

    p.add_argument("--host", default="127.0.0.1", help="TCP address (default 127.0.0.1)")
    # the bounds `specd config set` checks too
    from specd.daemon.control.config import DEFAULT_SLOTS, RANGES

    p.add_argument("--port", type=int_at_least(*RANGES["port"]), default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--socket", default=None, help="Unix socket path (default: runtime dir)")
    p.add_argument("--no-socket", action="store_true", help="TCP only")
    p.add_argument("--slots", type=int_at_least(*RANGES["slots"]), default=DEFAULT_SLOTS,
                   help=f"parallel sequences (default {DEFAULT_SLOTS})")
    p.add_argument("-b", "--batch-size", type=int_at_least(1), default=256,
                   help="most prompt tokens one pass evaluates (prompt chunks; default 256)")
    p.add_argument("--queue", type=int_at_least(1), default=64,
                   help="most queued requests (then 503)")
    p.add_argument("--require-token", action="store_true",
                   help="require the bearer token (state dir file) on TCP")
    p.add_argument("--api-key", default=None,
                   help="API keys (comma-separated) admitted on TCP as the token is, as "
                   "Authorization: Bearer <key> or X-Api-Key: <key>; every TCP client then "
                   "needs one or the token (llama-server's --api-key; other local users "
                   "can read a command line: prefer --api-key-file)")
    p.add_argument("--api-key-file", default=None,
                   help="a file of API keys, one a line (# starts a comment), as --api-key")
    p.add_argument("--allow-non-loopback", action="store_true",
                   help="allow a non-loopback --host (a token is then always required)")
    p.add_argument("--allow-other-users", action="store_true",
                   help="serve every local OS user on loopback TCP without the token "
                   "(default: the daemon's own user; others need the token)")
    p.add_argument("--max-connections", type=int_at_least(1), default=512,
                   help="most connections open at once; more are answered 503 "
                   "(default 512, fewer where the open-file limit is low)")
    p.add_argument("--allow-origin", action="append", default=[],
                   help="a browser Origin allowed to call the API (repeatable)")
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request naming another model (default: any name, "
                   "or none, gets the loaded model, as llama-server does)")
    p.add_argument("-a", "--alias", default=None,
                   help="the served model's names, comma-separated (the first in sorted "
                   "order is what /v1/models and responses call it; default: the GGUF's)")
    p.add_argument("--tags", default=None,
                   help="tags /v1/models lists for the model, comma-separated")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a Jinja chat template used instead of the GGUF's")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="variables for the chat template, a JSON object (e.g. "
                   "'{\"enable_thinking\": false}'); a request's chat_template_kwargs "
                   "override them")
    p.add_argument("--reasoning", choices=["on", "off", "auto"], default="auto",
                   help="on / off: the chat template's enable_thinking, unless a request "
                   "sets it; auto (default): the template's own default")
    p.add_argument("--reasoning-format", choices=list(REASONING_FORMATS), default="auto",
                   help="how a reply's <think> reasoning is returned, unless a request's "
                   "reasoning_format says: none leaves it in the content; deepseek and auto "
                   "(default) return it apart (reasoning_content, thinking blocks, ...)")
    p.add_argument("--reasoning-budget", type=int_at_least(-1), default=-1, metavar="N",
                   help="tokens a reply may reason for before its think tag is closed for "
                   "it, unless a request says (thinking_budget_tokens, Anthropic's "
                   "thinking.budget_tokens): -1 (default) no limit, 0 closed at once")
    p.add_argument("--reasoning-budget-message", default="", metavar="TEXT",
                   help="text written before the think tag a spent budget closes, unless a "
                   "request's reasoning_budget_message says (default: none)")
    p.add_argument("--embeddings", action="store_true",
                   help="serve /v1/embeddings and /embeddings from the target's last hidden "
                   "state (its graph then outputs it: built once more)")
    p.add_argument("--embedding-model", default=None, metavar="MODEL",
                   help="serve the embeddings routes from this model (a GGUF path or "
                   "catalog name, with its own tokenizer) instead of the target; implies "
                   "--embeddings")
    p.add_argument("--pooling", choices=["mean", "cls", "last", "none"], default=None,
                   help="how embeddings pool the tokens' states (default: the model's own, "
                   "else mean; none: one vector per token, /embeddings only)")
    p.add_argument("--upstream", action="append", default=[], metavar="NAME=URL",
                   help="serve model NAME by forwarding to the OpenAI-compatible server at "
                   "URL (vLLM, SGLang, llama-server; repeatable): a request naming NAME, in "
                   "any dialect, goes there")
    p.add_argument("--upstream-token-file", action="append", default=[],
                   metavar="NAME=PATH",
                   help="the bearer token upstream NAME requires, read from a file only "
                   "you can read (repeatable)")
    p.add_argument("--models", action="append", default=[], metavar="[ALIAS=]MODEL,...",
                   help="more local models served by name (catalog names or GGUF paths, "
                   "each answering to ALIAS too where given; repeatable): each is loaded "
                   "on the first request naming it, with the drafter measured fastest for "
                   "it, and -m's model serves any other name")
    p.add_argument("--no-models-autoload", action="store_true",
                   help="load a model only when asked to (/models/load, `specd load "
                   "NAME`); a request naming a model that is not loaded is refused")
    p.add_argument("--start-unloaded", action="store_true",
                   help="build -m's model's graphs at start but load it on its first "
                   "request (or /models/load): no memory held until then")
    p.add_argument("--no-store-models", action="store_true",
                   help="serve by name only -m's model and --models' (default: every "
                   "model pulled into the store too, each loaded on first use)")
    p.add_argument("--models-preset", default=None, metavar="FILE",
                   help="llama-server's model presets: an INI file, one [section] per "
                   "model name, its keys llama-server's arguments (model or hf-repo, "
                   "ctx-size, temp, ...; [*]: every section's); each section is a model "
                   "served by its name. GET /models?reload=1 reads it again")
    p.add_argument("--models-max", type=int_at_least(1), default=1, metavar="N",
                   help="most local models loaded at once (default 1): loading another "
                   "first unloads the one used longest ago, once its requests end")
    p.add_argument("--keep-alive", type=duration, default=DEFAULT_KEEP_ALIVE,
                   metavar="DURATION",
                   help="unload the model (its memory back to the system) once no request "
                   "has run for this long; the next request reloads it from the graph "
                   "cache. Seconds or a duration such as 5m or 1h (default "
                   f"{DEFAULT_KEEP_ALIVE}, as Ollama's); 0: as soon as idle; negative: "
                   "never. An Ollama request's keep_alive overrides it")
    add_history_args(p)
    p.add_argument("--history-file", default=None, metavar="PATH",
                   help="keep the history across restarts in this file, which must lie "
                   "under the state dir and be readable by you alone (mode 0600); "
                   "default: in memory only")
    p.add_argument("--no-fit", action="store_true",
                   help="use -c and --slots as given instead of the measured memory plan")


DEFAULT_KEEP_ALIVE = "5m"
log = logging.getLogger("specd.serving")


def duration(text: str) -> float:
    """--keep-alive's value in seconds (durations.parse_duration)."""
    from specd.daemon.serving.durations import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def plan_memory(args: argparse.Namespace) -> dict | None:
    """Fit the context and slots to measured memory (-c is the upper bound); may drop the
    draft, with a warning. Returns the plan for /props."""
    from specd.daemon.models.building import fit_models
    from specd.daemon.models.store import ProgressBar

    if args.no_fit:
        return None
    from specd.daemon.drafters.registry import MODEL_SPEC_TYPES, SPEC_TYPE_REGISTRY
    from specd.memory_fit.plan import DEFAULT_MIN_CTX
    from specd.ort_models.graph_builder import ATTN_BUCKET
    from specd.ort_models.runner import round_up

    uses_draft = args.spec_type == "auto" or args.spec_type in MODEL_SPEC_TYPES
    # -c as the runner takes it (whole buckets, rounded up), and no smaller floor than it
    max_ctx = None if args.n_ctx is None else round_up(args.n_ctx, ATTN_BUCKET)

    def fit_with(draft: str | None, also: str | None = None) -> Any:
        plan, _ = fit_models(args.model, draft, also_draft=also, device=args.device,
                             slots=args.slots, max_ctx=max_ctx,
                             min_ctx=min(DEFAULT_MIN_CTX, max_ctx or DEFAULT_MIN_CTX),
                             threads=args.threads, fetch=not args.no_fetch,
                             draft_quant=args.draft_quant, draft_vocab=args.draft_vocab,
                             build_progress=build_progress,
                             progress=ProgressBar(), embedding_model=args.embedding_model,
                             mmproj=getattr(args, "mmproj", None) or "auto",
                             history_bytes=history_bound_bytes(args))
        return plan

    also = getattr(args, "also_draft", None)
    plan = fit_with(args.draft, also) if uses_draft else fit_with(None)
    # a drafter chosen by measurement that does not fit: the next fastest that does
    for fallback in getattr(args, "draft_fallbacks", ()) if plan.draft_dropped else ():
        second = fit_with(*split_drafter(fallback))
        if not second.draft_dropped:
            chosen = args.draft + (f"+{also}" if also else "")
            print(f"specd: {chosen} does not fit in memory beside the target; "
                  f"{fallback}, measured next fastest, does", file=sys.stderr)
            (args.draft, args.also_draft), plan = split_drafter(fallback), second
            break
    for w in plan.warnings:
        print(f"specd: warning: {w}", file=sys.stderr)
    print(f"specd: memory plan: n_ctx {plan.n_ctx}, slots {plan.slots}"
          + (", draft dropped" if plan.draft_dropped else ""), file=sys.stderr)
    args.n_ctx, args.slots = plan.n_ctx, plan.slots
    if plan.draft_dropped:
        args.draft = args.also_draft = None
        spec = SPEC_TYPE_REGISTRY.get(args.spec_type)
        if args.spec_type == "auto" or (spec is not None and spec.chains_lookup):
            args.spec_type = "ngram"  # the lookup half needs no memory
        else:
            args.spec_type = "none"
    return plan.as_dict()


def _names(value: str | None) -> list[str]:
    """A comma-separated list's distinct, non-empty names."""
    return sorted({n.strip() for n in (value or "").split(",") if n.strip()})


def served_models(args: argparse.Namespace, first: Any) -> Any:
    """The daemon's local models: `first` (-m's, built), those of --models and the store's
    (unless --no-store-models), each built on its first request from a copy of `args`
    (taken before -m's draft was settled) naming it, with its own drafter and memory
    plan."""
    from specd.daemon.serving.served_models import ServedModels

    base = copy.copy(args)

    def build(model: ServedModel) -> Any:
        a = copy.copy(base)
        a.model, a.draft, a.spec_type, a.alias = model.ref, None, "auto", model.alias
        a.start_unloaded = False  # built for a request: it loads now
        # what -m's model alone was given: its drafter, names, template, embedding model
        a.tags = a.chat_template_file = a.embedding_model = None
        a.mmproj = None  # its own projector: the catalog's, or one beside its file
        if model.preset is not None:
            apply_preset(a, base, model.preset.flags)
            if model.draft is not None:
                a.draft = [model.draft]
            a.alias = ",".join(filter(None, [model.alias, *model.preset.aliases]))
        settle_draft(a)
        plan_memory(a)
        return build_service(a)

    refs = [ref.strip() for spec in args.models for ref in spec.split(",") if ref.strip()]
    served = ServedModels(first, refs, build, max_loaded=args.models_max,
                          autoload=not args.no_models_autoload)
    if not args.no_store_models:
        served.add_missing(store_targets())
    if args.models_preset:
        from .model_presets import read_presets

        path = Path(args.models_preset).expanduser()
        served.use_presets(lambda: read_presets(path, preset_parser().parse_args))
    return served


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors are ValueErrors (a preset's flags are not the command
    line: a bad one is the preset file's error, not a usage message and an exit)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def preset_parser() -> argparse.ArgumentParser:
    """`specd serve`'s options alone, for a preset's flags."""
    from .main import _add_model_args, _add_sampling_args

    p = _RaisingParser(prog="preset", add_help=False, exit_on_error=False)
    _add_model_args(p)
    _add_sampling_args(p)
    add_serve_args(p)
    return p


def apply_preset(a: argparse.Namespace, given: argparse.Namespace,
                 flags: tuple[str, ...]) -> None:
    """Set on `a` the options a preset's `flags` give, but those the command line
    (`given`) set itself, which win as llama-server's router's arguments do."""
    parser = preset_parser()
    defaults, preset = parser.parse_args([]), parser.parse_args(list(flags))
    for name, value in vars(preset).items():
        default = getattr(defaults, name)
        if value == default:
            continue
        if getattr(given, name, default) != default:
            log.info("preset option %s=%r overridden by the command line's %r", name, value,
                     getattr(given, name))
            continue
        setattr(a, name, value)


def store_targets() -> list[str]:
    """The catalog models pulled into the store that run as a target (not heads)."""
    from specd.daemon.models.catalog import CATALOG
    from specd.daemon.models.store import list_local

    return [name for name, _, _ in list_local()
            if CATALOG[name].runnable and CATALOG[name].head_for is None]


def build_service(args: argparse.Namespace):
    from specd.daemon.models.store import ProgressBar
    from specd.daemon.serving.engine import Engine
    from specd.daemon.serving.scheduler import Scheduler
    from specd.daemon.serving.service import Service

    cfg = engine_config_from_args(args, slots=args.slots)
    cfg.embeddings = args.embeddings or args.embedding_model is not None
    cfg.pooling, cfg.embedding_model = args.pooling, args.embedding_model
    cfg.aliases, cfg.tags = _names(args.alias), _names(args.tags)
    cfg.chat_template, cfg.template_kwargs = chat_template_options(args)
    cfg.reasoning_format = args.reasoning_format
    cfg.reasoning_budget = args.reasoning_budget
    cfg.reasoning_budget_message = args.reasoning_budget_message
    cfg.history, cfg.history_file = args.history, args.history_file
    if args.history_tokens is not None:
        cfg.history_tokens = args.history_tokens
    engine = Engine(cfg, progress=ProgressBar(), build_progress=build_progress)
    if getattr(args, "start_unloaded", False):
        engine.unload()  # built and measured; its sessions open on the first request
    return Service(engine, Scheduler(engine, max_queue=args.queue,
                                     prefill_chunk=args.batch_size,
                                     keep_alive=args.keep_alive))


def run(args: argparse.Namespace) -> int:
    from specd.ipc.http.app import create_app
    from specd.ipc.http.state import SERVICE
    from specd.ipc.server import (
        ServeConfig,
        check_free,
        default_socket_path,
        serve_access,
        serve_forever,
    )

    logging.getLogger("specd").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    scfg = ServeConfig(host=args.host, port=args.port,
                       socket_path=None if args.no_socket else Path(args.socket)
                       if args.socket else default_socket_path(),
                       require_token=args.require_token, api_keys=api_keys(args),
                       allow_non_loopback=args.allow_non_loopback,
                       allowed_origins=set(args.allow_origin),
                       allow_other_users=args.allow_other_users,
                       max_connections=args.max_connections)
    access = serve_access(scfg)
    forwarded = upstreams(args)
    check_free(scfg)  # before minutes of loading
    given = copy.copy(args)  # before -m's drafter and plan: what --models' models start from
    settle_draft(args)
    memory_plan = plan_memory(args)
    service = build_service(args)
    print(f"specd: {service.engine.runtime.describe()}", file=sys.stderr)
    if service.engine.draft_choice:
        print(f"specd: {service.engine.draft_choice}", file=sys.stderr)
    d = service.engine.describe()
    print(f"specd: target {d['target']['name']}, spec {d['spec_type']}"
          + (f", draft {d['draft']['name']}" if "draft" in d else "")
          + (f", head {d['head']['name']}" if "head" in d else "")
          + f", n_ctx {d['n_ctx']}, slots {d['slots']}", file=sys.stderr, flush=True)
    app = create_app(service, allowed_origins=scfg.allowed_origins, access=access,
                     memory_plan=memory_plan, strict_model_name=args.strict_model_name,
                     upstreams=forwarded, models=served_models(given, service))
    for u in forwarded:
        print(f"specd: model {u.name} forwarded to {u.url}"
              + (" (with a token)" if u.token else ""), file=sys.stderr)
    rotation = _log_rotation(args)
    try:
        asyncio.run(serve_forever(app, scfg))
    except KeyboardInterrupt:
        pass
    finally:
        app[SERVICE].stop()
        if rotation is not None:
            rotation.stop()
    return 0


def chat_template_options(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """--chat-template-file's text, and the template variables of --chat-template-kwargs
    and --reasoning."""
    template = (Path(args.chat_template_file).read_text(encoding="utf-8")
                if args.chat_template_file else None)
    kwargs: dict[str, Any] = {}
    if args.chat_template_kwargs:
        try:
            given = json.loads(args.chat_template_kwargs)
        except ValueError:
            given = None
        if not isinstance(given, dict):
            raise ValueError("--chat-template-kwargs: not a JSON object: "
                             f"{args.chat_template_kwargs!r}")
        kwargs = given
    if args.reasoning != "auto":
        kwargs["enable_thinking"] = args.reasoning == "on"
    return template, kwargs


def upstreams(args: argparse.Namespace) -> list[UpstreamSpec]:
    """--upstream's models, each with its --upstream-token-file's token."""
    from specd.daemon.serving.upstream import UpstreamSpec
    from specd.ipc.security import read_secret_file

    tokens: dict[str, str] = {}
    for spec in args.upstream_token_file:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--upstream-token-file {spec!r}: expected NAME=PATH")
        tokens[name.strip()] = read_secret_file(Path(path.strip()).expanduser(),
                                                f"--upstream-token-file {name.strip()}")
    out = [UpstreamSpec.parse(spec) for spec in args.upstream]
    names = [u.name for u in out]
    if len(set(names)) < len(names):
        raise ValueError("--upstream: a NAME is given twice")
    if unknown := sorted(tokens.keys() - set(names)):
        raise ValueError(f"--upstream-token-file {unknown[0]}: no --upstream of that name")
    return [UpstreamSpec(u.name, u.url, tokens.get(u.name)) for u in out]


def api_keys(args: argparse.Namespace) -> frozenset[str]:
    """--api-key's keys and --api-key-file's lines (not blank, not # comments)."""
    keys = [k.strip() for k in (args.api_key or "").split(",")]
    if args.api_key_file:
        lines = Path(args.api_key_file).read_text().splitlines()
        keys += [k.strip() for k in lines if not k.strip().startswith("#")]
    return frozenset(k for k in keys if k)


def _log_rotation(args: argparse.Namespace) -> LogRotation | None:
    """`--log-file` (what `specd start` passes): the log rotated by size while serving."""
    from specd.daemon.control.log_file import LogRotation
    from specd.daemon.control.service_control import LOG_MAX_BYTES

    if not getattr(args, "log_file", None):
        return None
    rotation = LogRotation(Path(args.log_file), LOG_MAX_BYTES)
    return rotation if rotation.start() else None
