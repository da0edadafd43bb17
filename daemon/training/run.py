"""`specd train-draft` end to end: the head's shape, the distilled data, training, the
GGUF. Every stage keeps its state in the work folder, so `resume=True` goes on from
wherever an earlier run stopped (the data already made, the last checkpoint)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFFile

from . import KINDS, TrainError, require_torch
from .config import (
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_FEATURE_LAYERS,
    DEFAULT_MARKOV_RANK,
    DEFAULT_PARALLEL,
    HeadConfig,
    head_config,
)
from .corpus import sources_record
from .distill import DistillSpec, distill, load_split, target_sha

if TYPE_CHECKING:  # trainer imports torch, which only training loads
    from .trainer import TrainSettings

RUN_FILE = "run.json"  # the head and data a work folder is for
D2T_FILE = "d2t.npy"


@dataclass(frozen=True)
class TrainRequest:
    target: Path
    out: Path
    work: Path
    kind: str = "dflash"
    samples: int = 2000  # training replies
    eval_samples: int = 64
    max_prompt: int = 768
    max_reply: int = 256
    n_layer: int | None = None  # None: the kind's default (config.KIND_DEFAULTS)
    n_ff: int | None = None
    block_size: int | None = None
    gamma: float | None = None
    feature_layers: int = DEFAULT_FEATURE_LAYERS
    target_layers: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    markov_rank: int = DEFAULT_MARKOV_RANK  # DSpark's
    outtype: str = "f16"
    device: str = "cpu"  # specd's runtime device for the target (distillation)
    train_device: str = "auto"  # torch's
    threads: int | None = None
    parallel: int = DEFAULT_PARALLEL  # replies distilled at once
    seed: int = 0
    resume: bool = False
    exclude: Sequence[str] = ()  # prompts never to train on (specd bench's)
    settings: TrainSettings | None = None  # None: its defaults


@dataclass(frozen=True)
class TrainResult:
    head_path: Path | None  # None: stopped before the last step (settings.stop_at)
    config: HeadConfig
    history: list[dict[str, Any]]
    data: dict[str, Any]  # the distillation manifest's splits


def check_kind(kind: str) -> None:
    if kind in KINDS:
        return
    raise TrainError(f"--kind {kind}: unknown head kind (one of {', '.join(KINDS)})")


def _run_state(req: TrainRequest, cfg: HeadConfig, spec: DistillSpec) -> dict[str, Any]:
    return {"kind": req.kind, "head": cfg.to_dict(), "data": spec.to_dict()}


def train_draft(req: TrainRequest, log: Callable[[str], None] | None = None,
                verbose: bool = True) -> TrainResult:
    """Run (or resume) the whole training; TrainError says what stops it."""
    say = log or (lambda msg: print(f"specd: {msg}", file=sys.stderr))
    check_kind(req.kind)
    require_torch()
    f = GGUFFile(req.target)
    hp = read_hparams(f)
    cfg = head_config(f, hp, n_layer=req.n_layer, n_ff=req.n_ff, block_size=req.block_size,
                      gamma=req.gamma, feature_layers=req.feature_layers,
                      target_layers=req.target_layers, mask_token_id=req.mask_token_id,
                      draft_vocab=req.draft_vocab, kind=req.kind, markov_rank=req.markov_rank)
    spec = DistillSpec(target_sha(req.target), cfg.hidden_layers, req.max_prompt,
                       req.max_reply, req.seed)
    work = req.work
    state = _run_state(req, cfg, spec)
    run_file = work / RUN_FILE
    if run_file.is_file():
        old = json.loads(run_file.read_text())
        if not req.resume:
            raise TrainError(f"{work} holds an earlier run: pass --resume to go on with it, "
                             "or choose another --work-dir")
        if old != json.loads(json.dumps(state)):
            raise TrainError(f"{work} holds a run of another head or data ({old}); resume "
                             "it with the same options, or choose another --work-dir")
    else:
        work.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps(state, indent=1))
    say(f"head: {cfg.kind}, {cfg.n_layer} layer(s), width {cfg.n_embd}, block {cfg.block_size}"
        + (f", Markov rank {cfg.markov_rank}" if cfg.kind == "dspark" else "") + ", target "
        f"layers {list(cfg.target_layers)}, mask token {cfg.mask_token_id}, vocabulary "
        f"{cfg.draft_vocab}{' (d2t)' if cfg.reduced else ''}; work folder {work}")
    manifest = distill(req.target, work / "data", spec,
                       {"train": req.samples, "eval": req.eval_samples}, exclude=req.exclude,
                       device=req.device, threads=req.threads, parallel=req.parallel,
                       verbose=verbose)
    history, finished = _train(req, cfg, f, state, say, verbose)
    return TrainResult(req.out if finished else None, cfg, history, manifest["splits"])


def _train(req: TrainRequest, cfg: HeadConfig, f: GGUFFile, state: dict[str, Any],
           say: Callable[[str], None], verbose: bool) -> tuple[list[dict[str, Any]], bool]:
    """Train (or go on training) and, once the last step is reached, write the head."""
    import torch

    from .export import write_card_folder, write_head
    from .model import HEADS
    from .trainer import (
        Batches,
        TrainSettings,
        draft_vocabulary,
        set_threads,
        target_tables,
        torch_device,
        train,
        use_bf16,
    )

    settings = req.settings or TrainSettings()
    work = req.work
    train_set, eval_set = load_split(work / "data", "train"), load_split(work / "data", "eval")
    d2t_path = work / D2T_FILE
    if cfg.reduced and d2t_path.is_file():
        d2t: np.ndarray | None = np.load(d2t_path)
    else:
        d2t = draft_vocabulary(train_set, cfg)
        if d2t is not None:
            np.save(d2t_path, d2t)
    t2d = None
    if d2t is not None:
        t2d = np.full(cfg.target_vocab, -1, np.int64)
        t2d[d2t] = np.arange(len(d2t))
    used = np.unique(np.concatenate(
        [s.get(i)[0] for s in (train_set, eval_set) for i in range(len(s))]
        + [np.array([cfg.mask_token_id])]))
    embed, index, lm_rows = target_tables(f, cfg, used, d2t)
    device = torch_device(req.train_device)
    threads = set_threads(req.threads)
    say(f"training on {device}" + (f" with {threads} threads" if device.type == "cpu" else "")
        + (", bfloat16 autocast" if use_bf16(settings.precision, device) else ", float32")
        + f": {len(train_set)} training replies, {len(eval_set)} held out")
    torch.manual_seed(settings.seed)
    model = HEADS[cfg.kind](cfg, embed, index, lm_rows).to(device)
    batches = Batches(train_set, cfg, t2d, device)
    eval_blocks = Batches(eval_set, cfg, t2d, device).eval_windows(settings.eval_blocks)
    meta = {**state, "d2t": None if d2t is None else hashlib.sha256(d2t.tobytes()).hexdigest()}
    history, finished = train(model, batches, eval_blocks, settings, work, resume=req.resume,
                              meta=json.loads(json.dumps(meta)), log=say, verbose=verbose)
    if not finished:
        return history, False
    recipe = {"target": Path(req.target).name, "kind": req.kind, **{
        k: v for k, v in dataclasses.asdict(req).items()
        if k in ("samples", "eval_samples", "max_prompt", "max_reply", "seed")},
        "settings": settings.to_dict(), "held_out": history[-1]}
    card = work / "export"
    write_card_folder(card, cfg, f, sources_record(), recipe)
    head = write_head(req.out, cfg, model.gguf_tensors(), d2t,
                      None if d2t is None else lm_rows, req.target, card, req.outtype)
    say(f"wrote {req.out}: {head.kind} head, {head.n_layer} layer(s), target layers "
        f"{list(head.target_layers)}; held-out τ {history[-1]['tau']:.3f} (before training "
        f"{history[0]['tau']:.3f})")
    return history, True
