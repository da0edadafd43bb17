"""Mixture-of-experts decode speed: specd beside llama-server on random-weight files of the
real models' shapes, and what a verify row costs against a decode row.

    python bench/moe_speed.py [--model qwen3-30b-a3b|gpt-oss-20b] [--layers N]
                              [--tokens 64] [--repeats 3] [-t 2] [--out DIR]

A pass's speed does not depend on the weights' values, so the file holds random blocks of
the real model's types and shapes (Qwen3-30B-A3B at Q4_K_M: Q4_K experts, Q6_K down
experts, Q4_K attention, Q6_K output; gpt-oss-20b as ggml-org ships it: MXFP4 experts, Q8_0
attention and output, F32 biases and sinks), every block's scales finite; `--layers`
scales the depth down where 24 GB of RAM cannot hold the whole model (the widths, the
experts and the vocabulary stay the real ones; say the scale with the figures). Each
repeat, alternating which goes first:

* llama-server (same file, same threads): `timings.predicted_per_second` of greedy decoding;
* specd's target graph, one token a call (target-only);
* specd with prompt lookup under the adaptive policy (a random model seldom repeats, so
  this shows what drafting costs when it does not pay: it must not be slower);

then specd's pass over 1 .. 5 rows after the prompt, seconds per pass against one row's:
what a verify row costs on an MoE target, whose rows wake up to rows x top-k experts
(random routers: close to that many). Bytes read per token: the dense matrices plus
n_used experts per layer, against the memory bandwidth a copy of 1 GB measures here (the
physical limit: bandwidth / bytes per token). Run it on a quiet machine; `--tokens 8
--layers 1 --tiny` is the smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from specd.daemon.benchmark import llama_cpp
from specd.daemon.benchmark.llama_server import LlamaServer
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.models.building import build_options
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from tiny_gguf import add_tokenizer, build_vocab

# the f16 scales' byte offsets in a block (tensor_checks.SCALE_OFFSETS's), set finite
F16_SCALES = {"Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


@dataclass(frozen=True)
class Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_vocab: int
    expert_type: str
    down_type: str
    attn_type: str
    output_type: str


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936, "Q4_K",
                           "Q6_K", "Q4_K", "Q6_K"),
    "gpt-oss-20b": Shape("gpt-oss", 24, 2880, 64, 8, 64, 32, 4, 2880, 201088, "MXFP4",
                         "MXFP4", "Q8_0", "Q8_0"),
    # the smoke run's: the code paths of both, seconds to write
    "tiny-qwen3moe": Shape("qwen3moe", 2, 256, 4, 2, 64, 8, 2, 256, 512, "Q4_K", "Q6_K",
                           "Q4_K", "Q6_K"),
    "tiny-gpt-oss": Shape("gpt-oss", 2, 256, 4, 2, 64, 8, 2, 256, 512, "MXFP4", "MXFP4",
                          "Q8_0", "Q8_0"),
}


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: str) -> np.ndarray:
    """Random blocks of `qtype` for a tensor of `shape` (rows last), scales finite and
    small: uint8 [..., row bytes]."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype == "MXFP4":  # e8m0 scale byte first: 2^(e - 127), e near 2^-7
        raw[:, 0] = rng.integers(118, 122, n_blocks, dtype=np.uint8)
    for at in F16_SCALES.get(qtype, ()):
        raw[:, at:at + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def write_model(path: Path, s: Shape, seed: int = 0) -> Path:
    """A random-weight file of shape `s` (the module docstring)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), s.arch)
    a = s.arch
    w.add_context_length(4096)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff_exp)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(150000.0 if a == "gpt-oss" else 1e6)
    w.add_uint32(f"{a}.expert_count", s.n_expert)
    w.add_uint32(f"{a}.expert_used_count", s.n_used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    if a == "gpt-oss":
        w.add_uint32(f"{a}.attention.sliding_window", 128)
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", 32.0)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
    add_tokenizer(w, build_vocab("qwen2", s.n_vocab))

    def vec(name: str, n: int | tuple[int, ...], value: float | None = None) -> None:
        v = np.full(n, value, np.float32) if value is not None else (
            0.02 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, v)

    def mat(name: str, shape: tuple[int, ...], qtype: str) -> None:
        w.add_tensor(name, random_blocks(rng, shape, qtype),
                     raw_dtype=GGMLQuantizationType[qtype])

    e, d = s.n_embd, s.head_dim
    mat("token_embd.weight", (s.n_vocab, e), s.output_type)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", e, 1.0)
        vec(p + ("post_attention_norm.weight" if a == "gpt-oss" else "ffn_norm.weight"), e,
            1.0)
        for name, rows in (("attn_q", s.n_head * d), ("attn_k", s.n_head_kv * d),
                           ("attn_v", s.n_head_kv * d)):
            mat(p + name + ".weight", (rows, e), s.attn_type)
            if a == "gpt-oss":
                vec(p + name + ".bias", rows)
        mat(p + "attn_output.weight", (e, s.n_head * d), s.attn_type)
        if a == "gpt-oss":
            vec(p + "attn_output.bias", e)
            vec(p + "attn_sinks.weight", s.n_head)
            vec(p + "ffn_gate_inp.bias", s.n_expert)
        else:
            vec(p + "attn_q_norm.weight", d, 1.0)
            vec(p + "attn_k_norm.weight", d, 1.0)
        w.add_tensor(p + "ffn_gate_inp.weight",
                     (rng.standard_normal((s.n_expert, e)) / np.sqrt(e)).astype(np.float32))
        for name, shape, qt in (("ffn_gate_exps", (s.n_expert, s.n_ff_exp, e), s.expert_type),
                                ("ffn_up_exps", (s.n_expert, s.n_ff_exp, e), s.expert_type),
                                ("ffn_down_exps", (s.n_expert, e, s.n_ff_exp), s.down_type)):
            mat(p + name + ".weight", shape, qt)
            if a == "gpt-oss":
                vec(p + name + ".bias", shape[:2])
    vec("output_norm.weight", e, 1.0)
    mat("output.weight", (s.n_vocab, e), s.output_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bytes_per_token(s: Shape) -> tuple[float, float]:
    """(expert bytes, all bytes) a decode step reads: n_used experts per layer, and the
    attention, router and output matrices."""
    def nbytes(n: int, qtype: str) -> float:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        return n / block * size

    e, d = s.n_embd, s.head_dim
    expert = (2 * nbytes(s.n_ff_exp * e, s.expert_type) + nbytes(e * s.n_ff_exp, s.down_type))
    attn = nbytes(e * d * (2 * s.n_head + 2 * s.n_head_kv), s.attn_type)
    experts = s.n_layer * s.n_used * expert
    dense = s.n_layer * (attn + 4 * s.n_expert * e) + nbytes(s.n_vocab * e, s.output_type)
    return experts, experts + dense


def copy_bandwidth(gb: float = 1.0) -> float:
    """Bytes per second of a large copy (read + write counted once: the read side)."""
    src = np.ones(int(gb * 2**30) // 8)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, src.nbytes / (time.perf_counter() - t0))
    return best


def specd_decode(runner: ModelRunner, prompt: list[int], n: int) -> float:
    logits = runner.prefill(0, prompt)
    t0 = time.perf_counter()
    for i in range(n):
        logits = runner.forward(0, [int(np.argmax(logits))], len(prompt) + i)[0]
    return n / (time.perf_counter() - t0)


def specd_lookup(built: object, prompt: list[int], n: int, threads: int) -> tuple[float, int]:
    """tokens/s of greedy decoding with prompt lookup, adaptive; tokens drafted."""
    gen = Generation(ModelRunner(built, n_ctx=1024, threads=threads), 0, prompt,
                     GenerationParams(max_tokens=n, ignore_eos=True, adaptive=True,
                                      draft=DraftParams(n_max=4, probabilistic=False)),
                     eog=set(), drafter=NgramDrafter())
    gen.prefill()
    while not gen.done:
        gen.step()
    gen.close()
    return gen.stats.decode_tps, gen.stats.drafted


def server_decode(server: LlamaServer, prompt: list[int], n: int) -> float:
    out = server.post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                      "top_k": 1, "cache_prompt": False, "ignore_eos": True})
    return float(out["timings"]["predicted_per_second"])


def verify_rows(runner: ModelRunner, prompt: list[int], rows: int, repeats: int) -> float:
    """Median seconds of a pass over `rows` rows after the prompt."""
    runner.prefill(0, prompt)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(0, list(range(7, 7 + rows)), len(prompt), [rows - 1])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=0, help="layers kept (0: all)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/specd-moe-speed"))
    ap.add_argument("--no-llama", action="store_true", help="specd only")
    args = ap.parse_args()
    s = SHAPES[args.model]
    if args.layers:
        s = Shape(**{**s.__dict__, "n_layer": min(args.layers, s.n_layer)})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.model}-L{s.n_layer}.gguf"
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        write_model(path, s)
    print(f"{args.model}: {s.n_layer} of {SHAPES[args.model].n_layer} layers, "
          f"{path.stat().st_size / 1e9:.2f} GB, {args.threads} threads")
    prompt = [100 + (i * 37) % 200 for i in range(32)]
    built = load_or_build(path, build_options("target"))
    runner = ModelRunner(built, n_ctx=1024, threads=args.threads)
    results: dict[str, list[float]] = {"specd": [], "specd+lookup": [], "llama-server": []}
    if not args.no_llama:
        llama_cpp.build()
    server = None if args.no_llama else LlamaServer(path, threads=args.threads, n_ctx=1024,
                                                    args=["-np", "1"])
    try:
        specd_decode(runner, prompt, 4)
        drafted = 0
        for i in range(args.repeats):
            runs = [lambda: results["specd"].append(specd_decode(runner, prompt, args.tokens))]
            if server is not None:
                runs.append(lambda: results["llama-server"].append(
                    server_decode(server, prompt, args.tokens)))
            for run in runs if i % 2 == 0 else runs[::-1]:
                run()
            tps, drafted = specd_lookup(built, prompt, args.tokens, args.threads)
            results["specd+lookup"].append(tps)
    finally:
        if server is not None:
            server.close()
    experts, total = bytes_per_token(s)
    bw = copy_bandwidth()
    for name, values in results.items():
        if values:
            print(f"{name:13s} {statistics.median(values):7.2f} tok/s  "
                  f"(min {min(values):.2f}, max {max(values):.2f})")
    print(f"specd+lookup drafted {drafted} tokens in its last run")
    print(f"bytes read per token: experts {experts / 1e6:.1f} MB, all {total / 1e6:.1f} MB; "
          f"copy bandwidth {bw / 1e9:.1f} GB/s: limit {bw / total:.1f} tok/s")
    verify_rows(runner, prompt, 1, args.repeats)  # warm
    passes = [verify_rows(runner, prompt, rows, args.repeats) for rows in range(1, 6)]
    for rows, t in enumerate(passes, 1):
        print(f"pass over {rows} rows: {t * 1e3:7.2f} ms ({t / passes[0]:.2f}x one row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
