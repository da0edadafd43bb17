"""What is built from a GGUF and how: graph options per role and device, the built model
of a file (from its cache folder when built already), and fitting target + draft into
the device's memory (`specd fit` and `specd serve` start alike).

Fitting snapshots the free memory first (measuring loads the models, in a subprocess),
builds or loads the graphs, measures them (cached in each graph folder), then plans.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specd.memory_fit.measure import ModelCost, head_cost, measure
from specd.memory_fit.plan import DEFAULT_MARGIN_BYTES, DEFAULT_MIN_CTX, FitError, Plan, fit
from specd.memory_fit.probes import FakeProbe, MemoryProbe, probe_for
from specd.ort_models import native_ops
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import ATTN_BUCKET, BuildOptions
from specd.ort_models.head_runner import load_or_build_head
from specd.ort_models.heads import HeadParams, head_kind, read_head
from specd.ort_models.shared_initializers import shares_on

if TYPE_CHECKING:
    from specd.ort_models.model_cache import BuiltModel

BuildProgress = Callable[[str], Any]


class BuildError(ValueError):
    """Build options that cannot be had on this machine (message for the user)."""


# how a draft model's weights are laid out: re-quantized to Q4_K blocks read by specd's
# GgufMatMul ("q4k"), to 4 bits in blocks of 32 or 128 for MatMulNBits ("q4", "q4g128"),
# or exactly as its GGUF holds them; "auto" picks q4k where the kernels compiled, else q4.
# Targets are always exact.
DRAFT_QUANTS = {"auto": "", "q4k": "q4k", "q4": "q4", "q4g128": "q4g128", "exact": ""}
# A draft's logits cover the ids below this (where its vocabulary is larger): it proposes
# only those, and its output matrix shrinks. Byte-level BPE and SentencePiece vocabularies
# number their tokens roughly by frequency, so the ids left out are rare.
DRAFT_VOCAB_ROWS = 98_304


def target_kernels(device: str = "cpu") -> str:
    """"gguf" (specd's kernels on the GGUF's own blocks: fewer bytes per token) where
    they run, i.e. on the CPU and where they compiled; else "ort" (MatMulNBits)."""
    return native_ops.kernels_for(device)


def resolve_draft_quant(draft_quant: str, device: str = "cpu") -> str:
    """"auto" -> "q4k" where specd's kernels run on `device`, else "q4"."""
    if draft_quant != "auto":
        return draft_quant
    return "q4k" if target_kernels(device) == "gguf" else "q4"


def build_options(role: str, draft_quant: str = "auto", device: str = "cpu",
                  draft_vocab: int = DRAFT_VOCAB_ROWS, head: HeadParams | None = None
                  ) -> BuildOptions:
    """Graph options of the target or the draft model on `device` ("cpu" / "cuda:N"); a
    draft's logits cover the ids below `draft_vocab` (0: all); a target beside a drafter
    `head` outputs the hidden states the head reads.

    Where specd's kernels run (`target_kernels`: CPU, compiled) a target's Q4_0 / Q4_1 /
    Q4_K / Q6_K matrices go through GgufMatMul (the GGUF's own blocks: fewer bytes read
    than MatMulNBits' lossless layout) and its attention through CachedAttention (rotary,
    cache write and attention in one node) over an f16 KV cache; both give a verified row
    exactly the bits of a single step. The draft gets the same attention.

    Without them a draft, whose numbers only choose what is proposed, gets the fused
    attention on CPU, which is faster but not batch-invariant; the target keeps the
    exact one. On CUDA drafts keep the exact one too: ORT's CUDA GroupQueryAttention
    takes fp16/bf16 only, and these graphs are fp32.
    """
    if draft_quant not in DRAFT_QUANTS:
        raise BuildError(f"unknown draft quant {draft_quant!r} (one of "
                          f"{', '.join(DRAFT_QUANTS)})")
    native = target_kernels(device) == "gguf"
    if role != "draft":
        layers = () if head is None else tuple(sorted(set(head.hidden_layers)))
        return (BuildOptions(kernels="gguf", attention="native", kv_dtype="f16",
                             hidden_layers=layers, sampler=True) if native
                else BuildOptions(hidden_layers=layers))
    requant = DRAFT_QUANTS[resolve_draft_quant(draft_quant, device)]
    if requant == "q4k" and not native:
        raise BuildError(f"--draft-quant q4k needs specd's kernels on the CPU "
                          f"({native_ops.unavailable_reason() or 'device ' + device})")
    attention = "native" if native else "fused" if device == "cpu" else "exact"
    return BuildOptions(requant=requant, kernels="gguf" if requant == "q4k" else "ort",
                        attention=attention, kv_dtype="f16" if native else "f32",
                        vocab_rows=draft_vocab, sampler=native)


# architectures whose image rows see the whole image (llama.cpp's
# mtmd_decode_use_non_causal: Gemma 3's projector); every other's are causal
IMAGE_ROWS_NOT_CAUSAL = frozenset({"gemma3"})


def image_options(target: BuildOptions, arch: str) -> BuildOptions:
    """The options of the target's graph taking an image's rows as embeddings, beside its
    text graph (`target`: that graph's options): the same weights, kernels, attention and
    feature layers; no token decision (an image never ends a prompt a chat renders)."""
    return dataclasses.replace(target, embeddings_input=True, sampler=False,
                               causal=arch not in IMAGE_ROWS_NOT_CAUSAL)


def embedding_options(device: str, layer: int) -> BuildOptions:
    """Graph options of an embedding model of its own: a target's, outputting the hidden
    state of `layer`, with no token decision after its logits (it never generates)."""
    return dataclasses.replace(build_options("target", device=device),
                               hidden_layers=(layer,), sampler=False)


def resolve_device(device: str) -> str:
    """"auto" -> what the engine would use ("cpu" / "cuda:N"); "cuda" -> "cuda:0"."""
    from specd.ort_models.providers import choose_runtime

    if device == "auto":
        return choose_runtime("auto").device
    if device == "cuda":
        return "cuda:0"
    return device


def fit_models(target: str | os.PathLike[str], draft: str | os.PathLike[str] | None = None,
               *, device: str = "auto", slots: int = 1,
               margin_bytes: int = DEFAULT_MARGIN_BYTES, min_ctx: int = DEFAULT_MIN_CTX,
               max_ctx: int | None = None, threads: int | None = None, fetch: bool = True,
               use_cache: bool = True, probe: MemoryProbe | None = None,
               build_progress: BuildProgress | None = None, draft_quant: str = "auto",
               draft_vocab: int = DRAFT_VOCAB_ROWS, progress: Any = None,
               embedding_model: str | os.PathLike[str] | None = None,
               also_draft: str | os.PathLike[str] | None = None,
               mmproj: str | None = None, history_bytes: int = 0
               ) -> tuple[Plan, list[ModelCost]]:
    """Resolve, build, measure and fit target (+ draft, + an embedding model of its own,
    counted beside them); returns the plan and the costs (the embedding model's last).
    `also_draft`: a second draft file loaded with `draft` (a head beside a draft model),
    planned with it as one draft. `mmproj`: the vision projector as EngineConfig.mmproj
    names it, its encoder counted beside them (vision_cost). `history_bytes`: the
    history index's bound, counted where host memory is the device's (CPU; on a GPU it
    takes none of the device's)."""
    from specd.daemon.models.store import resolve_model
    from specd.memory_fit.vision import vision_cost

    from .mmproj import NO_MMPROJ, find_mmproj

    dev = resolve_device(device)
    free = FakeProbe.snapshot(probe or probe_for(dev))  # before anything is loaded
    bp = build_progress or (lambda label: None)
    target_path = resolve_model(target, fetch=fetch, progress=progress, to_run=True)  # a bar
    draft_paths = [resolve_model(d, fetch=fetch, progress=progress, to_run=True)
                   for d in (draft, also_draft) if d is not None]
    heads = [draft_head(path) for path in draft_paths]
    head = next((h for h in heads if h is not None), None)  # the target outputs its layers
    target_built = built_model(target_path, bp("target"),
                               build_options("target", draft_quant, dev, draft_vocab, head))
    costs = [_measured(target_built, dev, threads, use_cache)]
    drafts: list[ModelCost] = []
    for path, head_params in zip(draft_paths, heads, strict=True):
        if head_params is None:  # a draft model
            drafts.append(_measured(built_model(path, bp("draft"), build_options(
                "draft", draft_quant, dev, draft_vocab)), dev, threads, use_cache))
        else:
            drafts.append(head_cost(load_or_build_head(path, target_path, bp("draft head"),
                                                       device=dev),
                                    target_built.model_path if shares_on(dev) else None))
    if drafts:
        costs.append(drafts[0] if len(drafts) == 1 else drafts[0].beside(drafts[1]))
    beside = None
    if embedding_model is not None:
        path = resolve_model(embedding_model, fetch=fetch, progress=progress, to_run=True)
        layer = read_hparams(GGUFFile(path)).n_layer - 1  # its last layer (EmbeddingHead)
        built = built_model(path, bp("embedding model"), embedding_options(dev, layer))
        beside = measure(built, dev, threads=threads, use_cache=use_cache)
    mm_path = (None if mmproj in (None, NO_MMPROJ) else find_mmproj(
        target, target_path, None if mmproj == "auto" else mmproj, fetch=fetch))
    vision = None if mm_path is None else vision_cost(mm_path)
    plan = fit(costs[0], costs[1] if len(costs) > 1 else None, probe=free, slots=slots,
               margin_bytes=margin_bytes, min_ctx=min_ctx, max_ctx=max_ctx, beside=beside,
               vision=vision, history_bytes=history_bytes if dev == "cpu" else 0)
    return plan, costs + ([beside] if beside is not None else [])


def _measured(built: BuiltModel, device: str, threads: int | None, use_cache: bool
              ) -> ModelCost:
    """A built model's measured cost (a context too short to plan at refused)."""
    trained = built.hparams.n_ctx_train
    if 0 < trained < ATTN_BUCKET:  # nothing to measure at, nothing to plan
        raise FitError(f"a context of at least {ATTN_BUCKET} tokens is needed; "
                       f"{built.gguf_path.name} was trained on {trained}")
    return measure(built, device, threads=threads, use_cache=use_cache)


def draft_head(path: str | os.PathLike[str]) -> HeadParams | None:
    """The drafter head a draft file holds (None: a draft model)."""
    f = GGUFFile(path)
    return None if head_kind(f.metadata, f.tensors) is None else read_head(f)


def built_model(path: str | os.PathLike[str], progress: Any = None,
                options: BuildOptions | None = None) -> BuiltModel:
    """The BuiltModel of a GGUF: from its graph folder's meta.json when it is built
    already (no GGUF parsing: instant), else load_or_build (builds it)."""
    from specd.memory_fit.measure import built_from_folder
    from specd.ort_models.gguf_file import content_hash
    from specd.ort_models.model_cache import graph_folder, is_complete, load_or_build

    options = options or BuildOptions()
    sha = content_hash(path)
    # a vocabulary cut at or past the model's size is cached as no cut (for_vocab), and
    # the size is known only from a folder's meta: try the cut's folder, then the whole's
    tries = [options] + ([dataclasses.replace(options, vocab_rows=0)] if options.vocab_rows
                         else [])
    for opts in tries:
        folder = graph_folder(sha, opts)
        if not is_complete(folder):
            continue
        try:
            built = built_from_folder(folder)
        except (OSError, ValueError, KeyError, TypeError):
            break  # an unreadable meta.json: let load_or_build check and rebuild
        if options.for_vocab(built.hparams.n_vocab) == built.options:
            return dataclasses.replace(built, gguf_path=Path(path))
    return load_or_build(path, options, progress)


