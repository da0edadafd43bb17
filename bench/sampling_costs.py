"""Time per emitted token spent deciding tokens: on the host from the logits, or in the
graph (SampleTokens), at T 0 and T 0.7, target-only and with the draft model.

    python bench/sampling_costs.py [--tokens 128] [--repeats 3] [--out FILE.json]

Each configuration decodes the same code prompt, host and graph runs alternating so both
see the same machine state. Per emitted token it reports:

- outside: the decode's wall time outside ONNX Runtime's session runs (both models'
  passes): the host's sampling and verification where they run there, and the round's
  bookkeeping, which both paths share;
- decide: the decision's own cost. Host: the target's verification (`Generation._verify`)
  and the draft's picks (`pick_token`). Graph: building the specs, packing the node's
  inputs, reading its outputs back into the round's result, and the node itself inside
  the pass, estimated as the rows it decided times its time alone on such a row (timed
  below, through a session of the node alone, less that session's own cost). The host
  path's copy of each logits row out of the session is in `outside` but not in `decide`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

import specd.daemon.drafters.draft_model as draft_model
import specd.daemon.spec.generation as generation
import specd.ort_models.sampling_op as sampling_op
from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.ort_models.runner import ModelRunner
from specd.ort_models.sampling_op import SampleSpec

PROMPT = ("<|im_start|>user\nWrite a Python function that parses a CSV file of orders and "
          "returns the total per customer, with type hints and a docstring.<|im_end|>\n"
          "<|im_start|>assistant\n")
DRAFT_TOP_K = 10  # the draft's q: GenerationParams.draft_top_k


class Clocks:
    """Seconds inside session runs, in the decision's functions, and rows decided in the
    graph (target rows, draft rows)."""

    def __init__(self) -> None:
        self.session = 0.0
        self.decide: dict[str, float] = defaultdict(float)
        self.rows = {"target": 0, "draft": 0}

    def time_session(self, runner: ModelRunner) -> None:
        real = runner.session.run_with_iobinding

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                self.session += time.perf_counter() - t0

        runner.session.run_with_iobinding = timed

    def time_calls(self, owner: Any, name: str, path: str) -> None:
        """Count the seconds in `owner.name` towards the decision cost of `path`."""
        real: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                self.decide[path] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def count_rows(self) -> None:
        real = sampling_op.pack_inputs

        def counted(specs: list[SampleSpec | None], *args: Any) -> Any:
            for s in specs:
                if s is not None:
                    self.rows["draft" if s.stream else "target"] += s.rows
            return real(specs, *args)

        sampling_op.pack_inputs = counted  # type: ignore[assignment]


def instrument(clocks: Clocks) -> None:
    for owner, name, path in (
            (Generation, "_verify", "host"), (draft_model, "pick_token", "host"),
            (Generation, "_round_spec", "graph"), (generation, "block_result", "graph"),
            (sampling_op, "pack_inputs", "graph"), (sampling_op, "unpack_outputs", "graph"),
            (draft_model, "pick_spec", "graph"), (draft_model, "pick_from_block", "graph")):
        clocks.time_calls(owner, name, path)
    clocks.count_rows()


def decode(engine: Engine, prompt: list[int], params: GenerationParams, clocks: Clocks,
           op_ms: dict[str, float]) -> dict[str, float]:
    gen = engine.start(0, prompt, params)
    gen.prefill()
    session0, decide0, rows0 = clocks.session, dict(clocks.decide), dict(clocks.rows)
    t0 = time.perf_counter()
    while not gen.done:
        gen.step()
    wall = time.perf_counter() - t0
    n = max(gen.stats.decoded_tokens, 1)
    path = "graph" if params.backend_sampling else "host"
    decide = clocks.decide[path] - decide0.get(path, 0.0)
    if path == "graph":  # the node inside the passes: rows decided x its time on one
        decide += 1e-3 * sum((clocks.rows[k] - rows0[k]) * op_ms[k] for k in rows0)
    out = {"tokens": n, "tok_s": n / wall,
           "outside_ms": 1e3 * (wall - (clocks.session - session0)) / n,
           "decide_ms": 1e3 * decide / n, "acceptance": gen.stats.mean_acceptance_length}
    gen.close()
    return out


def op_alone_ms(vocab: int, temperature: float, top_k: int = 0, repeats: int = 300) -> float:
    """ms per decided row of the SampleTokens node alone on [1, vocab] logits: a session of
    the node deciding the row, less the same session with the call skipped (its own cost,
    which a model's pass does not add)."""
    import onnxruntime as ort

    from specd.ort_models.graph_builder.sampling import sampler_model
    from specd.ort_models.runner import session_options
    from specd.ort_models.sampling_op import pack_inputs

    sess = ort.InferenceSession(sampler_model(vocab).SerializeToString(),
                                session_options(1, native=True),
                                providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((1, vocab)) * 3).astype(np.float32)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeats):
        spec = SampleSpec(key=7, position=100 + i, temperature=temperature, top_k=top_k,
                          candidates=top_k)
        for decided in (False, True):
            feeds = {"logits": logits, **pack_inputs([spec if decided else None], [0], vocab)}
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times[decided].append(time.perf_counter() - t0)
    return 1e3 * (statistics.median(times[True]) - statistics.median(times[False]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engines = {"target-only": Engine(EngineConfig(target=args.target, spec_type="none",
                                                  n_ctx=1024)),
               "draft": Engine(EngineConfig(target=args.target, draft=args.draft,
                                            spec_type="draft", n_ctx=1024))}
    vocab = engines["target-only"].target.runner.logits_width
    draft_runner = getattr(engines["draft"].drafter, "runner", None)
    assert isinstance(draft_runner, ModelRunner)
    alone = {t: {"target": op_alone_ms(vocab, t),
                 "draft": op_alone_ms(draft_runner.logits_width, t,
                                      DRAFT_TOP_K if t else 0)} for t in (0.0, 0.7)}
    print(f"SampleTokens alone, one row: T 0 {alone[0.0]['target']:.3f} ms (target), "
          f"{alone[0.0]['draft']:.3f} ms (draft); T 0.7 {alone[0.7]['target']:.3f} ms "
          f"(target, no truncation), {alone[0.7]['draft']:.3f} ms (draft, top-k "
          f"{DRAFT_TOP_K})", flush=True)
    clocks = Clocks()
    instrument(clocks)
    rows: list[dict[str, Any]] = []
    for label, engine in engines.items():
        clocks.time_session(engine.target.runner)
        draft = getattr(engine.drafter, "runner", None)
        if isinstance(draft, ModelRunner):
            clocks.time_session(draft)
        prompt = engine.encode_prompt(PROMPT)
        for temperature in (0.0, 0.7):
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for r in range(args.repeats):
                for graph in (False, True):
                    params = GenerationParams(
                        max_tokens=args.tokens, ignore_eos=True, backend_sampling=graph,
                        sampling=SamplerParams(temperature=temperature, seed=r),
                        draft=DraftParams(n_max=8))
                    runs[graph].append(decode(engine, prompt, params, clocks,
                                              alone[temperature]))
            for graph, got in runs.items():
                row = {"config": label, "temperature": temperature,
                       "sampling": "graph" if graph else "host",
                       **{k: statistics.median(g[k] for g in got) for k in got[0]}}
                rows.append(row)
                print(f"{label:12} T {temperature:.1f} {row['sampling']:5}  "
                      f"{row['tok_s']:6.1f} tok/s  decide {row['decide_ms']:6.3f} ms/tok  "
                      f"outside passes {row['outside_ms']:6.3f} ms/tok  acceptance "
                      f"{row['acceptance']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "op_alone_ms": {str(t): v for t, v in alone.items()},
                       "tokens": args.tokens, "repeats": args.repeats}, f, indent=1)


if __name__ == "__main__":
    main()
