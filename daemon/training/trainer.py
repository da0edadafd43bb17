"""Training a DFlash, DSpark or EAGLE-3 head on distilled sequences (PyTorch;
`specd[train]`).

The recipe of DFlash / SpecForge: per step, a few sequences and a few anchors among each
one's reply positions; block = [token at the anchor, MASK × (B - 1)], attending to the
context before the anchor (the target's features) and within itself; the block's j-th
draft (j = 0, 1, ...) is labelled with the target's own token at anchor + 1 + j (its
greedy reply), weighted exp(-j / γ), with the kind's loss (`HeadModel.loss`: cross-entropy;
DSpark's DeepSpec mix). EAGLE-3 unrolls its steps instead of a block (model.Eagle3Head). AdamW,
linear warm-up over the first 4% of steps, cosine decay to a tenth; the target's
embeddings and LM head frozen. Labels outside a reduced draft vocabulary count as misses
and carry no token loss.

The held-out estimate: on fixed anchors of the evaluation split, the mean acceptance
length τ = 1 + the drafts of a full block that match the target's reply before the first
miss, as greedy verification would accept them. Checkpoints (`ckpt.pt` in the
work folder) hold the weights, the optimizer and the RNGs, so `--resume` goes on exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specd.ort_models.gguf_file import GGUFFile, TensorInfo
from specd.ort_models.runner import default_threads

from . import TrainError
from .config import HeadConfig
from .distill import Sequences
from .model import HeadModel
from .progress import ProgressLine, duration

CHECKPOINT = "ckpt.pt"
HISTORY = "history.json"
WARMUP = 0.04  # of the steps
EVAL_WINDOW = 64  # reply positions decoding is played through, per held-out sequence
MIN_LR = 0.1  # of the peak, at the end of the cosine


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2000
    lr: float = 6e-4
    batch_seqs: int = 2  # sequences per step
    anchors: int = 16  # blocks per sequence
    eval_blocks: int = 1024  # held-out blocks (anchors) per estimate
    eval_every: int = 0  # steps between estimates (0: a tenth of the run)
    save_every: float = 300.0  # seconds between checkpoints
    stop_at: int = 0  # end this invocation at this step, checkpointed (0: at `steps`)
    seed: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # "auto": bfloat16 autocast where the device computes it natively (CUDA; CPUs with
    # AVX-512 BF16: 1.8x faster steps measured), else float32; "fp32" / "bf16" force it
    precision: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def torch_device(name: str = "auto") -> torch.device:
    """"auto": CUDA where torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TrainError(f"--train-device {name}: this torch sees no CUDA device "
                         f"(torch {torch.__version__})")
    return torch.device(name)


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether the forward passes run under bfloat16 autocast (TrainSettings.precision)."""
    if precision not in ("auto", "fp32", "bf16"):
        raise TrainError(f"--precision {precision!r}: auto, fp32 or bf16")
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # torch >= 2.1
    return bool(probe is not None and probe())


def dequantize_rows(t: TensorInfo, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of a GGUF matrix as float32 [len(rows), cols] (any type gguf reads)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n = t.shape[0]
    raw = np.asarray(t.data).reshape(n, -1)  # [rows, bytes per row]
    out = np.empty((len(rows), t.shape[1]), np.float32)
    qtype = GGMLQuantizationType(t.ggml_type)
    for i in range(0, len(rows), 4096):  # chunks: a whole vocabulary at once is GBs
        part = raw[rows[i:i + 4096]]
        out[i:i + 4096] = dequantize(part, qtype).reshape(len(part), -1)
    return out


def draft_vocabulary(train: Sequences, cfg: HeadConfig) -> np.ndarray | None:
    """The draft vocabulary (target ids ascending: `d2t`) of a reduced head: the
    cfg.draft_vocab ids most often in the training replies; None: the whole vocabulary."""
    if not cfg.reduced:
        return None
    counts = np.zeros(cfg.target_vocab, np.int64)
    for i in range(len(train)):
        tokens, reply, _ = train.get(i)
        np.add.at(counts, tokens[reply:], 1)
    order = np.argsort(-counts, kind="stable")[:cfg.draft_vocab]
    return np.sort(order).astype(np.int64)


def target_tables(target: GGUFFile, cfg: HeadConfig, used: np.ndarray,
                  d2t: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(embedding rows [len(used), E] of the ids `used`, index [target vocab] of each id's
    row, LM head rows [Vd, E] of the draft vocabulary), dequantized from the target."""
    embd = target.tensor("token_embd.weight")
    out = target.tensor("output.weight") if target.has_tensor("output.weight") else embd
    index = np.zeros(cfg.target_vocab, np.int64)
    index[used] = np.arange(len(used))
    draft_ids = np.arange(cfg.target_vocab) if d2t is None else d2t
    scale = target.arch_key("embedding_scale")  # none of the trained architectures has one
    embed = dequantize_rows(embd, used)
    if isinstance(scale, int | float) and scale:
        embed *= float(scale)
    return embed, index, dequantize_rows(out, draft_ids)


class Batches:
    """Random (sequence, anchors) batches of a split, and fixed evaluation blocks."""

    def __init__(self, data: Sequences, cfg: HeadConfig, t2d: np.ndarray | None,
                 device: torch.device) -> None:
        self.data, self.cfg, self.t2d, self.device = data, cfg, t2d, device
        lengths, reply = data.lengths(), data.reply_lengths()
        self.usable = np.flatnonzero(reply >= 2)  # an anchor and a label at least
        if not len(self.usable):
            raise TrainError("no sequence has a reply of two tokens or more")
        weights = reply[self.usable].astype(np.float64)
        self.p = weights / weights.sum()
        self.lengths = lengths

    def sample(self, rng: np.random.Generator, n_seqs: int, n_anchors: int
               ) -> dict[str, torch.Tensor]:
        seqs = rng.choice(self.usable, size=n_seqs, p=self.p)
        picks = []
        for i in seqs:
            _, reply, _ = self.data.get(int(i))
            # positions with a label after: the reply's, and the prompt's last token, which
            # llama.cpp anchors its first block on (its prompt pass leaves that token out)
            candidates = np.arange(max(reply - 1, 1), self.lengths[i] - 1)
            k = min(n_anchors, len(candidates))
            picks.append((int(i), np.sort(rng.choice(candidates, size=k, replace=False))))
        return self.make(picks)

    def eval_windows(self, n_blocks: int) -> list[dict[str, torch.Tensor]]:
        """Fixed held-out batches: windows of EVAL_WINDOW reply positions (the first of
        each sequence's reply, as many sequences as n_blocks anchors allow), a block at
        every position, so that decoding can be played through them."""
        width = max(EVAL_WINDOW, 4 * self.cfg.block_size)
        picks: list[tuple[int, np.ndarray]] = []
        total = 0
        for i in self.usable:
            if total >= n_blocks:
                break
            _, reply, _ = self.data.get(int(i))
            anchors = np.arange(reply, min(reply + width, self.lengths[i] - 1))
            picks.append((int(i), anchors))
            total += len(anchors)
        return [self.make(picks[j:j + 4]) for j in range(0, len(picks), 4)]

    def make(self, picks: list[tuple[int, np.ndarray]]) -> dict[str, torch.Tensor]:
        """Tensors of sequences `picks` [(index, anchors)]: context features up to the
        last anchor and the tokens through it, anchors, their tokens, labels [b, N, S] as
        draft ids (-1: no label or outside the draft vocabulary), which labels exist, and
        the target token before each label (DSpark's Markov input, EAGLE-3's step input)."""
        slots = self.cfg.n_slots
        b, n = len(picks), max(len(a) for _, a in picks)
        t = max(int(a.max()) for _, a in picks)
        feats = np.zeros((b, t, self.cfg.feature_width), np.float32)
        ctx_tokens = np.zeros((b, t + 1), np.int64)
        anchors = np.full((b, n), -1, np.int64)
        anchor_tokens = np.zeros((b, n), np.int64)
        labels = np.full((b, n, slots), -1, np.int64)
        exists = np.zeros((b, n, slots), bool)
        prev = np.zeros((b, n, slots), np.int64)
        for j, (i, a) in enumerate(picks):
            tokens, _, f = self.data.get(i)
            end = int(a.max())
            feats[j, :end] = f[:end]
            ctx_tokens[j, :end + 1] = tokens[:end + 1]
            anchors[j, :len(a)] = a
            anchor_tokens[j, :len(a)] = tokens[a]
            at = a[:, None] + np.arange(1, slots + 1)  # [n_a, S] label positions
            ok = at < len(tokens)
            ids = tokens[np.minimum(at, len(tokens) - 1)]
            exists[j, :len(a)] = ok
            prev[j, :len(a)] = tokens[np.minimum(at - 1, len(tokens) - 1)]
            drafted = ids if self.t2d is None else self.t2d[ids]
            labels[j, :len(a)] = np.where(ok, drafted, -1)
        d = self.device
        return {"feats": torch.from_numpy(feats).to(d), "anchors": torch.from_numpy(anchors).to(d),
                "anchor_tokens": torch.from_numpy(anchor_tokens).to(d),
                "labels": torch.from_numpy(labels).to(d), "exists": torch.from_numpy(exists).to(d),
                "prev": torch.from_numpy(prev).to(d), "tokens": torch.from_numpy(ctx_tokens).to(d)}


def block_loss(model: HeadModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The batch's position-weighted loss (the head kind's own), and the labels it counted."""
    rows = model.rows(batch)  # [b, N, S, E]
    labels = batch["labels"]  # [b, N, S]
    slot = torch.arange(model.cfg.n_slots, device=labels.device).expand_as(labels)
    weight = torch.exp(-slot.to(torch.float32) / model.cfg.gamma)  # draft j: exp(-j / γ)
    return model.loss(rows, batch, weight)


@torch.no_grad()
def acceptance(model: HeadModel, windows: list[dict[str, torch.Tensor]], bf16: bool = False
               ) -> dict[str, Any]:
    """Held-out acceptance on the evaluation windows: τ, the mean acceptance length of
    greedy decoding played through each window (a round at the window's start drafts a
    full block, its drafts are accepted up to the first miss, the next round starts after
    the target's token), which weighs hard stretches as decoding does (a block an
    anchor drawn at random would overrate them); and, over every anchor, the share of
    first drafts that hit and the conditional acceptance per draft slot."""
    model.eval()
    rounds = accepted = 0
    slot_hits = np.zeros(model.cfg.n_slots)
    slot_seen = np.zeros(model.cfg.n_slots)
    device = batch_device(windows)
    for batch in windows:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            rows = model.rows(batch)
            # DSpark's chain on the target's tokens: its own argmax wherever the drafts
            # before a slot hit, the only slots that count
            pred = model.logits(rows, batch["prev"]).argmax(-1)  # [b, N, S]
        hit = ((pred == batch["labels"]) & (batch["labels"] >= 0)).cpu().numpy()
        real = (batch["anchors"] >= 0).cpu().numpy()  # [b, N]
        lead = np.cumprod(hit, axis=-1)  # [b, N, S]: 1 while every draft so far hit
        reached = np.concatenate([np.ones_like(lead[..., :1]), lead[..., :-1]], axis=-1)
        slot_seen += (reached * real[..., None]).sum((0, 1))
        slot_hits += (lead * real[..., None]).sum((0, 1))
        for j in range(len(real)):
            n, k = int(real[j].sum()), lead[j].sum(-1)  # anchors are consecutive positions
            a = 0
            while a < n:
                rounds += 1
                accepted += int(k[a])
                a += int(k[a]) + 1
    model.train()
    return {"tau": 1.0 + accepted / rounds if rounds else 1.0, "rounds": rounds,
            "first": float(slot_hits[0] / max(slot_seen[0], 1)),
            "per_slot": [round(float(h / s), 4) if s else 0.0
                         for h, s in zip(slot_hits, slot_seen, strict=True)]}


def batch_device(batches: list[dict[str, torch.Tensor]]) -> torch.device:
    return batches[0]["feats"].device if batches else torch.device("cpu")


def lr_at(step: int, s: TrainSettings) -> float:
    warm = max(1, int(WARMUP * s.steps))
    if step < warm:
        return s.lr * (step + 1) / warm
    t = (step - warm) / max(1, s.steps - warm)
    return s.lr * (MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(model: HeadModel, train_batches: Batches, eval_blocks: list[dict[str, torch.Tensor]],
          settings: TrainSettings, work: Path, *, resume: bool, meta: dict[str, Any],
          log: Callable[[str], None] = print, verbose: bool = True
          ) -> tuple[list[dict[str, Any]], bool]:
    """Train to settings.steps (from the checkpoint with `resume`), or to settings.stop_at
    first; returns the history of held-out estimates [{step, anchors, loss, tau, first,
    per_slot, seconds}] and whether the run reached its last step."""
    device = next(model.parameters()).device
    bf16 = use_bf16(settings.precision, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95),
                            weight_decay=settings.weight_decay)
    rng = np.random.default_rng(settings.seed)
    ckpt = work / CHECKPOINT
    step, anchors_seen, history, seconds = 0, 0, [], 0.0
    if resume and ckpt.is_file():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        if state["meta"] != meta:
            raise TrainError(f"{ckpt} was made for another head or data ({state['meta']}); "
                             "use another --work-dir, or remove the checkpoint")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        step, anchors_seen = state["step"], state["anchors"]
        history, seconds = state["history"], state["seconds"]
        log(f"resumed at step {step} of {settings.steps} ({duration(seconds)} trained)")
    every = settings.eval_every or max(1, settings.steps // 10)
    if not history:
        history.append({"step": 0, "anchors": 0, "loss": None,
                        **acceptance(model, eval_blocks, bf16), "seconds": 0.0})
        log(f"held-out before training: τ {history[-1]['tau']:.3f}, first draft "
            f"{history[-1]['first']:.3f}")

    def checkpoint() -> None:
        _save(ckpt, {"meta": meta, "model": model.state_dict(), "opt": opt.state_dict(),
                     "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                     "step": step, "anchors": anchors_seen, "history": history,
                     "seconds": seconds})
        (work / HISTORY).write_text(json.dumps(history, indent=1))

    bar = ProgressLine("training", settings.steps, "steps", start=step) if verbose else None
    ema: float | None = None
    last_save = time.monotonic()
    model.train()
    end = min(settings.steps, settings.stop_at or settings.steps)
    while step < end:
        t0 = time.monotonic()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings)
        batch = train_batches.sample(rng, settings.batch_seqs, settings.anchors)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = block_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        opt.step()
        step += 1
        anchors_seen += int((batch["anchors"] >= 0).sum())
        value = float(loss.detach())
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        seconds += time.monotonic() - t0
        if step % every == 0 or step == settings.steps:
            history.append({"step": step, "anchors": anchors_seen, "loss": round(ema, 4),
                            **acceptance(model, eval_blocks, bf16),
                            "seconds": round(seconds, 1)})
        if bar is not None:
            last = history[-1]
            bar.update(step, f"loss {ema:.3f}, held-out τ {last['tau']:.2f} "
                       f"(step {last['step']})", force=step == settings.steps)
        if time.monotonic() - last_save >= settings.save_every or step == end:
            checkpoint()
            last_save = time.monotonic()
    if bar is not None and step == settings.steps and ema is not None:
        last = history[-1]
        bar.done(f"loss {ema:.3f}, held-out τ {last['tau']:.3f} (from "
                 f"{history[0]['tau']:.3f})")
    return history, step == settings.steps


def set_threads(threads: int | None) -> int:
    n = threads or default_threads()
    torch.set_num_threads(n)
    return n
