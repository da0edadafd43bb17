"""Token-level evidence of history speculation on its workloads (bench/workloads/): per
request, the offers each free source made (how many, how long, and how much of each the
sequence went on with: what a round verifying it would have accepted, whichever offer
the policy took), the rounds each source drafted and what the target accepted of them,
and the history's size when the request began. No timings are reported (the rounds'
choices do depend on the costs the policy measures).

    python bench/history_offers.py [-m qwen2.5-coder-1.5b-instruct]
        [-md qwen2.5-coder-0.5b-instruct] [--workloads agent,regenerate] [--limit 3]
        [--json FILE]

It runs a real daemon in this process (engine, scheduler, HTTP on loopback), configured
as `specd serve -m M -md D` configures it (the default drafter, the adaptive policy, the
history index), and counts through hooks on the drafter's offers and the
request's round statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workloads"))

from workloads import WORKLOADS

from specd.daemon.cli.generate import engine_config_from_args
from specd.daemon.cli.main import build_parser
from specd.daemon.cli.options import settle_draft
from specd.daemon.drafters.history import WithHistory
from specd.daemon.models.store import resolve_model
from specd.daemon.spec.drafter import Features, Proposal
from specd.daemon.spec.stats import SpecStats

from live_server import live_server


class Tally:
    """What the hooks saw since the last `take()`."""

    def __init__(self) -> None:
        self.offers: Counter[str] = Counter()  # source -> non-empty offers
        self.offered: Counter[str] = Counter()  # source -> tokens offered
        self.asked = 0  # rounds that asked for offers
        self.rounds: Counter[str] = Counter()  # source -> verified rounds
        self.drafted: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.lengths: Counter[int] = Counter()  # draft length -> rounds (0: plain steps)
        # per sequence: each round's offers (position of `last`, source, tokens), and the
        # tokens the sequence went on with (from the position of its first round's `last`)
        self.seen: dict[int, list[tuple[int, str, list[int]]]] = {}
        self.stream: dict[int, list[int]] = {}

    def would_accept(self) -> dict[str, dict[str, float]]:
        """Per source, over every offer made: its length and how many of its tokens the
        sequence went on with (what a greedy round verifying it whole would accept,
        whichever source the policy picked), and the offers that held whole."""
        got: dict[str, list[tuple[int, int]]] = {}
        for seq, offers in self.seen.items():
            stream = self.stream.get(seq, [])
            base = offers[0][0] if offers else 0
            for pos, src, toks in offers:
                ahead = stream[pos - base + 1:pos - base + 1 + len(toks)]
                n = next((i for i, (a, b) in enumerate(zip(toks, ahead, strict=False))
                          if a != b), min(len(toks), len(ahead)))
                got.setdefault(src, []).append((len(toks), n))
        return {src: {"offers": len(v), "mean_length": round(sum(a for a, _ in v) / len(v), 2),
                      "mean_would_accept": round(sum(b for _, b in v) / len(v), 2),
                      "held_whole": sum(1 for a, b in v if a == b)}
                for src, v in got.items()}

    def take(self) -> dict[str, Any]:
        out = {"asked": self.asked, "offers": dict(self.offers),
               "offered_tokens": dict(self.offered), "rounds": dict(self.rounds),
               "drafted": dict(self.drafted), "accepted": dict(self.accepted),
               "lengths": dict(sorted(self.lengths.items())),
               "would_accept": self.would_accept()}
        self.__init__()  # type: ignore[misc]
        return out


def hook(tally: Tally) -> None:
    """Count every offer WithHistory gathers and every round a request records."""
    offers = WithHistory.offers

    def counted_offers(self: WithHistory, seq: int, last: int, pos: int, n_max: int
                       ) -> list[Proposal]:
        got = offers(self, seq, last, pos, n_max)
        tally.asked += 1
        for o in got:
            if o.tokens:
                src = o.evidence.lookup_source or "prompt lookup"
                tally.offers[src] += 1
                tally.offered[src] += len(o.tokens)
                tally.seen.setdefault(seq, []).append((pos, src, list(o.tokens)))
        return got

    process = WithHistory.process

    def followed(self: WithHistory, seq: int, tokens: Sequence[int],
                 features: Features | None = None) -> None:
        process(self, seq, tokens, features)
        tally.stream.setdefault(seq, []).extend(tokens)

    record = SpecStats.record_round

    def counted_round(self: SpecStats, n_drafted: int, n_accepted: int,
                      lookup: bool = False, free: str = "") -> None:
        record(self, n_drafted, n_accepted, lookup, free)
        if self is not tally_owner.get("totals"):
            tally.lengths[n_drafted] += 1
            if n_drafted:
                src = (free or "prompt lookup") if lookup else "model"
                tally.rounds[src] += 1
                tally.drafted[src] += n_drafted
                tally.accepted[src] += n_accepted

    WithHistory.offers = counted_offers  # type: ignore[method-assign]
    WithHistory.process = followed  # type: ignore[method-assign]
    SpecStats.record_round = counted_round  # type: ignore[method-assign]


tally_owner: dict[str, SpecStats] = {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("-md", "--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=8192)
    ap.add_argument("--workloads", default="agent,regenerate")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tally = Tally()
    hook(tally)
    # the engine `specd serve -m M -md D -t T -c C --slots 1 --no-fit` builds
    serve = build_parser().parse_args([
        "serve", "-m", str(resolve_model(args.model)), "-md", str(resolve_model(args.draft)),
        "-t", str(args.threads), "-c", str(args.n_ctx), "--slots", "1", "--no-fit"])
    settle_draft(serve)
    cfg = engine_config_from_args(serve, slots=1)
    cfg.history = True
    out: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp, live_server(cfg, Path(tmp)) as srv:
        tally_owner["totals"] = srv.service.scheduler.totals
        store = srv.service.engine.history
        for w in [w for w in args.workloads.split(",") if w]:
            store.clear()
            out[w] = []
            for k, r in enumerate(WORKLOADS[w]()[:args.limit]):
                held = store.n_tokens
                status, reply = srv.request("POST", r.route, r.body, timeout=3600)
                if status != 200:
                    raise RuntimeError(f"{w} request {k}: {status} {reply}")
                row = {"request": k, "history_tokens_before": held,
                       "generated": r.count(reply), **tally.take()}
                print(f"{w} {k}: " + json.dumps(row), flush=True)
                out[w].append({**row, "reply": reply})
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
