"""Concurrent streams over HTTP: specd serve beside llama-server -np N, in one run.

    python bench/parallel_streams.py [--streams 1 2 4 8] [--tokens 128]
        [--servers specd-none,specd-draft,llama-none,llama-draft] [--out FILE.json]

For each server configuration and each N, N chat requests (different prompts, greedy,
`ignore_eos`, `--tokens` tokens each) are sent at once over /v1/chat/completions with
streaming; per stream the time to its first token and its decode rate, and the aggregate
rate (all tokens over the wall time from the first request to the last token). Then the
time to first token of a request that joins 3 running streams, against the same request
alone. specd runs `specd serve --slots max(N)`; llama-server runs `-np N` (restarted per
N, as users size it), both with the same GGUF files, context per slot and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from specd.daemon.benchmark.llama_server import LlamaServer
from specd.daemon.benchmark.peer import TUNED_N_MAX, TUNED_P_MIN
from specd.daemon.benchmark.run import PROMPTS
from specd.daemon.benchmark.serve_process import specd_serve
from specd.daemon.models.store import resolve_model

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
N_CTX = 1024  # per slot
EXTRA_PROMPTS = [
    "Write a Python function that parses an ISO 8601 date string without libraries.",
    "Explain, with a small Python example, how a context manager works.",
    "Write a bash script that finds the ten largest files under a directory.",
    "Write a JavaScript debounce function with a short explanation.",
    "Describe a quiet morning in a mountain village in about 150 words.",
]
ALL_PROMPTS = [*PROMPTS.values(), *EXTRA_PROMPTS]


@dataclass
class StreamResult:
    ttft_s: float
    tokens: int
    decode_tps: float
    end_s: float  # since the batch started


def stream_chat(url: str, prompt: str, max_tokens: int, t_start: float) -> StreamResult:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first: float | None = None
    chunks, usage = 0, None
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                usage = ev["usage"]
            choices = ev.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    tokens = int(usage["completion_tokens"]) if usage else chunks
    assert first is not None, "no token came back"
    return StreamResult(first - t0, tokens, (tokens - 1) / max(end - first, 1e-9),
                        end - t_start)


def run_streams(url: str, n: int, max_tokens: int) -> dict[str, object]:
    results: list[StreamResult | None] = [None] * n
    t_start = time.perf_counter()

    def one(i: int) -> None:
        results[i] = stream_chat(url, ALL_PROMPTS[i % len(ALL_PROMPTS)], max_tokens, t_start)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if r is not None]
    assert len(done) == n, "a stream failed"
    wall = max(r.end_s for r in done)
    return {"n": n, "aggregate_tps": sum(r.tokens for r in done) / wall,
            "per_stream_tps": statistics.mean(r.decode_tps for r in done),
            "ttft_s": statistics.mean(r.ttft_s for r in done),
            "streams": [asdict(r) for r in done]}


def joining_ttft(url: str, max_tokens: int) -> dict[str, float]:
    """TTFT of a short request alone, and joining 3 streams already decoding."""
    # each asked once with a new first line, so that no cached prefix shortens it
    prompts = (f"Request {i}.\n{ALL_PROMPTS[3]}" for i in range(100))
    alone = statistics.median(stream_chat(url, next(prompts), 4, time.perf_counter()).ttft_s
                              for _ in range(3))
    running = [threading.Thread(target=stream_chat, args=(url, ALL_PROMPTS[i],
                                                          max_tokens * 2, time.perf_counter()))
               for i in range(3)]
    for t in running:
        t.start()
    time.sleep(3.0)  # their prompts are in; they decode
    joined = stream_chat(url, next(prompts), 4, time.perf_counter()).ttft_s
    for t in running:
        t.join()
    return {"ttft_alone_s": alone, "ttft_joining_3_s": joined, "ratio": joined / alone}


@contextmanager
def specd_server(spec: str, slots: int, threads: int) -> Iterator[str]:
    args = ["-m", TARGET, "--slots", str(slots), "-c", str(N_CTX), "-t", str(threads),
            "--no-fit"]
    # with -md, the speculation `specd serve -md` runs by default (draft+ngram, adaptive)
    args += ["--spec-type", "none"] if spec == "none" else ["-md", DRAFT]
    with specd_serve(args) as server:
        yield server.url


@contextmanager
def llama_server(spec: str, slots: int, threads: int) -> Iterator[str]:
    args = ["-np", str(slots)]
    if spec == "draft":  # its speculation tuned for a small CPU draft (daemon/benchmark/peer)
        args += ["-md", str(resolve_model(DRAFT)), "--spec-type", "draft-simple",
                 "-td", str(threads), "--spec-draft-n-max", str(TUNED_N_MAX),
                 "--spec-draft-p-min", str(TUNED_P_MIN)]
    with LlamaServer(resolve_model(TARGET), threads=threads, n_ctx=N_CTX * slots,
                     args=args) as srv:
        yield srv.url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--servers", default="specd-none,specd-draft,llama-none,llama-draft")
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", type=Path, default=Path("bench/results/parallel_streams.json"))
    args = ap.parse_args()
    report: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M"),
                                 "load_before": os.getloadavg(), "threads": args.threads,
                                 "tokens": args.tokens, "servers": {}}
    servers: dict[str, object] = {}
    for name in args.servers.split(","):
        kind, spec = name.split("-", 1)
        rows: list[dict[str, object]] = []
        join: dict[str, float] = {}
        if kind == "specd":  # one daemon with as many slots as the most streams
            with specd_server(spec, max(args.streams), args.threads) as url:
                stream_chat(url, "hi", 2, time.perf_counter())  # warm
                rows = [run_streams(url, n, args.tokens) for n in args.streams]
                join = joining_ttft(url, args.tokens)
        else:  # llama-server sized to each N
            for n in args.streams:
                with llama_server(spec, n, args.threads) as url:
                    stream_chat(url, "hi", 2, time.perf_counter())
                    rows.append(run_streams(url, n, args.tokens))
                    if n == 4:
                        join = joining_ttft(url, args.tokens)
        servers[name] = {"rows": rows, "joining": join}
        for r in rows:
            print(f"{name:12} N={r['n']}: aggregate {r['aggregate_tps']:.1f} tok/s, "
                  f"per stream {r['per_stream_tps']:.1f}, ttft {r['ttft_s']:.2f} s", flush=True)
        if join:
            print(f"{name:12} joining 3 streams: ttft {join['ttft_joining_3_s']:.2f} s vs "
                  f"{join['ttft_alone_s']:.2f} s alone ({join['ratio']:.2f}x)", flush=True)
    report["servers"] = servers
    report["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
