"""HTTP overhead and aggregate throughput of the daemon.

    python bench/http_overhead.py [-m MODEL] [--tokens 128]

In one process: a generation in-process (Generation loop) vs the same request as one
stream over HTTP (real aiohttp server on loopback), then aggregate tokens/s with 1, 2
and 4 concurrent streams (slots = 4).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from specd.daemon.serving.engine import EngineConfig
from specd.daemon.spec.generation import GenerationParams
from specd.ipc.client import Client

from live_server import live_server


def in_process(engine, prompt: list[int], n: int) -> float:
    gen = engine.start(0, prompt, GenerationParams(max_tokens=n, ignore_eos=True))
    gen.prefill()
    t0 = time.perf_counter()
    while not gen.done:
        gen.step()
    return (len(gen.tokens) - 1) / (time.perf_counter() - t0)


def over_http(port: int, text: str, n: int) -> tuple[float, int]:
    c = Client(port=port)
    first = None
    count = 0
    for ev in c.stream("/completion", {"prompt": text, "n_predict": n, "ignore_eos": True}):
        if ev.get("stop"):
            break
        count += len(ev.get("tokens", []))
        if first is None:
            first = time.perf_counter()
    assert first is not None
    return (count - 1) / (time.perf_counter() - first), count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    text = "Write a Python class for a binary search tree with insert and search."
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(target=args.model, spec_type="none", n_ctx=1024, slots=4)
        with live_server(cfg, Path(tmp)) as srv:
            engine = srv.service.engine
            prompt = engine.tokenizer.encode(text)
            rows = []
            for _ in range(args.repeats):
                a = in_process(engine, prompt, args.tokens)
                b, _ = over_http(srv.port, text, args.tokens)
                rows.append((a, b))
            print("| run | in-process tok/s | one HTTP stream tok/s | overhead |")
            print("|---|---|---|---|")
            for i, (a, b) in enumerate(rows):
                print(f"| {i + 1} | {a:.2f} | {b:.2f} | {100 * (1 - b / a):.1f}% |")
            print("\n| concurrent streams | aggregate tok/s | per stream tok/s |")
            print("|---|---|---|")
            for k in (1, 2, 4):
                counts: list[int] = []

                def worker(counts: list[int] = counts) -> None:
                    counts.append(over_http(srv.port, text, args.tokens)[1])

                t0 = time.perf_counter()
                threads = [threading.Thread(target=worker) for _ in range(k)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                dt = time.perf_counter() - t0
                print(f"| {k} | {sum(counts) / dt:.2f} | {sum(counts) / dt / k:.2f} |")


if __name__ == "__main__":
    main()
