"""Tokens/s of history speculation's workloads (bench/workloads/) on specd and llama-server.

    python bench/history_speed.py [-m qwen2.5-coder-1.5b-instruct]
        [-md qwen2.5-coder-0.5b-instruct] [-t 4] [-c 8192]
        [--workloads editor,agent,regenerate,fresh] [--limit N] [--configs ...]

Each configuration is one server process, started with the same GGUF files, threads,
context and one slot, that runs every workload's requests in order over HTTP:

    specd target-only        --spec-type none --no-history
    specd default            the default drafter (-md), --no-history: today's default
    specd default+history    the same with the history index (the default now)
    llama-server spec-default   --spec-default (ngram-mod)
    llama-server draft       -md DRAFT (draft-simple)

Requests that name no temperature are greedy on both (llama-server is started with
--temp 0, specd's default). A workload's tokens/s is its generated tokens over the wall
time of its requests, client side. The ratios the issue asks for are printed after the
table: (a)-(c) against target-only and the best llama-server configuration, (d) against
today's default. `--limit` runs only the first N requests of each workload (a smoke run).
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specd.daemon.benchmark.llama_server import LlamaServer, stop_process, wait_healthy
from specd.daemon.models.store import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent / "workloads"))
from workloads import WORKLOADS, Request

CONFIGS = ("specd target-only", "specd default", "specd default+history",
           "llama-server spec-default", "llama-server draft")


class SpecdServer:
    """`specd serve` in its own state dir (its history starts empty) on a free port."""

    def __init__(self, args: list[str], ready_s: float = 900.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._dir = tempfile.TemporaryDirectory(prefix="specd-bench-")
        env = {**os.environ, "SPECD_STATE_DIR": self._dir.name}
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specd.daemon.cli", "serve", "--port", str(port),
             "--no-socket", "--keep-alive", "-1", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=self._log)
        if not wait_healthy(self.url, self.proc, ready_s) or self.proc.poll() is not None:
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
            self.close()
            raise RuntimeError("specd serve did not start: " + " | ".join(tail))

    def post(self, route: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(f"{self.url}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=1800) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"specd {route}: {exc.code} "
                               f"{exc.read().decode(errors='replace')[:300]}") from None

    def close(self) -> None:
        stop_process(self.proc)
        self._dir.cleanup()


def start(config: str, model: Path, draft: Path | None, threads: int, n_ctx: int
          ) -> SpecdServer | LlamaServer:
    common = ["-m", str(model), "-t", str(threads), "-c", str(n_ctx), "--slots", "1",
              "--no-fit"]
    drafted = [] if draft is None else ["-md", str(draft)]
    if config == "specd target-only":
        return SpecdServer([*common, "--spec-type", "none", "--no-history"])
    if config == "specd default":
        return SpecdServer([*common, *drafted, "--no-history"])
    if config == "specd default+history":
        return SpecdServer([*common, *drafted, "--history"])
    llama = ["-np", "1", "--temp", "0"]
    if config == "llama-server spec-default":
        return LlamaServer(model, threads=threads, n_ctx=n_ctx,
                           args=[*llama, "--spec-default"])
    if config == "llama-server draft":
        if draft is None:
            raise ValueError("llama-server draft needs -md")
        return LlamaServer(model, threads=threads, n_ctx=n_ctx,
                           args=[*llama, "-md", str(draft), "-td", str(threads)])
    raise ValueError(f"unknown configuration {config!r} (one of {', '.join(CONFIGS)})")


def run_workload(server: SpecdServer | LlamaServer, requests: list[Request]
                 ) -> tuple[int, float]:
    """(generated tokens, seconds) over the workload's requests, in order."""
    tokens, seconds = 0, 0.0
    for r in requests:
        t0 = time.perf_counter()
        reply = server.post(r.route, r.body)
        seconds += time.perf_counter() - t0
        tokens += r.count(reply)
    return tokens, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b-instruct",
                    help="the draft model of both servers' drafted configurations ('' none)")
    ap.add_argument("-t", "--threads", type=int, default=4)
    ap.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=8192)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--limit", type=int, default=None,
                    help="only the first N requests of each workload (a smoke run)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    model = resolve_model(args.model)
    draft = resolve_model(args.draft) if args.draft else None
    chosen = [w for w in args.workloads.split(",") if w]
    loads = {w: WORKLOADS[w]()[:args.limit] for w in chosen}
    results: dict[str, dict[str, tuple[int, float]]] = {}
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        print(f"{config}: starting", file=sys.stderr)
        server = start(config, model, draft, args.threads, args.n_ctx)
        try:
            results[config] = {w: run_workload(server, reqs) for w, reqs in loads.items()}
        finally:
            server.close()
        print(f"{config}: " + ", ".join(f"{w} {n / s:.1f} tok/s" for w, (n, s)
                                        in results[config].items()), file=sys.stderr)
    rate = {c: {w: n / s if s else 0.0 for w, (n, s) in r.items()} for c, r in results.items()}
    width = max(len(c) for c in rate)
    print(f"{'tokens/s':<{width}}  " + "  ".join(f"{w:>10}" for w in chosen))
    for c, r in rate.items():
        print(f"{c:<{width}}  " + "  ".join(f"{r[w]:>10.1f}" for w in chosen))
    hist = rate.get("specd default+history")
    if hist is not None:
        peers = [r for c, r in rate.items() if c.startswith("llama-server")]
        for w in chosen:
            parts = []
            if "specd target-only" in rate and rate["specd target-only"][w]:
                parts.append(f"{hist[w] / rate['specd target-only'][w]:.2f}x target-only")
            if "specd default" in rate and rate["specd default"][w]:
                parts.append(f"{hist[w] / rate['specd default'][w]:.2f}x default")
            best = max((r[w] for r in peers), default=0.0)
            if best:
                parts.append(f"{hist[w] / best:.2f}x llama-server's best")
            print(f"default+history on {w}: " + ", ".join(parts))
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(model), "draft": str(draft),
                                         "threads": args.threads, "n_ctx": args.n_ctx,
                                         "limit": args.limit, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
