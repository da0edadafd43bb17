"""The target's own replies, and its hidden states, for the head to learn from.

Each instruction is rendered with the target's chat template and answered by the target
greedily through specd's own decode (`spec/generation.py`, prompt lookup proposing, which
only makes it faster: greedy output is the target's, token for token). Several replies
are decoded at once, their rows in one pass of the target per step, as the daemon's slots
are (each row computed as alone, so the replies are the same whatever runs beside them);
they are stored in the order of their instructions. The lookup drafter
here also declares the head's target layers, so every verified token's hidden states come
back with it (no second pass): row i of a sequence's features is the concatenation, in
the head's order, of the streams after specd's hidden layers for token i. The last token
of a sequence is never evaluated (nothing follows it), so its row is zeros.

Shards under `data/`: a folder per shard with tokens.npy (int32 [T]), bounds.npy (int64
[n + 1]: sequence i is tokens[bounds[i]:bounds[i + 1]]), reply.npy (int64 [n]: where each
reply starts, within its sequence) and feats.npy (float16 [T, F]). `manifest.json` says
what is done, so an interrupted run goes on where it stopped.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.models.building import build_options
from specd.daemon.spec.drafter import DraftParams, Features
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.round import BatchRound
from specd.daemon.text.chat_template import render_chat
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile, content_hash
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from . import TrainError
from .config import DEFAULT_PARALLEL
from .corpus import Instruction, instructions
from .progress import ProgressLine

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
# a shard is written once its features reach SHARD_BYTES or SHARD_SECONDS have passed, so
# that memory stays bounded and an interruption loses minutes of distillation at most
SHARD_BYTES = 256 << 20
SHARD_SECONDS = 600.0
FEATURE_LIMIT = 65504.0  # float16's range; heads clamp their features to it too


@dataclass(frozen=True)
class DistillSpec:
    """What the data is made of; a resumed run must ask for the same."""

    target_sha: str
    hidden_layers: tuple[int, ...]  # specd's hidden outputs, in the head's order
    max_prompt: int
    max_reply: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _FeatureRecorder(NgramDrafter):
    """Prompt lookup that also keeps the features of every token the target evaluated,
    per sequence."""

    name = "ngram"

    def __init__(self, hidden_layers: Sequence[int]) -> None:
        super().__init__()
        self.order = tuple(hidden_layers)
        self.target_layers = tuple(sorted(set(hidden_layers)))
        self.rows: dict[int, list[np.ndarray]] = {}

    def _keep(self, seq: int, features: Features | None) -> None:
        if features is not None:
            rows = np.concatenate([features[h] for h in self.order], axis=-1)  # [n, F]
            self.rows[seq].append(np.clip(rows, -FEATURE_LIMIT, FEATURE_LIMIT
                                          ).astype(np.float16))

    def begin(self, seq: int, prompt: Sequence[int], sampler: object = None,
              features: Features | None = None) -> None:
        self.rows[seq] = []
        super().begin(seq, prompt, sampler, None)
        self._keep(seq, features)

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        super().process(seq, tokens, None)
        self._keep(seq, features)

    def take(self, seq: int, n: int, width: int) -> np.ndarray:
        """The sequence's first n feature rows [n, width], forgotten here. A round's last
        verified tokens may follow the reply's end (an end of generation inside an
        accepted draft, or max_tokens reached mid-round): their rows, at the end, are
        dropped with them. TrainError where fewer than n were recorded."""
        rows = self.rows.pop(seq, [])
        feats = np.concatenate(rows) if rows else np.zeros((0, width), np.float16)
        if feats.shape[0] < n or feats.shape[1:] != (width,):  # the recorder failed
            raise TrainError(f"distilling: {feats.shape[0]} feature rows for {n} evaluated "
                             "tokens (the feature recorder stopped; run with -v to see why)")
        return feats[:n]


class ChatPrompts:
    """Instructions as the target's chat prompts (token ids), as `specd generate --chat`
    renders them."""

    def __init__(self, f: GGUFFile) -> None:
        self.tok = Tokenizer.from_metadata(f.metadata)
        self.template: str | None = f.get("tokenizer.chat_template")
        bos = self.tok.bos_id
        self.bos = self.tok.token_text(bos) if bos is not None else ""
        eos = self.tok.eos_id
        self.eos = self.tok.token_text(eos) if eos is not None else ""

    def tokens(self, text: str) -> list[int]:
        rendered = render_chat(self.template or "", [{"role": "user", "content": text}],
                               bos_token=self.bos, eos_token=self.eos)
        add_bos = False if self.bos and rendered.startswith(self.bos) else None
        return self.tok.encode(rendered, add_bos=add_bos, parse_special=True)

    @property
    def eog(self) -> set[int]:
        return set(self.tok.eot_ids)


class _ShardWriter:
    def __init__(self, folder: Path, split: str, index: int) -> None:
        self.folder, self.split, self.index = folder, split, index
        self.tokens: list[np.ndarray] = []
        self.feats: list[np.ndarray] = []
        self.reply: list[int] = []
        self.started = time.monotonic()

    def full(self) -> bool:
        """Time to write the shard (SHARD_BYTES of features, or SHARD_SECONDS)."""
        return bool(self.tokens) and (
            sum(f.nbytes for f in self.feats) >= SHARD_BYTES
            or time.monotonic() - self.started >= SHARD_SECONDS)

    def add(self, tokens: Sequence[int], reply_start: int, feats: np.ndarray) -> None:
        self.tokens.append(np.asarray(tokens, np.int32))
        self.reply.append(reply_start)
        self.feats.append(feats)

    def flush(self) -> str | None:
        """Write the shard (a folder, renamed into place when complete); its name."""
        if not self.tokens:
            return None
        name = f"{self.split}-{self.index:05d}"
        tmp = self.folder / f".{name}.partial"
        tmp.mkdir(parents=True, exist_ok=True)
        bounds = np.concatenate([[0], np.cumsum([len(t) for t in self.tokens])]).astype(np.int64)
        np.save(tmp / "tokens.npy", np.concatenate(self.tokens))
        np.save(tmp / "bounds.npy", bounds)
        np.save(tmp / "reply.npy", np.asarray(self.reply, np.int64))
        np.save(tmp / "feats.npy", np.concatenate(self.feats))
        os.replace(tmp, self.folder / name)
        self.index += 1
        self.tokens, self.feats, self.reply = [], [], []
        self.started = time.monotonic()
        return name


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    tmp = folder / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)


def distill(target_path: Path, folder: Path, spec: DistillSpec, samples: dict[str, int], *,
            exclude: Sequence[str] = (), device: str = "cpu", threads: int | None = None,
            parallel: int = DEFAULT_PARALLEL, verbose: bool = True) -> dict[str, Any]:
    """Make (or finish making) `samples[split]` sequences per split in `folder`, decoding
    `parallel` replies at once; returns the manifest. TrainError where the folder holds
    data made otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(folder)
    if manifest is None:
        manifest = {"version": MANIFEST_VERSION, "spec": spec.to_dict(), "splits": {
            s: {"shards": [], "samples": 0, "tokens": 0, "reply_tokens": 0, "consumed": 0}
            for s in samples}}
    elif manifest.get("spec") != json.loads(json.dumps(spec.to_dict())):
        raise TrainError(f"{folder} holds data made with {manifest.get('spec')}, not "
                         f"{spec.to_dict()}: use another --work-dir, or remove it")
    todo = {s: n for s, n in samples.items() if manifest["splits"][s]["samples"] < n}
    if not todo:
        return manifest
    f = GGUFFile(target_path)
    chat = ChatPrompts(f)
    options = dataclasses.replace(build_options("target", device=device),
                                  hidden_layers=tuple(sorted(set(spec.hidden_layers))))
    built = load_or_build(target_path, options)
    runner = ModelRunner(built, n_ctx=spec.max_prompt + spec.max_reply + 1, threads=threads,
                         n_seq=max(parallel, 1))
    for split, want in todo.items():
        _distill_split(runner, chat, folder, manifest, spec, split, want, exclude, verbose)
    return manifest


@dataclass
class _Reply:
    """An instruction being answered on a sequence of the runner."""

    prompt: list[int]
    gen: Generation
    reply: list[int]


def _distill_split(runner: ModelRunner, chat: ChatPrompts, folder: Path,
                   manifest: dict[str, Any], spec: DistillSpec, split: str, want: int,
                   exclude: Sequence[str], verbose: bool) -> None:
    """Answer the split's next instructions until it holds `want` replies, one per
    sequence of `runner` at a time, every sequence's step in one pass."""
    state = manifest["splits"][split]
    width = len(spec.hidden_layers) * runner.hp.n_embd
    writer = _ShardWriter(folder, split, len(state["shards"]))
    source: Iterator[Instruction] = itertools.islice(
        instructions(split, seed=spec.seed, exclude=exclude), state["consumed"], None)
    recorder = _FeatureRecorder(spec.hidden_layers)
    one_round = BatchRound(runner)  # every reply under way steps in it
    params = GenerationParams(max_tokens=spec.max_reply, draft=DraftParams(n_max=8),
                              adaptive=True)
    bar = ProgressLine(f"distilling {split}", want, "replies", start=state["samples"]) \
        if verbose else None
    pending = {"samples": 0, "tokens": 0, "reply_tokens": 0, "consumed": 0}
    done = state["samples"]
    reply_tokens = 0
    # the instructions taken, in order, each with its reply (None: skipped, too long);
    # a finished reply is stored, and its instruction counted as consumed, once every
    # instruction before it is, so that a resumed run starts right after the stored ones
    queue: list[_Reply | None] = []
    free = list(range(runner.n_seq))
    exhausted = False
    while True:
        while free and not exhausted and done + sum(r is not None for r in queue) < want:
            inst = next(source, None)
            if inst is None:
                exhausted = True
                break
            prompt = chat.tokens(inst.text)
            queue.append(None if len(prompt) > spec.max_prompt else _Reply(
                prompt, Generation(runner, free.pop(), prompt, params, eog=chat.eog,
                                   drafter=recorder), []))
        if not queue:
            break
        under_way = [r for r in queue if r is not None and not r.gen.done]
        report = one_round.step([r.gen for r in under_way])
        for reply, result in zip(under_way, report.results, strict=True):
            if isinstance(result, Exception):
                raise result
            reply.reply += result
        while queue and (queue[0] is None or queue[0].gen.done):
            r = queue.pop(0)
            pending["consumed"] += 1
            if r is None:
                continue
            free.append(r.gen.seq)
            r.gen.close()
            tokens = r.prompt + r.reply
            feats = recorder.take(r.gen.seq, len(tokens) - 1, width)  # [T - 1, F]
            feats = np.concatenate([feats, np.zeros((1, width), np.float16)])  # [T, F]
            writer.add(tokens, len(r.prompt), feats)
            pending["samples"] += 1
            pending["tokens"] += len(tokens)
            pending["reply_tokens"] += len(r.reply)
            reply_tokens += len(r.reply)
            done += 1
            if bar is not None:
                bar.update(done, f"{reply_tokens / max(done - bar.start_done, 1):.0f} reply "
                           f"tokens each, {r.gen.stats.mean_acceptance_length:.2f} "
                           "tokens/pass")
            if writer.full():
                _commit(folder, manifest, state, writer, pending)
    _commit(folder, manifest, state, writer, pending)
    if bar is not None:
        bar.done(f"{state['samples']} replies, {state['tokens']} tokens "
                 f"({state['reply_tokens']} in replies)")


def _commit(folder: Path, manifest: dict[str, Any], state: dict[str, Any],
            writer: _ShardWriter, pending: dict[str, int]) -> None:
    """Write the shard under way and count what it holds (and the instructions consumed
    for it) in the manifest: a resumed run starts after them."""
    name = writer.flush()
    if name is not None:
        state["shards"].append(name)
    for key, value in pending.items():
        state[key] += value
        pending[key] = 0
    _write_manifest(folder, manifest)


@dataclass
class Sequences:
    """A split's sequences, memory-mapped from its shards."""

    tokens: list[np.ndarray]  # per shard, int32 [T]
    bounds: list[np.ndarray]  # per shard, int64 [n + 1]
    reply: list[np.ndarray]  # per shard, int64 [n]
    feats: list[np.ndarray]  # per shard, float16 [T, F] (memory-mapped)
    index: np.ndarray  # [N, 2]: (shard, sequence within it) of sequence i

    def __len__(self) -> int:
        return len(self.index)

    def get(self, i: int) -> tuple[np.ndarray, int, np.ndarray]:
        """(tokens int64 [T], reply start, features float16 [T, F], memory-mapped)."""
        s, j = self.index[i]
        a, b = self.bounds[s][j], self.bounds[s][j + 1]
        return self.tokens[s][a:b].astype(np.int64), int(self.reply[s][j]), self.feats[s][a:b]

    def lengths(self) -> np.ndarray:
        """[N] sequence lengths."""
        return np.concatenate([np.diff(b) for b in self.bounds]) if self.bounds else \
            np.zeros(0, np.int64)

    def reply_lengths(self) -> np.ndarray:
        """[N] reply lengths."""
        return self.lengths() - (np.concatenate(self.reply) if self.reply else 0)


def load_split(folder: Path, split: str) -> Sequences:
    manifest = _read_manifest(folder)
    if manifest is None or split not in manifest["splits"]:
        raise TrainError(f"{folder}: no {split} data")
    shards = manifest["splits"][split]["shards"]
    out = Sequences([], [], [], [], np.zeros((0, 2), np.int64))
    index = []
    for s, name in enumerate(shards):
        d = folder / name
        out.tokens.append(np.load(d / "tokens.npy"))
        out.bounds.append(np.load(d / "bounds.npy"))
        out.reply.append(np.load(d / "reply.npy"))
        out.feats.append(np.load(d / "feats.npy", mmap_mode="r"))
        index += [(s, j) for j in range(len(out.reply[-1]))]
    out.index = np.asarray(index, np.int64).reshape(-1, 2)
    return out


def target_sha(path: Path) -> str:
    return content_hash(path)
