"""`specd bench`: speed of every speculation configuration on the same prompts, side by side.

One process loads the target (and draft) once; each (prompt, temperature, configuration)
runs `repeats` times, interleaved round-robin so every configuration sees the same
machine state; medians and spread are reported. The optional peer (llama-server,
`peer.py`) runs the same prompts on the same GGUF files in the same rounds; `report.py`
turns the runs into JSON, a markdown table and a plot.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from specd.daemon.drafters.registry import MODEL_SPEC_TYPES, make_drafter
from specd.daemon.serving.engine import Engine
from specd.daemon.spec.drafter import Drafter, DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.policy import PolicyMemory
from specd.daemon.spec.sampling import SamplerParams
from specd.memory_fit.rss import PeakRss, lifetime_peak

if TYPE_CHECKING:
    from .peer import LlamaServerPeer

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
    spec: str  # none | draft | ngram | draft+ngram
    n_max: int = 0
    adaptive: bool = False
    p_min: float = 0.0


def parse_config(name: str) -> BenchConfig:
    """`target-only`, `draft n_max=K`, `draft adaptive`, `ngram n_max=K`, `ngram adaptive`,
    `draft+ngram n_max=K`, `draft+ngram adaptive` (adaptive drafts at most 8); a
    configuration with a draft model may add `p_min=P` (stop drafting where the draft's
    top probability falls below P)."""
    spec, _, rest = name.strip().partition(" ")
    if spec == "target-only" and not rest:
        return BenchConfig("target-only", "none")
    words = rest.split()
    p_min = 0.0
    if spec in MODEL_SPEC_TYPES and len(words) == 2 and words[1].startswith("p_min="):
        try:
            p_min = float(words[1].removeprefix("p_min="))
        except ValueError:
            p_min = 0.0  # refused below, as p_min=0 is
        words = words[:1] if 0.0 < p_min <= 1.0 else []
    suffix = f" p_min={p_min:g}" if p_min else ""
    if spec in (*MODEL_SPEC_TYPES, "ngram") and len(words) == 1:
        if words[0] == "adaptive":
            return BenchConfig(f"{spec} adaptive{suffix}", spec, 8, adaptive=True, p_min=p_min)
        key, _, value = words[0].partition("=")
        if key == "n_max" and value.isdigit() and int(value) > 0:
            return BenchConfig(f"{spec} n_max={int(value)}{suffix}", spec, int(value),
                               p_min=p_min)
    raise ValueError(f"unknown bench configuration {name!r} (target-only, draft n_max=K, "
                     "draft adaptive, ngram n_max=K, ngram adaptive, draft+ngram n_max=K, "
                     "draft+ngram adaptive; those with a draft model may add p_min=P, "
                     "0 < P <= 1)")


def default_configs(has_draft: bool) -> list[BenchConfig]:
    names = ["target-only"]
    if has_draft:
        names += ["draft n_max=2", "draft n_max=4", "draft n_max=8", "draft adaptive",
                  "draft+ngram adaptive"]
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
    split_ms: tuple[float, ...] = (0.0, 0.0, 0.0)
    peak_bytes: int = 0  # the process's peak RSS during the run
    start_bytes: int = 0  # its RSS when the run began
    growth_bytes: int = 0  # what the run left allocated (arenas grown, pages mapped in)
    memory_bytes: int = 0  # the configuration's share (Footprint.of)
    lookup_share: float = 0.0  # drafting rounds whose draft came from a prompt lookup


@dataclass
class Cell:
    prompt: str
    temperature: float
    config: str
    runs: list[RunResult] = field(default_factory=list)
    # target-only only: a second run at the end of each repeat's group, so the others
    # are compared with the machine state on both sides of them (`closing_runs[i]`
    # closes the group `runs[i]` opened)
    closing_runs: list[RunResult] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)

    def spread(self, attr: str) -> tuple[float, float]:
        vals = [getattr(r, attr) for r in self.runs]
        return min(vals), max(vals)


class Footprint:
    """Memory each configuration needs, measured in the one process that holds them all.

    A configuration is charged the RSS growth its models caused when they loaded, and the
    lasting growth of runs (arenas grown, pages mapped in): to the models that ran for the
    first time in that run, else to the configuration itself (a longer verify block or
    context than before); plus, per run, the peak above the RSS the run began at.
    Warm-up runs (target-only first, the longest prompt, full length) take most of the
    lasting growth, so the timed runs are charged alike whatever order they run in.
    """

    def __init__(self) -> None:
        self.resident: dict[frozenset[str], int] = {}
        self.warm: set[str] = set()

    def _charge(self, key: frozenset[str], nbytes: int) -> None:
        self.resident[key] = self.resident.get(key, 0) + max(nbytes, 0)

    def loaded(self, model: str, nbytes: int) -> None:
        self._charge(frozenset({model}), nbytes)

    def grew(self, config: str, models: frozenset[str], growth: int) -> None:
        self._charge(models - self.warm or frozenset({config}), growth)
        self.warm |= models

    def of(self, config: str, models: frozenset[str], run: RunResult) -> int:
        """Memory of `run`, before its own lasting growth is charged (its peak has it)."""
        mine = models | {config}
        held = sum(v for k, v in self.resident.items() if k <= mine)
        return held + max(run.peak_bytes - run.start_bytes, 0)


def measure_bandwidth(gib: float = 1.0, repeats: int = 5, threads: int = 1) -> float:
    """Read bandwidth in bytes/s: numpy sums over a buffer far larger than the caches, one
    slice per thread (numpy releases the GIL in them), the best of `repeats`."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(int(gib * (1 << 30)) // 8, dtype=np.float64)
    parts = np.array_split(a, max(threads, 1))
    best = 0.0
    with ThreadPoolExecutor(len(parts)) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t))
    return best


class SpecdRunner:
    def __init__(self, engine: Engine):
        self.engine = engine

    def drafter_for(self, cfg: BenchConfig) -> Drafter | None:
        return make_drafter(cfg.spec, self.engine.drafter_inputs())

    def run(self, prompt: list[int], cfg: BenchConfig, temperature: float, max_tokens: int,
            seed: int | None, memory: PolicyMemory | None = None,
            coupled: bool | None = None) -> RunResult:
        """One request, alone; `memory`: its adaptive policy starts from (and leaves its
        estimates to) it, as an engine's requests do (None: a fresh policy, as `specd
        generate`'s one request); `coupled`: GenerationParams.coupled (None: a seeded
        request's drafts are coupled)."""
        params = GenerationParams(
            max_tokens=max_tokens, ignore_eos=True,
            sampling=SamplerParams(temperature=temperature, seed=seed),
            draft=DraftParams(n_max=cfg.n_max, p_min=cfg.p_min), adaptive=cfg.adaptive,
            coupled=coupled)
        gen = Generation(self.engine.target.runner, 0, prompt, params,
                         eog=self.engine.eog_ids, drafter=self.drafter_for(cfg), memory=memory)
        with PeakRss(interval_s=0.05) as peak:
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
                         tuple(round(x, 2) for x in split), peak_bytes=peak.peak,
                         start_bytes=peak.start, growth_bytes=peak.growth,
                         lookup_share=s.lookup_rounds / s.rounds if s.rounds else 0.0)

    @staticmethod
    def models_of(cfg: BenchConfig) -> frozenset[str]:
        return frozenset({"target", "draft"} if cfg.spec in MODEL_SPEC_TYPES else {"target"})


def run_bench(engine: Engine, *, prompts: dict[str, str] | None = None,
              temperatures: tuple[float, ...] = (0.0, 0.7), max_tokens: int = 256,
              repeats: int = 3, configs: list[BenchConfig] | None = None,
              peer: LlamaServerPeer | None = None, peer_modes: tuple[str, ...] = ("target-only",),
              seed: int = 1234, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (prompt, temperature, configuration) `repeats` times, round-robin, after one
    untimed warm-up run per configuration on the longest prompt (first-run allocations
    and cold caches are not timed; they are charged to the configuration's memory).

    Each repeat of a (prompt, temperature) runs the configurations back to back; specd's
    target-only, when there are others, runs at both ends of that group (`Cell.runs`,
    `Cell.closing_runs`), so each configuration's ratio to it is taken against the
    machine state around it, and the two target-only runs of a group show how far the
    machine alone moved a ratio (`bench_report`)."""
    prompts = prompts or PROMPTS
    configs = configs or default_configs(engine.draft is not None)
    runner = SpecdRunner(engine)
    cells: dict[tuple[str, float, str], Cell] = {}
    encoded = {k: engine.encode_prompt(v, chat=True) for k, v in prompts.items()}
    by_name = {c.name: c for c in configs}
    names = list(by_name)
    if peer is not None:
        names += [f"llama.cpp {m}" for m in peer_modes]
    footprint = Footprint()
    footprint.loaded("target", engine.target.resident_bytes)
    if engine.draft is not None:
        footprint.loaded("draft", engine.draft.resident_bytes)
    overall_peak = lifetime_peak()  # covers the loads, before any run resets the mark

    def run_one(name: str, ids: list[int], temp: float) -> RunResult:
        if name.startswith("llama.cpp"):
            assert peer is not None
            return peer.run(ids, name.removeprefix("llama.cpp "), temp, max_tokens, seed)
        return runner.run(ids, by_name[name], temp, max_tokens, seed)

    def models_of(name: str) -> frozenset[str]:
        if name.startswith("llama.cpp"):
            return frozenset({name})
        return runner.models_of(by_name[name])

    longest = max(encoded.values(), key=len)
    bracket = "target-only" in by_name and len(names) > 1
    for name in sorted(names, key=lambda n: len(models_of(n))):  # target-only first
        r = run_one(name, longest, temperatures[0])
        footprint.grew(name, models_of(name), r.growth_bytes)
        overall_peak = max(overall_peak, r.peak_bytes)
        log(f"[warm-up] {name:24s} {r.decode_tps:6.2f} tok/s")
    # a repeat's group: every configuration, then target-only again to close it
    group = [(name, False) for name in names] + ([("target-only", True)] if bracket else [])
    for rep in range(repeats):
        for pname, ids in encoded.items():
            for temp in temperatures:
                for name, closing in group:
                    cell = cells.setdefault((pname, temp, name), Cell(pname, temp, name))
                    r = run_one(name, ids, temp)
                    r.memory_bytes = footprint.of(name, models_of(name), r)
                    footprint.grew(name, models_of(name), r.growth_bytes)
                    overall_peak = max(overall_peak, r.peak_bytes)
                    (cell.closing_runs if closing else cell.runs).append(r)
                    label = f"{name} (closing)" if closing else name
                    log(f"[{rep + 1}/{repeats}] {pname:8s} T={temp:.1f} {label:24s} "
                        f"{r.decode_tps:6.2f} tok/s  accept-len {r.mean_acceptance_length:.2f}"
                        f"  {r.memory_bytes / 1e6:7.0f} MB")
    return {"cells": cells, "configs": names, "peak_rss": overall_peak}
