"""The engine: target model, drafter, tokenizer and chat template, ready to generate.

Owns the models (ORT runners and their KV caches); a `Generation` per request owns
that request's samplers and position. The scheduler (server) and `specd generate` both
go through `Engine.start()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.hybrid import HybridDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.drafters.synthetic import SyntheticDrafter
from specd.daemon.models.compat import draft_incompatibilities
from specd.daemon.models.store import resolve_model
from specd.daemon.spec.drafter import Drafter
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.text.chat_template import render_chat
from specd.daemon.text.grammar import GrammarState
from specd.daemon.text.tokenizer import Tokenizer
from specd.memory_fit.rss import rss_bytes
from specd.ort_models import native_ops
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import BuiltModel, load_or_build
from specd.ort_models.providers import RuntimeChoice, choose_runtime
from specd.ort_models.runner import ModelRunner

log = logging.getLogger("specd.engine")

SPEC_TYPES = ("auto", "none", "draft", "ngram", "draft+ngram", "synthetic")
MODEL_SPEC_TYPES = ("draft", "draft+ngram")  # the spec types that load a draft model
# how a draft model's weights are laid out: re-quantized to 4 bits in blocks of 32 or 128
# (fewer bytes per draft step; acceptance barely moves, a little more at 128) or exactly as
# its GGUF holds them. Targets are always exact. BENCHMARKS.md compares them.
# "q4k": Q4_K blocks read by specd's GgufMatMul (fastest where the kernels compiled);
# "auto" picks q4k where they did, else q4
DRAFT_QUANTS = {"auto": "", "q4k": "q4k", "q4": "q4", "q4g128": "q4g128", "exact": ""}
Progress = Callable[[int, int, str], None]


class EngineError(Exception):
    """A configuration that cannot be loaded (message for the user)."""


DEFAULT_N_CTX = 4096  # per sequence, capped at the model's trained context


# A draft's logits cover the ids below this (where its vocabulary is larger): it proposes
# only those, and its output matrix shrinks. Byte-level BPE and SentencePiece vocabularies
# number their tokens roughly by frequency, so the ids left out are rare: the Qwen2.5
# target's 256-token replies to the bench's six prompts and temperatures hold one id past
# it in 1,510 (a sure rejection where it is due). The 0.5B Qwen draft reads 27 MB less a
# step (its 152k-row head, 76 MB of 290 as Q4_K, becomes 49 MB): 7-10% off its step.
# 65,536 would save more but leaves out 0.4-3.1% of those tokens.
DRAFT_VOCAB_ROWS = 98_304


@dataclass
class EngineConfig:
    target: str
    draft: str | None = None
    spec_type: str = "auto"
    n_ctx: int = DEFAULT_N_CTX
    slots: int = 1
    threads: int | None = None
    device: str = "auto"
    ngram_min: int = 2
    ngram_max: int = 4
    synthetic_rates: list[float] | None = None
    synthetic_mean: float | None = None
    synthetic_seed: int = 0
    draft_quant: str = "auto"  # a key of DRAFT_QUANTS
    draft_vocab: int = DRAFT_VOCAB_ROWS  # a draft proposes only ids below this; 0: all
    spin: bool = False  # CPU pool threads spin during a run (faster only on an idle machine)
    fetch: bool = True
    defaults: GenerationParams = field(default_factory=GenerationParams)


@dataclass
class LoadedModel:
    path: Path
    gguf: GGUFFile
    built: BuiltModel
    runner: ModelRunner
    # RSS growth while its session (weights, KV buffers) was created; the target's also
    # counts the tokenizer
    resident_bytes: int = 0

    @property
    def name(self) -> str:
        return self.gguf.name


def target_kernels(device: str = "cpu") -> str:
    """"gguf" (specd's kernels on the GGUF's own blocks: fewer bytes per token) where
    they run, i.e. on the CPU and where they compiled; else "ort" (MatMulNBits)."""
    return "gguf" if device == "cpu" and native_ops.library() is not None else "ort"


def resolve_draft_quant(draft_quant: str, device: str = "cpu") -> str:
    """"auto" -> "q4k" where specd's kernels run on `device`, else "q4"."""
    if draft_quant != "auto":
        return draft_quant
    return "q4k" if target_kernels(device) == "gguf" else "q4"


def build_options(role: str, draft_quant: str = "auto", device: str = "cpu",
                  draft_vocab: int = DRAFT_VOCAB_ROWS) -> BuildOptions:
    """Graph options of the target or the draft model on `device` ("cpu" / "cuda:N"); a
    draft's logits cover the ids below `draft_vocab` (0: all).

    Where specd's kernels run (`target_kernels`: CPU, compiled) a target's Q4_0 / Q4_1 /
    Q4_K / Q6_K matrices go through GgufMatMul (the same weights; Q4_K / Q6_K: 4.6 / 6.6
    bits read per weight instead of the 6 / 10 of the lossless MatMulNBits layout) and its
    attention through CachedAttention (rotary, cache write and attention in one node) over
    an f16 KV cache (half the memory; each value rounded once, when written); both give a
    verified row exactly the bits of a single step. The draft gets the same attention
    (0.5B step with q4k weights: 15.7 ms with GroupQueryAttention, 13.5 with
    CausalAttention; BENCHMARKS.md).

    Without them a draft, whose numbers only choose what is proposed, gets the fused
    attention on CPU, which is faster but not batch-invariant; the target keeps the
    exact one. On CUDA drafts keep the exact one too: ORT's CUDA GroupQueryAttention
    takes fp16/bf16 only, and these graphs are fp32.
    """
    if draft_quant not in DRAFT_QUANTS:
        raise EngineError(f"unknown draft quant {draft_quant!r} (one of "
                          f"{', '.join(DRAFT_QUANTS)})")
    native = target_kernels(device) == "gguf"
    if role != "draft":
        return (BuildOptions(kernels="gguf", attention="native", kv_dtype="f16") if native
                else BuildOptions())
    requant = DRAFT_QUANTS[resolve_draft_quant(draft_quant, device)]
    if requant == "q4k" and not native:
        raise EngineError(f"--draft-quant q4k needs specd's kernels on the CPU "
                          f"({native_ops.unavailable_reason() or 'device ' + device})")
    attention = "native" if native else "fused" if device == "cpu" else "exact"
    return BuildOptions(requant=requant, kernels="gguf" if requant == "q4k" else "ort",
                        attention=attention, kv_dtype="f16" if native else "f32",
                        vocab_rows=draft_vocab)


def resolve_spec_type(spec_type: str, draft: str | None) -> str:
    if spec_type not in SPEC_TYPES:
        raise EngineError(f"unknown spec type {spec_type!r} (one of {', '.join(SPEC_TYPES)})")
    if spec_type == "auto":  # the draft model and prompt lookup where there is a draft
        return "draft+ngram" if draft else "none"
    if spec_type in MODEL_SPEC_TYPES and not draft:
        raise EngineError(f"--spec-type {spec_type} needs a draft model (-md)")
    return spec_type


class Engine:
    def __init__(self, cfg: EngineConfig, *, progress: Progress | None = None,
                 build_progress: Callable[[str], Progress | None] | None = None):
        self.cfg = cfg
        try:
            self.runtime: RuntimeChoice = choose_runtime(cfg.device)
        except (RuntimeError, ValueError) as exc:  # no such device, or no CUDA EP
            raise EngineError(str(exc)) from None
        log.debug("%s", self.runtime.describe())  # the CLI commands print it themselves
        if self.runtime.device == "cpu":
            why = native_ops.unavailable_reason()
            log.info("specd kernels (GgufMatMul, CachedAttention): %s",
                     f"off, using ONNX Runtime's ops: {why}" if why else "on")
        self.spec_type = resolve_spec_type(cfg.spec_type, cfg.draft)
        target_path = self._resolve(cfg.target, progress)
        draft_path = (self._resolve(cfg.draft, progress)
                      if self.spec_type in MODEL_SPEC_TYPES else None)
        tgt_file = GGUFFile(target_path)
        d_file = GGUFFile(draft_path) if draft_path is not None else None
        if draft_path is not None and d_file is not None:
            problems = draft_incompatibilities(tgt_file.metadata, d_file.metadata)
            if problems:
                raise EngineError(f"draft {draft_path.name} cannot draft for "
                                  f"{target_path.name}: " + "; ".join(problems))
        before_tokenizer = rss_bytes()
        self.tokenizer = Tokenizer.from_metadata(tgt_file.metadata)
        self.chat_template: str | None = tgt_file.get("tokenizer.chat_template")
        tokenizer_bytes = rss_bytes() - before_tokenizer
        bp = build_progress or (lambda label: None)
        self.target = self._load(target_path, tgt_file, bp("target"),
                                 build_options("target", device=self.runtime.device))
        self.target.resident_bytes += max(tokenizer_bytes, 0)
        self.n_ctx = self.target.runner.n_ctx
        if cfg.n_ctx > self.n_ctx:  # said out loud when the context was asked for
            say = log.info if cfg.n_ctx == DEFAULT_N_CTX else log.warning
            say("warning: a context of %d tokens was asked for; %s was trained for %d, so "
                "each sequence gets %d", cfg.n_ctx, target_path.name,
                self.target.built.hparams.n_ctx_train, self.n_ctx)
        self.drafter: Drafter | None = None
        self.draft: LoadedModel | None = None
        if draft_path is not None and d_file is not None:
            self.draft = self._load(draft_path, d_file, bp("draft"),
                                    build_options("draft", cfg.draft_quant,
                                                  self.runtime.device, cfg.draft_vocab),
                                    exact=False)
            self.drafter = DraftModelDrafter(self.draft.runner,
                                             vocab_limit=self.target.built.hparams.n_vocab)
            if self.spec_type == "draft+ngram":
                self.drafter = HybridDrafter(self.drafter, NgramDrafter(
                    min_ngram=cfg.ngram_min, max_ngram=cfg.ngram_max))
        elif self.spec_type == "ngram":
            self.drafter = NgramDrafter(min_ngram=cfg.ngram_min, max_ngram=cfg.ngram_max)
        elif self.spec_type == "synthetic":
            self.drafter = SyntheticDrafter(cfg.synthetic_rates, mean_length=cfg.synthetic_mean,
                                            n_max=cfg.defaults.draft.n_max,
                                            seed=cfg.synthetic_seed)

    def _resolve(self, name: str | None, progress: Progress | None) -> Path:
        assert name is not None
        try:
            return resolve_model(name, fetch=self.cfg.fetch, progress=progress, to_run=True)
        except Exception as exc:  # noqa: BLE001 - store errors are user-facing already
            raise EngineError(str(exc)) from None

    def _load(self, path: Path, f: GGUFFile, progress: Progress | None,
              options: BuildOptions, exact: bool = True) -> LoadedModel:
        """exact: a verified row must equal a single step bit for bit (the target's runner
        makes its calls' shapes so); a draft's rows need not, and run their own shapes."""
        built = load_or_build(path, options, progress)
        before = rss_bytes()  # after any build: its freed scratch is not the model's
        runner = ModelRunner(built, n_ctx=self.cfg.n_ctx, n_seq=self.cfg.slots,
                             threads=self.cfg.threads, runtime=self.runtime,
                             spinning=self.cfg.spin, row_block=None if exact else 1,
                             min_rows=None if exact else 1)
        return LoadedModel(path, f, built, runner, max(rss_bytes() - before, 0))

    # -- requests -------------------------------------------------------------------------
    @property
    def eog_ids(self) -> set[int]:
        return set(self.tokenizer.eot_ids)

    def _bos_text(self) -> str:
        tok = self.tokenizer
        return tok.token_text(tok.bos_id) if tok.bos_id is not None else ""

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
        tok = self.tokenizer
        return render_chat(self.chat_template or "", messages, add_generation_prompt=True,
                           bos_token=self._bos_text(),
                           eos_token=tok.token_text(tok.eos_id)
                           if tok.eos_id is not None else "", tools=tools)

    def chat_tokens(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The rendered chat as token ids, with one BOS: templates that write
        `{{ bos_token }}` themselves get no second one from the tokenizer."""
        text = self.render_chat(messages, tools)
        bos = self._bos_text()
        add_bos = None if not (bos and text.startswith(bos)) else False
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=True)

    def encode_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """Raw text (BOS as the file says, specials parsed) or a rendered chat prompt."""
        if chat:
            return self.chat_tokens([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, parse_special=True)

    def start(self, seq: int, prompt: Sequence[int], params: GenerationParams,
              reuse: int = 0, grammar: GrammarState | None = None) -> Generation:
        return Generation(self.target.runner, seq, prompt, params, eog=self.eog_ids,
                          drafter=self.drafter, reuse=reuse, grammar=grammar)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "runtime": self.runtime.describe(),
            "target": {"name": self.target.name, "path": str(self.target.path),
                       "arch": self.target.built.hparams.arch,
                       "kernels": self.target.built.options.kernels,
                       "attention": self.target.built.options.attention},
            "spec_type": self.spec_type,
            "n_ctx": self.n_ctx,
            "slots": self.cfg.slots,
        }
        if self.draft is not None:
            d["draft"] = {"name": self.draft.name, "path": str(self.draft.path),
                          "arch": self.draft.built.hparams.arch, "n_ctx": self.draft.runner.n_ctx,
                          "quant": resolve_draft_quant(self.cfg.draft_quant,
                                                       self.runtime.device),
                          "vocab": self.draft.built.options.logits_width(
                              self.draft.built.hparams.n_vocab)}
        return d
