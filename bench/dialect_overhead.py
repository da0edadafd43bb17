"""What a dialect costs over OpenAI's chat completions: the same chat, in one run.

    python bench/dialect_overhead.py [-m MODEL] [--tokens 8] [--rounds 20]

A live `specd serve` (one slot, target-only) on loopback. Each round sends the same
one-message chat, greedy, `--tokens` tokens, not streamed, once per route in turn:
/v1/chat/completions, /v1/messages (Anthropic), /v1/responses (OpenAI Responses) and
/api/chat (Ollama). The prompt's prefix is cached after the first round, so a request's
time is mostly the route's own work and a few decode steps. Prints each route's median
and its difference from chat completions' (paired, per round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from specd.daemon.serving.engine import EngineConfig

from live_server import live_server

ASK = "Write a Python function that reverses a string."


def bodies(tokens: int) -> dict[str, dict[str, Any]]:
    chat = [{"role": "user", "content": ASK}]
    return {
        "/v1/chat/completions": {"messages": chat, "max_tokens": tokens, "temperature": 0},
        "/v1/messages": {"messages": chat, "max_tokens": tokens, "temperature": 0},
        "/v1/responses": {"input": ASK, "max_output_tokens": tokens, "temperature": 0},
        "/api/chat": {"model": "", "messages": chat, "stream": False,
                      "options": {"num_predict": tokens, "temperature": 0}},
    }


def post(base: str, token: str | None, path: str, body: dict[str, Any]) -> float:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(target=args.model, spec_type="none", n_ctx=1024, slots=1)
        with live_server(cfg, Path(tmp)) as srv:
            routes = bodies(args.tokens)
            if "/api/chat" in routes:
                routes["/api/chat"]["model"] = srv.service.engine.model_name
            times: dict[str, list[float]] = {path: [] for path in routes}
            for path, body in routes.items():  # warm-up: the prefix cached, each route once
                post(srv.base_url, srv.token, path, body)
            for i in range(args.rounds):
                order = list(routes) if i % 2 == 0 else list(reversed(routes))
                for path in order:
                    times[path].append(post(srv.base_url, srv.token, path, routes[path]))
    base = times["/v1/chat/completions"]
    print(f"{args.model}, {args.tokens} tokens a request, {args.rounds} rounds")
    print("| route | median ms | over chat completions, ms (paired median) |")
    print("|---|---:|---:|")
    for path, ts in times.items():
        diff = statistics.median(t - b for t, b in zip(ts, base, strict=True))
        print(f"| `{path}` | {statistics.median(ts) * 1e3:.1f} | {diff * 1e3:+.1f} |")


if __name__ == "__main__":
    main()
