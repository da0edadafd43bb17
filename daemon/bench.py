"""`specd bench`: speed of every speculation configuration on the same prompts, side by side.

One process loads the target (and draft) once; each (prompt, temperature, configuration)
runs `repeats` times, interleaved round-robin so every configuration sees the same
machine state; medians and spread are reported. The optional peer (llama-cpp-python)
runs the same prompts on the same GGUF files in the same rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..memory_fit.measure import PeakRss, read_hwm, rss_bytes
from .drafters.base import Drafter, DraftParams
from .drafters.draft_model import DraftModelDrafter
from .drafters.ngram import NgramDrafter
from .engine import Engine
from .generation import Generation, GenerationParams
from .sampling import SamplerParams

PROMPTS: dict[str, str] = {
    "code": "Write a Python function `merge_intervals(intervals)` that merges overlapping "
            "intervals, with a docstring and three doctest examples.",
    "refactor": (
        "Refactor this function to use a dataclass and type hints, keeping its behaviour:\n\n"
        "```python\n"
        "def make_user(name, email, age, admin=False):\n"
        "    user = {}\n"
        "    user['name'] = name\n"
        "    user['email'] = email\n"
        "    user['age'] = age\n"
        "    user['admin'] = admin\n"
        "    if age < 0:\n"
        "        raise ValueError('age must be positive')\n"
        "    if '@' not in email:\n"
        "        raise ValueError('bad email')\n"
        "    return user\n"
        "```"),
    "prose": "Write a short story (about 200 words) about a lighthouse keeper who finds a "
             "message in a bottle.",
}


@dataclass(frozen=True)
class BenchConfig:
    name: str
    spec: str  # none | draft | ngram
    n_max: int = 0
    adaptive: bool = False
    p_min: float = 0.0


def parse_config(name: str) -> BenchConfig:
    """`target-only`, `draft n_max=K`, `draft adaptive`, `ngram n_max=K`, `ngram adaptive`
    (adaptive drafts at most 8)."""
    spec, _, rest = name.strip().partition(" ")
    if spec == "target-only" and not rest:
        return BenchConfig("target-only", "none")
    if spec in ("draft", "ngram"):
        if rest == "adaptive":
            return BenchConfig(name, spec, 8, adaptive=True)
        key, _, value = rest.partition("=")
        if key == "n_max" and value.isdigit() and int(value) > 0:
            return BenchConfig(f"{spec} n_max={int(value)}", spec, int(value))
    raise ValueError(f"unknown bench configuration {name!r} (target-only, draft n_max=K, "
                     "draft adaptive, ngram n_max=K, ngram adaptive)")


def default_configs(has_draft: bool) -> list[BenchConfig]:
    names = ["target-only"]
    if has_draft:
        names += ["draft n_max=2", "draft n_max=4", "draft n_max=8", "draft adaptive"]
    return [parse_config(n) for n in names + ["ngram n_max=8", "ngram adaptive"]]


@dataclass
class RunResult:
    prefill_tps: float
    decode_tps: float
    ttft_s: float
    mean_acceptance_length: float
    per_position: list[float]
    draft_lengths: dict[int, int]
    tokens: int
    text_hash: int
    # decode time per emitted token, ms: draft, verify (target passes), the rest (Python:
    # sampling, acceptance, bookkeeping)
    split_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    run_peak_bytes: int = 0  # peak RSS during the run above the RSS it started at
    memory_bytes: int = 0  # the configuration's models (Footprint) + run_peak_bytes


@dataclass
class Cell:
    prompt: str
    temperature: float
    config: str
    runs: list[RunResult] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)

    def spread(self, attr: str) -> tuple[float, float]:
        vals = [getattr(r, attr) for r in self.runs]
        return min(vals), max(vals)


class Footprint:
    """Memory each configuration needs, measured in the one process that holds them all:
    the RSS growth while each model loaded and during its first (warm-up) run, which
    grows the runtime's arenas and pages in what was mapped, plus, per timed run, the
    peak above the RSS the run started at."""

    def __init__(self) -> None:
        self.resident: dict[frozenset[str], int] = {}
        self.warm: set[str] = set()

    def loaded(self, model: str, nbytes: int) -> None:
        key = frozenset({model})
        self.resident[key] = self.resident.get(key, 0) + max(nbytes, 0)

    def warmed(self, models: frozenset[str], growth: int) -> None:
        """RSS growth of a warm-up run, charged to the models it ran first (if several
        ran first together, to them as a group)."""
        cold = frozenset(models - self.warm)
        if cold:
            self.resident[cold] = self.resident.get(cold, 0) + max(growth, 0)
        self.warm |= models

    def of(self, models: frozenset[str], run_peak: int) -> int:
        return sum(v for k, v in self.resident.items() if k <= models) + run_peak


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s (numpy sum over a buffer far larger than the caches)."""
    a = np.ones(int(gib * (1 << 30)) // 8, dtype=np.float64)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t))
    return best


class SpecdRunner:
    def __init__(self, engine: Engine):
        self.engine = engine

    def drafter_for(self, cfg: BenchConfig) -> Drafter | None:
        if cfg.spec == "draft":
            assert self.engine.draft is not None
            return DraftModelDrafter(self.engine.draft.runner,
                                     vocab_limit=self.engine.target.built.hparams.n_vocab)
        if cfg.spec == "ngram":
            return NgramDrafter()
        return None

    def run(self, prompt: list[int], cfg: BenchConfig, temperature: float, max_tokens: int,
            seed: int) -> RunResult:
        params = GenerationParams(
            max_tokens=max_tokens, ignore_eos=True,
            sampling=SamplerParams(temperature=temperature, seed=seed),
            draft=DraftParams(n_max=cfg.n_max, p_min=cfg.p_min), adaptive=cfg.adaptive)
        gen = Generation(self.engine.target.runner, 0, prompt, params,
                         eog=self.engine.eog_ids, drafter=self.drafter_for(cfg))
        with PeakRss() as peak:
            start = rss_bytes()
            t0 = time.perf_counter()
            gen.prefill()
            ttft = time.perf_counter() - t0
            while not gen.done:
                gen.step()
            gen.close()
        s = gen.stats
        per = 1e3 / max(s.generated_tokens - 1, 1)  # the first token comes from prefill
        split = (s.draft_s * per, s.verify_s * per,
                 max(s.decode_s - s.draft_s - s.verify_s, 0.0) * per)
        return RunResult(s.prefill_tps, s.decode_tps, ttft, s.mean_acceptance_length,
                         s.per_position_acceptance(), dict(s.draft_lengths),
                         s.generated_tokens, hash(tuple(gen.tokens)),
                         tuple(round(x, 2) for x in split), max(peak.peak - start, 0))

    @staticmethod
    def models_of(cfg: BenchConfig) -> frozenset[str]:
        return frozenset({"target", "draft"} if cfg.spec == "draft" else {"target"})


PEER_DRAFT_N = 4


def _llama_draft_model(llm: Any, n: int) -> Any:
    """A llama-cpp-python draft model backed by a second Llama (the same draft GGUF
    specd uses): n greedy tokens per call, its KV cache reused by prefix matching."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaDraftModel

    def greedy() -> int:
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))))

    class LlamaModelDraft(LlamaDraftModel):
        def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
            ids = input_ids.tolist()
            cached = llm.input_ids[: llm.n_tokens].tolist()
            keep, most = 0, min(len(cached), len(ids) - 1)
            while keep < most and cached[keep] == ids[keep]:
                keep += 1
            llm.n_tokens = keep  # eval drops the cache from here on
            llm.eval(ids[keep:])
            out = [greedy()]
            while len(out) < n:
                llm.eval(out[-1:])
                out.append(greedy())
            return np.array(out, dtype=np.intc)

    return LlamaModelDraft()


class PeerRunner:
    """llama.cpp through llama-cpp-python (optional): target-only, prompt lookup, and
    speculation with a draft model (llama-cpp-python's verify loop over llama.cpp)."""

    MODES = ("target-only", "lookup", f"draft n_max={PEER_DRAFT_N}")

    def __init__(self, target_path: Path, threads: int, n_ctx: int,
                 draft_path: Path | None = None):
        from llama_cpp import Llama  # optional dependency

        self._Llama = Llama
        self.path, self.threads, self.n_ctx = target_path, threads, n_ctx
        self.draft_path = draft_path
        self._llms: dict[str, Any] = {}

    def _new(self, path: Path, draft_model: Any = None) -> Any:
        return self._Llama(model_path=str(path), n_threads=self.threads,
                           n_threads_batch=self.threads, n_ctx=self.n_ctx, verbose=False,
                           draft_model=draft_model)

    def _llm(self, mode: str) -> Any:
        if mode not in self._llms:
            if mode == "lookup":
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                dm = LlamaPromptLookupDecoding(num_pred_tokens=8)
            elif mode.startswith("draft") and self.draft_path is not None:
                dm = _llama_draft_model(self._new(self.draft_path), PEER_DRAFT_N)
            elif mode == "target-only":
                dm = None
            else:
                raise ValueError(f"peer mode {mode!r} is not available")
            self._llms[mode] = self._new(self.path, dm)
        return self._llms[mode]

    def run(self, prompt: list[int], mode: str, temperature: float,
            max_tokens: int, seed: int) -> RunResult:
        with PeakRss() as peak:
            start = rss_bytes()
            llm = self._llm(mode)  # created (and its file mapped) on its first run
            llm.reset()
            t0 = time.perf_counter()
            first = None
            n = 0
            for _tok in llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0,
                                     min_p=0.0, repeat_penalty=1.0, reset=True):
                n += 1
                if first is None:
                    first = time.perf_counter()
                if n >= max_tokens:
                    break
            end = time.perf_counter()
        assert first is not None
        decode = (n - 1) / (end - first) if n > 1 else 0.0
        return RunResult(len(prompt) / (first - t0), decode, first - t0, 1.0, [], {}, n, 0,
                         run_peak_bytes=max(peak.peak - start, 0))


def run_bench(engine: Engine, *, prompts: dict[str, str] | None = None,
              temperatures: tuple[float, ...] = (0.0, 0.7), max_tokens: int = 256,
              repeats: int = 3, configs: list[BenchConfig] | None = None,
              peer: PeerRunner | None = None, peer_modes: tuple[str, ...] = ("target-only",),
              seed: int = 1234, warmup_tokens: int = 16,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (prompt, temperature, configuration) `repeats` times, round-robin, after one
    untimed warm-up run per configuration (first-run allocations are not timed, and are
    charged to the configuration's memory)."""
    prompts = prompts or PROMPTS
    configs = configs or default_configs(engine.draft is not None)
    runner = SpecdRunner(engine)
    cells: dict[tuple[str, float, str], Cell] = {}
    encoded = {k: engine.encode_prompt(v, chat=True) for k, v in prompts.items()}
    by_name = {c.name: c for c in configs}
    names = [c.name for c in configs]
    if peer is not None:
        names += [f"llama.cpp {m}" for m in peer_modes]
    footprint = Footprint()
    footprint.loaded("target", engine.target.resident_bytes)
    if engine.draft is not None:
        footprint.loaded("draft", engine.draft.resident_bytes)
    overall_peak = read_hwm()  # covers the loads, before any run resets the mark

    def run_one(name: str, ids: list[int], temp: float, tokens: int) -> RunResult:
        if name.startswith("llama.cpp"):
            assert peer is not None
            return peer.run(ids, name.removeprefix("llama.cpp "), temp, tokens, seed)
        return runner.run(ids, by_name[name], temp, tokens, seed)

    def models_of(name: str) -> frozenset[str]:
        if name.startswith("llama.cpp"):
            return frozenset({name})
        return runner.models_of(by_name[name])

    warm_ids = next(iter(encoded.values()))
    for name in names:
        before = rss_bytes()
        r = run_one(name, warm_ids, temperatures[0], warmup_tokens)
        footprint.warmed(models_of(name), rss_bytes() - before)
        overall_peak = max(overall_peak, before + r.run_peak_bytes)
    for rep in range(repeats):
        for pname, ids in encoded.items():
            for temp in temperatures:
                for name in names:
                    cell = cells.setdefault((pname, temp, name), Cell(pname, temp, name))
                    start = rss_bytes()
                    r = run_one(name, ids, temp, max_tokens)
                    r.memory_bytes = footprint.of(models_of(name), r.run_peak_bytes)
                    overall_peak = max(overall_peak, start + r.run_peak_bytes)
                    cell.runs.append(r)
                    log(f"[{rep + 1}/{repeats}] {pname:8s} T={temp:.1f} {name:24s} "
                        f"{r.decode_tps:6.2f} tok/s  accept-len {r.mean_acceptance_length:.2f}"
                        f"  {r.memory_bytes / 1e6:7.0f} MB")
    return {"cells": cells, "configs": names, "peak_rss": overall_peak}


PEER_TARGET = "llama.cpp target"  # weight_bytes key: the target's GGUF bytes read per token


def summarize(result: dict[str, Any], *, bandwidth: float | None, weight_bytes: dict[str, int],
              machine: str, command: str) -> dict[str, Any]:
    """`weight_bytes`: bytes read per decode step, by "target", "draft" (specd's layouts)
    and PEER_TARGET; each decode rate is also given as a multiple of the memory-bandwidth
    bound of a single target step of its runner (speculation can exceed 1)."""
    cells: dict[tuple[str, float, str], Cell] = result["cells"]
    bound = {k: bandwidth / v for k, v in weight_bytes.items()} if bandwidth else {}
    rows = []
    for (pname, temp, name), cell in cells.items():
        limit = bound.get(PEER_TARGET if name.startswith("llama.cpp") else "target")
        base = cells.get((pname, temp, "llama.cpp target-only"))
        own = cells.get((pname, temp, "target-only"))
        row = {
            "prompt": pname, "temperature": temp, "config": name,
            "decode_tps": round(cell.median("decode_tps"), 2),
            "decode_tps_range": [round(x, 2) for x in cell.spread("decode_tps")],
            "prefill_tps": round(cell.median("prefill_tps"), 1),
            "ttft_s": round(cell.median("ttft_s"), 3),
            "mean_acceptance_length": round(cell.median("mean_acceptance_length"), 3),
            "per_position": [round(statistics.median(v), 3) for v in zip(
                *[r.per_position for r in cell.runs if r.per_position], strict=False)],
            "split_ms_per_token": [round(statistics.median(v), 2) for v in zip(
                *[r.split_ms for r in cell.runs], strict=True)],
            "vs_target_only": round(cell.median("decode_tps") / own.median("decode_tps"), 3)
            if own else None,
            "vs_llama_cpp": round(cell.median("decode_tps") / base.median("decode_tps"), 3)
            if base else None,
            "vs_bound": round(cell.median("decode_tps") / limit, 3) if limit else None,
            "memory_mb": round(cell.median("memory_bytes") / 1e6),
        }
        rows.append(row)
    return {"machine": machine, "command": command, "date": time.strftime("%Y-%m-%d"),
            "bandwidth_gbs": round(bandwidth / 1e9, 2) if bandwidth else None,
            "weight_bytes": weight_bytes,
            "bound_tps": {k: round(v, 1) for k, v in bound.items()},
            "peak_rss_mb": round(result["peak_rss"] / 1e6, 1), "rows": rows}


def markdown_table(summary: dict[str, Any]) -> str:
    lines = ["| prompt | T | config | decode tok/s (min–max) | × target-only | × llama.cpp "
             "| × bound | accept len | per-position acceptance | ms/token draft+verify+other "
             "| prefill tok/s | TTFT s | memory MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lo, hi = r["decode_tps_range"]
        split = r["split_ms_per_token"]
        cols = [r["prompt"], r["temperature"], r["config"], f"{r['decode_tps']} ({lo}–{hi})",
                r["vs_target_only"] or "", r["vs_llama_cpp"] or "", r["vs_bound"] or "",
                r["mean_acceptance_length"], " ".join(map(str, r["per_position"])),
                "+".join(map(str, split)) if any(split) else "", r["prefill_tps"],
                r["ttft_s"], r["memory_mb"]]
        lines.append("| " + " | ".join(map(str, cols)) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Decode tokens/s per configuration, grouped by prompt and temperature (min–max as
    error bars, llama.cpp hatched), and acceptance per draft position of the fixed-length
    configurations (adaptive ones reach late positions too rarely to draw)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = summary["rows"]
    groups = list(dict.fromkeys((r["prompt"], r["temperature"]) for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by_key = {(r["prompt"], r["temperature"], r["config"]): r for r in rows}
    colors = plt.get_cmap("tab10")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5),
                                   gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(len(configs), 1)
    for ci, name in enumerate(configs):
        xs, ys, lo, hi = [], [], [], []
        for gi, (p, t) in enumerate(groups):
            r = by_key.get((p, t, name))
            if r is None:
                continue
            xs.append(gi - 0.4 + width * (ci + 0.5))
            ys.append(r["decode_tps"])
            lo.append(r["decode_tps"] - r["decode_tps_range"][0])
            hi.append(r["decode_tps_range"][1] - r["decode_tps"])
        ax1.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name, color=colors(ci % 10),
                hatch="//" if name.startswith("llama.cpp") else None, edgecolor="white")
    ax1.set_xticks(range(len(groups)), [f"{p}\nT = {t}" for p, t in groups])
    ax1.set_ylabel("decode tokens/s (median, min–max)")
    ax1.legend(fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax1.grid(axis="y", alpha=0.3)
    styles = {0.0: "-", 0.7: "--"}
    prompts = list(dict.fromkeys(p for p, _ in groups))
    for p, t in groups:
        for ci, name in enumerate(configs):
            r = by_key.get((p, t, name))
            if r is None or not r["per_position"] or "adaptive" in name:
                continue
            ax2.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o",
                     markersize=3, color=colors(prompts.index(p) % 10),
                     linestyle=styles.get(t, ":"),
                     alpha=0.4 + 0.6 * (ci + 1) / len(configs), label=f"{p} T {t} {name}")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("conditional acceptance (median)")
    ax2.set_ylim(0, 1.02)
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.grid(alpha=0.3)
    if ax2.lines:
        ax2.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{summary.get('machine', '')}   {summary.get('date', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def write_outputs(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(summary, indent=1))
    paths[1].write_text(markdown_table(summary) + "\n")
    if plot(summary, out_dir / "bench.png"):
        paths.append(out_dir / "bench.png")
    return paths


def machine_description() -> str:
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
