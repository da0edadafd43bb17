"""Soak: a real `specd serve` under mixed, hostile load for some minutes.

    python bench/soak.py [--minutes 10] [-m MODEL] [--clients 4] [--out FILE.json]

Client threads send, at random, good requests (streamed or not, chat or completion,
greedy or sampled), streams they drop part-way, and bad ones (broken JSON, unknown
fields of the wrong type, a stop list past its cap, a prompt far over the context,
deeply nested messages, idle connections that never send a byte). Every so often a
greedy canary is asked and compared with its answer on the idle daemon at the start.

Recorded: requests by kind and status, canary mismatches (must be 0), 5xx answers (must
be 0), whether the daemon stayed up and answered /health throughout, how long a slot
stayed busy after its client dropped a stream, /health's answer times (every 0.5 s), and
the daemon's RSS sampled every 10 s (growth after the first minute).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from specd.daemon.benchmark.llama_server import process_memory
from specd.daemon.benchmark.serve_process import specd_serve

CANARY = {"prompt": "def fibonacci(n):\n", "n_predict": 48, "temperature": 0,
          "cache_prompt": False}
PROMPTS = ["Write a Python function that reverses a linked list.",
           "What is a context manager?", "Sort a list of dicts by a key in Python.",
           "Write a haiku about compilers.", "Explain big-O notation briefly."]


class Soak:
    def __init__(self, port: int, seconds: float, seed: int):
        self.port, self.deadline = port, time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.server_errors: list[str] = []
        self.canary_mismatches = 0
        self.canary_want = ""
        self.slot_free_s: list[float] = []
        self.health_failures = 0
        self.health_s: list[float] = []  # /health answer times
        self._lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _post(self, path: str, body: bytes, timeout: float = 120) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def canary(self) -> str:
        status, data = self._post("/completion", json.dumps(CANARY).encode())
        if status != 200:
            raise RuntimeError(f"canary: {status} {data[:200]!r}")
        return str(json.loads(data)["content"])

    # -- kinds of request -----------------------------------------------------------------
    def good(self, rng: random.Random) -> None:
        chat = rng.random() < 0.5
        body: dict[str, Any] = {"max_tokens": rng.randint(1, 24), "n_predict": 24,
                                "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 99)}
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        body["stream"] = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, data = self._post(path, json.dumps(body).encode())
        self._record("good", status, data)

    def dropped_stream(self, rng: random.Random) -> None:
        """A stream whose client leaves after a few events; then how long until no slot
        is busy with it (polled on /slots)."""
        body = {"prompt": rng.choice(PROMPTS), "n_predict": 200, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        for _ in range(rng.randint(1, 4)):
            r.readline()
        conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        conn.close()
        self._count("dropped stream")

    def bad(self, rng: random.Random) -> None:
        kind = rng.choice(["json", "type", "stops", "long", "nested", "idle"])
        if kind == "idle":  # a connection that never sends a byte (the server times it out)
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                time.sleep(rng.uniform(0.1, 2.0))
                s.close()
            self._count("bad idle")
            return
        body: bytes
        if kind == "json":
            body = b'{"prompt": "x", "n_predict": '
        elif kind == "type":
            body = json.dumps({"prompt": 5, "n_predict": "many"}).encode()
        elif kind == "stops":
            body = json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(5000)]}).encode()
        elif kind == "long":
            body = json.dumps({"prompt": "word " * 300_000, "n_predict": 4}).encode()
        else:  # written out: json.dumps itself would recurse too deep
            nested = "[" * 5000 + '"x"' + "]" * 5000
            body = ('{"messages": [{"role": "user", "content": ' + nested + "}]}").encode()
        status, data = self._post("/v1/chat/completions" if kind == "nested" else "/completion",
                                  body)
        self._record(f"bad {kind}", status, data)

    def _record(self, kind: str, status: int, data: bytes) -> None:
        self._count(f"{kind} {status}")
        if status >= 500 and status != 503:  # 503: a full queue, which clients retry
            with self._lock:
                self.server_errors.append(f"{kind} {status} {data[:200]!r}")

    # -- drivers --------------------------------------------------------------------------
    def client(self, index: int) -> None:
        rng = random.Random(self.rng.random() + index)
        while time.monotonic() < self.deadline:
            r = rng.random()
            try:
                if r < 0.55:
                    self.good(rng)
                elif r < 0.75:
                    self.dropped_stream(rng)
                elif r < 0.95:
                    self.bad(rng)
                else:
                    got = self.canary()
                    self._count("canary")
                    if got != self.canary_want:
                        with self._lock:
                            self.canary_mismatches += 1
            except Exception as exc:  # the client's own failure: counted, and it goes on
                self._count(f"client error {type(exc).__name__}")

    def watch(self, pid: int, rss: list[tuple[float, int]]) -> None:
        t0 = time.monotonic()
        last_rss = 0.0
        while time.monotonic() < self.deadline:
            try:
                t = time.perf_counter()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status != 200:
                    self.health_failures += 1
                self.health_s.append(time.perf_counter() - t)
                conn.close()
            except OSError:
                self.health_failures += 1
            if time.monotonic() - last_rss >= 10:
                last_rss = time.monotonic()
                rss.append((last_rss - t0, process_memory(pid)[0]))
            time.sleep(0.5)

    def slot_release(self) -> float:
        """Seconds from dropping a stream to no slot processing (measured alone)."""
        body = {"prompt": PROMPTS[0], "n_predict": 400, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        for _ in range(3):
            r.readline()
        conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        conn.close()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 30:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            c.request("GET", "/slots")
            slots = json.loads(c.getresponse().read())
            c.close()
            if not any(s.get("is_processing") for s in slots):
                return time.perf_counter() - t0
            time.sleep(0.01)
        return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()
    args_serve = ["-m", args.model, "--slots", str(args.slots), "-c", "1024", "--no-fit"]
    with specd_serve(args_serve) as server:
        soak = Soak(server.port, args.minutes * 60, args.seed)
        soak.canary_want = soak.canary()
        release = [soak.slot_release() for _ in range(3)]
        rss: list[tuple[float, int]] = []
        threads = [threading.Thread(target=soak.client, args=(i,)) for i in range(args.clients)]
        threads.append(threading.Thread(target=soak.watch, args=(server.proc.pid, rss)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        release += [soak.slot_release() for _ in range(3)]
        alive = server.proc.poll() is None
        final_canary = soak.canary() == soak.canary_want if alive else False
        log = server.log
    after_warmup = [b for t, b in rss if t >= 60] or [b for _, b in rss]
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "minutes": args.minutes, "model": args.model,
        "clients": args.clients, "slots": args.slots, "counts": dict(sorted(soak.counts.items())),
        "server_errors": soak.server_errors, "canary_mismatches": soak.canary_mismatches,
        "final_canary_equal": final_canary, "daemon_alive": alive,
        "health_failures": soak.health_failures,
        "health_ms": {"max": 1000 * max(soak.health_s, default=0.0),
                      "p99": 1000 * sorted(soak.health_s)[int(0.99 * len(soak.health_s))]
                      if soak.health_s else 0.0, "checks": len(soak.health_s)},
        "rss_series_mb": [(round(t), round(b / 2**20)) for t, b in rss],
        "slot_release_s": {"max": max(release), "median": statistics.median(release)},
        "rss_mb": {"first_minute_end": after_warmup[0] / 2**20 if after_warmup else 0,
                   "last": after_warmup[-1] / 2**20 if after_warmup else 0,
                   "max": max(after_warmup) / 2**20 if after_warmup else 0},
        "tracebacks_in_log": log.read_text(errors="replace").count("Traceback"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
