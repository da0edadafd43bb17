"""Soak of the history index's memory bound: a real `specd serve` on loopback, two
identities sending a stream of chat requests for some minutes.

    python bench/history_soak.py [--minutes 10] [-m smollm2-135m-instruct]
        [--history-tokens 8192] [--out bench/results/history_soak.json]

The two identities are two cache keys of this OS user (one principal: the bound,
--history-tokens, holds for both together). Each sends, in turn, a request built from
a pool of prompts (some repeated, greedy or at temperature 0.8, as users repeat work),
so the history both drafts and overflows its bound many times. Every 2 s /metrics is
read (specd_history_tokens, specd_history_bytes, specd_history_bound_bytes) and the
daemon's RSS sampled (/proc/PID/status).

Asserted, at every sample: the history's bytes within the bound (16 bytes a token of
--history-tokens) and its tokens within --history-tokens; at the end: the daemon alive,
no request failed, and the history full (the stream overflowed the bound). Recorded: the
series, requests by identity, tokens generated, and RSS after the first minute (first,
last, max).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from specd.daemon.benchmark.llama_server import process_memory
from specd.daemon.benchmark.serve_process import specd_serve

IDENTITIES = ("alice", "bob")
SUBJECTS = ["a binary search", "a linked list", "a hash map", "a priority queue",
            "merge sort", "a trie", "an LRU cache", "Dijkstra's algorithm", "a ring buffer",
            "a bloom filter", "quicksort", "a union-find structure"]
ASKS = ["Write a short Python function implementing {}.",
        "Explain {} in three sentences.",
        "List two pitfalls when implementing {}."]
METRICS = ("specd_history_tokens", "specd_history_bytes", "specd_history_bound_bytes",
           "specd_requests_total", "specd_tokens_generated_total")


def call(port: int, method: str, path: str, body: Any = None, timeout: float = 300
         ) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    status, data = call(port, "GET", "/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    out = {}
    for line in data.decode().splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            out[name] = float(value)
    missing = set(METRICS) - set(out)
    if missing:
        raise RuntimeError(f"/metrics lacks {sorted(missing)}")
    return out


class Stream:
    """The identities' requests, one after another each, until `seconds` pass."""

    def __init__(self, port: int, seconds: float, seed: int):
        self.port, self.deadline = port, time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.sent = dict.fromkeys(IDENTITIES, 0)
        self.failed: list[str] = []
        self.lock = threading.Lock()

    def body(self, who: str) -> dict[str, Any]:
        with self.lock:
            ask = self.rng.choice(ASKS).format(self.rng.choice(SUBJECTS))
            hot = self.rng.random() < 0.5
            max_tokens = self.rng.choice([64, 128, 192])
        return {"messages": [{"role": "user", "content": ask}], "max_tokens": max_tokens,
                "temperature": 0 if hot else 0.8, "cache_key": who}

    def client(self, who: str) -> None:
        while time.monotonic() < self.deadline:
            try:
                status, data = call(self.port, "POST", "/v1/chat/completions", self.body(who))
            except OSError as exc:
                status, data = 0, str(exc).encode()
            with self.lock:
                self.sent[who] += 1
                if status != 200:
                    self.failed.append(f"{who}: {status} {data[:200]!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--history-tokens", type=int, default=8192)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/history_soak.json"))
    args = ap.parse_args()
    serve = ["-m", args.model, "--slots", "2", "-c", "1024", "-t", str(args.threads),
             "--no-fit", "--history", "--history-tokens", str(args.history_tokens)]
    bound_tokens = args.history_tokens
    series: list[dict[str, float]] = []
    over: list[str] = []
    with specd_serve(serve) as server:
        stream = Stream(server.port, args.minutes * 60, args.seed)
        clients = [threading.Thread(target=stream.client, args=(who,)) for who in IDENTITIES]
        t0 = time.monotonic()
        for c in clients:
            c.start()
        while any(c.is_alive() for c in clients):
            m = metrics(server.port)
            sample = {"t": round(time.monotonic() - t0, 1), **m,
                      "rss": process_memory(server.proc.pid)[0]}
            series.append(sample)
            bound = m["specd_history_bound_bytes"]
            if not 0 < bound <= 16 * bound_tokens or m["specd_history_bytes"] > bound or (
                    m["specd_history_tokens"] > bound_tokens):
                over.append(json.dumps(sample))
            time.sleep(2.0)
        for c in clients:
            c.join()
        final = metrics(server.port)
        alive = server.proc.poll() is None
        tracebacks = server.log.read_text(errors="replace").count("Traceback")
    after = [s["rss"] for s in series if s["t"] >= 60] or [s["rss"] for s in series]
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "minutes": args.minutes, "model": args.model,
        "history_tokens_bound": bound_tokens,
        "history_bound_bytes": final["specd_history_bound_bytes"],
        "requests": stream.sent, "failed": stream.failed,
        "requests_total": final["specd_requests_total"],
        "tokens_generated": final["specd_tokens_generated_total"],
        "history_tokens_max": max(s["specd_history_tokens"] for s in series),
        "history_bytes_max": max(s["specd_history_bytes"] for s in series),
        "history_tokens_final": final["specd_history_tokens"],
        "history_bytes_final": final["specd_history_bytes"],
        "samples": len(series), "samples_over_bound": over,
        "rss_mb": {"first_minute_end": after[0] / 2**20, "last": after[-1] / 2**20,
                   "max": max(after) / 2**20},
        "daemon_alive": alive, "tracebacks_in_log": tracebacks,
        "series": [[s["t"], int(s["specd_history_tokens"]), int(s["specd_history_bytes"]),
                    round(s["rss"] / 2**20, 1)] for s in series],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "series"}, indent=1))
    checks = {
        "the bound held at every sample": not over,
        "the daemon stayed up": alive,
        "no request failed": not stream.failed,
        "the stream overflowed the bound (the history filled)":
            report["history_tokens_max"] >= bound_tokens // 2,
    }
    for what, ok in checks.items():
        print(f"{'ok' if ok else 'FAILED'}: {what}", file=sys.stderr)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
