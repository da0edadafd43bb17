"""How fast each weight layout streams: ONNX Runtime's MatMulNBits and specd's GgufMatMul.

    python bench/matmul_layouts.py [--k 1536] [--n 8960] [--threads 2] [--repeats 15]
                        [--sizes 1,3]
                        [--layouts 4:32:zp,4:32,4:64,4:128,4:256,8:16,8:32,gguf:Q4_K,gguf:Q6_K]

A layout is bits:block_size[:zp] (zp: an explicit uint8 zero point per block, as specd
writes Q4_K for MatMulNBits), or gguf:TYPE for specd's GgufMatMul on that GGUF type's
own blocks (regrouped 16 rows at a time, ort_models/gguf_layouts.py). For each one a
session multiplies a [M, K] activation by enough distinct [N, K] matrices (random codes
and scales, accuracy_level 4 as specd runs them) that they cannot stay in the CPU caches,
so each call reads its weights from memory the way a decode step does; a second session
repeats one matrix, which the caches then hold.
Prints ms per matrix and the layout's bytes over that time (data + fp32 scales + zero
points), next to numpy's read bandwidth over the same threads: the gap between the two
is what the kernel, not the memory, costs. For MatMulNBits GGUF Q4_K maps to 4:32:zp and
Q6_K to 8:16 (see ort_models/quant.py); llama.cpp reads those files at 4.5 and 6.56 bits
per weight, GgufMatMul at 4.62 and 6.56. GGUF Q4_0 / Q4_1 map to 4:32 / 4:32:zp (5 /
5.25 bits per weight), which GgufMatMul reads at their own 4.5 / 5.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specd.daemon.benchmark.run import measure_bandwidth
from specd.ort_models import native_ops
from specd.ort_models.gguf_layouts import BLOCK_BYTES, GROUP, GROUP_BYTES, regroup

STREAM_BYTES = 512 << 20  # weights per streaming session: far past any L3


def layout_bytes(bits: int | str, bs: int, zp: bool, n: int, k: int) -> int:
    if isinstance(bits, str):  # gguf:TYPE
        return -(-n // GROUP) * k // block_cols(bits) * GROUP_BYTES[bits]
    blocks = n * (k // bs)
    return n * k * bits // 8 + blocks * 4 + (n * ((k // bs * bits + 7) // 8) if zp else 0)


def block_cols(type_name: str) -> int:
    """Columns of one GGUF block: 256 (K-quants), 32 (Q4_0 / Q4_1)."""
    return 256 if type_name.endswith("_K") else 32


def gguf_rows(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF rows of `type_name` with sane f16 factors (no NaN or subnormal)."""
    raw = rng.integers(0, 256, size=(n, k // block_cols(type_name), BLOCK_BYTES[type_name]),
                       dtype=np.uint8)
    f16 = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    offsets = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[type_name]
    for off in offsets:
        raw[..., off:off + 2] = f16
    return regroup(type_name, raw.reshape(n, -1), n, k)


def build(bits: int | str, bs: int, zp: bool, n: int, k: int, copies: int, threads: int,
          rng: np.random.Generator) -> ort.InferenceSession:
    nb = k // bs
    nodes, inits, outs = [], [], []
    for c in range(copies):
        if isinstance(bits, str):
            inits.append(numpy_helper.from_array(gguf_rows(bits, n, k, rng), f"B{c}"))
            nodes.append(helper.make_node("GgufMatMul", ["A", f"B{c}"], [f"Y{c}"],
                                          domain=native_ops.DOMAIN, K=k, N=n,
                                          ggml_type=native_ops.GGUF_MATMUL_TYPES[bits]))
            outs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, [None, n]))
            continue
        ins = ["A", f"B{c}", f"S{c}"]
        inits.append(numpy_helper.from_array(
            rng.integers(0, 256, size=(n, nb, bs * bits // 8), dtype=np.uint8), f"B{c}"))
        inits.append(numpy_helper.from_array(
            (rng.random((n, nb), dtype=np.float32) * 0.01 + 1e-3).astype(np.float32), f"S{c}"))
        if zp:
            inits.append(numpy_helper.from_array(
                np.zeros((n, (nb * bits + 7) // 8), np.uint8), f"Z{c}"))
            ins.append(f"Z{c}")
        nodes.append(helper.make_node("MatMulNBits", ins, [f"Y{c}"], domain="com.microsoft",
                                      K=k, N=n, bits=bits, block_size=bs, accuracy_level=4))
        outs.append(helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, [None, n]))
    graph = helper.make_graph(
        nodes, "layouts", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
        outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid(native_ops.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if isinstance(bits, str):
        native_ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--n", type=int, default=8960)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sizes", default="1,3", help="rows M of the activations, from memory")
    ap.add_argument("--layouts",
                    default="4:32:zp,4:32,4:64,4:128,4:256,8:16,8:32,gguf:Q4_K,gguf:Q6_K")
    args = ap.parse_args()
    sizes = sorted({1, *(int(m) for m in args.sizes.split(","))})
    rng = np.random.default_rng(0)
    layouts = []
    for spec in args.layouts.split(","):
        parts = spec.split(":")
        if parts[0] == "gguf":
            layouts.append((parts[1], 256, False))
            continue
        layouts.append((int(parts[0]), int(parts[1]), parts[2:] == ["zp"]))
    sessions = {}
    for bits, bs, zp in layouts:
        size = layout_bytes(bits, bs, zp, args.n, args.k)
        copies = max(STREAM_BYTES // size, 1)
        sessions[bits, bs, zp] = (size, copies,
                                  build(bits, bs, zp, args.n, args.k, copies, args.threads, rng),
                                  build(bits, bs, zp, args.n, args.k, 1, args.threads, rng))
    times: dict[tuple, list[float]] = {}
    for rep in range(args.repeats + 1):  # interleaved: every layout sees the same machine
        for key, (_, copies, stream, cached) in sessions.items():
            for m in sizes:
                a = {"A": rng.standard_normal((m, args.k), dtype=np.float32)}
                t0 = time.perf_counter()
                stream.run(None, a)
                t1 = time.perf_counter()
                if m == 1:
                    for _ in range(copies):
                        cached.run(None, a)
                t2 = time.perf_counter()
                if rep:  # the first round warms up
                    times.setdefault((key, m, "mem"), []).append((t1 - t0) / copies)
                    if m == 1:
                        times.setdefault((key, m, "cache"), []).append((t2 - t1) / copies)
    bw = measure_bandwidth(threads=args.threads)
    print(f"K={args.k} N={args.n}, {args.threads} threads, numpy read bandwidth "
          f"{bw / 1e9:.1f} GB/s\n")
    print("| layout | bits/weight | from memory M=1 | "
          + " | ".join(f"M={m}" for m in sizes[1:]) + " | cache-resident M=1 |")
    print("|---|---|---|" + "---|" * len(sizes))
    for (bits, bs, zp), (size, _, _, _) in sessions.items():
        cells = []
        for m, where in [(m, "mem") for m in sizes] + [(1, "cache")]:
            t = statistics.median(times[(bits, bs, zp), m, where])
            cells.append(f"{t * 1e3:.3f} ms ({size / t / 1e9:.1f} GB/s)" if m == 1
                         else f"{t * 1e3:.3f} ms")
        name = (f"GgufMatMul {bits}" if isinstance(bits, str)
                else f"{bits}-bit bs{bs}{' + zp' if zp else ''}")
        print(f"| {name} | {size * 8 / (args.n * args.k):.2f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
