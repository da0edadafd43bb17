"""Choose the context length and slot count that fit the target (and draft) in free memory.

The draft follows the target: same n_ctx, same slots. For each configuration tried the
context is the largest multiple of ATTN_BUCKET in [min_ctx, max_ctx] whose total fits in
free - margin; every candidate context recomputes both models' KV and workspace. When even
min_ctx does not fit, the `on_fail` steps are tried in order: "fewer_slots" (down to 1)
and "drop_draft" (run without the draft model, with a warning saying why). Nothing fits:
FitError with the bytes needed and free.

Total per model: weights (none for a drafter that shares the target's weights) + KV
(kv_bytes_per_token x n_ctx x slots) + workspace(n_ctx) + host (the engine's parsed GGUF
header, and the tokenizer for the target; CPU only); plus a one-time runtime cost
(the CUDA context) counted once, and the history index's bound (`history_bytes`: the
most the daemon user's suffix index may hold, drafters/history.py), a row of host
memory counted in every configuration where host memory is the device's (CPU). While
models load one after another the peak is the models already loaded (weights + KV) plus
the loading one's weights and load overhead; the plan takes the larger of that and the
steady total.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specd.ort_models.graph_builder import ATTN_BUCKET

from .measure import ModelCost
from .probes import MemoryProbe

ON_FAIL_STEPS = ("fewer_slots", "drop_draft")
DEFAULT_MARGIN_BYTES = 512 << 20
DEFAULT_MIN_CTX = 512
HISTORY_ROW_NAME = "suffix index"  # the history row's name in a plan's table


class FitError(Exception):
    """Nothing fits in the free memory (message for the user: needed vs free)."""


@dataclass(frozen=True)
class ModelRow:
    role: str  # "target" / "draft" / "embedding" / "vision" / "history"
    name: str
    weights_bytes: int  # counted: 0 when shared with the target
    kv_bytes_per_token: int  # per sequence
    kv_bytes: int  # all slots at n_ctx
    workspace_bytes: int  # at n_ctx
    weights_shared: bool = False
    host_bytes: int = 0  # CPU: parsed GGUF header (+ tokenizer for the target)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes + self.host_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "name": self.name, "weights_bytes": self.weights_bytes,
                "weights_shared": self.weights_shared,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_bytes": self.kv_bytes,
                "workspace_bytes": self.workspace_bytes, "host_bytes": self.host_bytes,
                "total_bytes": self.total_bytes}


@dataclass
class Plan:
    device: str
    n_ctx: int
    slots: int
    requested_slots: int
    max_ctx: int  # the ceiling this plan searched up to
    draft_requested: bool
    draft_dropped: bool
    rows: list[ModelRow]
    runtime_bytes: int  # once per process (CUDA context); 0 on CPU
    load_peak_bytes: int  # highest point while loading (before any step runs)
    margin_bytes: int
    device_total_bytes: int
    free_before_bytes: int
    warnings: list[str] = field(default_factory=list)

    @property
    def has_draft(self) -> bool:
        return self.draft_requested and not self.draft_dropped

    @property
    def steady_bytes(self) -> int:
        return self.runtime_bytes + sum(r.total_bytes for r in self.rows)

    @property
    def total_bytes(self) -> int:
        """What the plan needs at its peak (margin not included)."""
        return max(self.steady_bytes, self.load_peak_bytes)

    @property
    def free_after_bytes(self) -> int:
        return self.free_before_bytes - self.total_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "n_ctx": self.n_ctx, "slots": self.slots,
                "requested_slots": self.requested_slots, "max_ctx": self.max_ctx,
                "draft_requested": self.draft_requested, "draft_dropped": self.draft_dropped,
                "models": [r.as_dict() for r in self.rows],
                "runtime_bytes": self.runtime_bytes, "load_peak_bytes": self.load_peak_bytes,
                "total_bytes": self.total_bytes, "margin_bytes": self.margin_bytes,
                "device_total_bytes": self.device_total_bytes,
                "free_before_bytes": self.free_before_bytes,
                "free_after_bytes": self.free_after_bytes, "warnings": list(self.warnings)}

    def table(self) -> str:
        head = (f"{self.device}: {fmt_bytes(self.free_before_bytes)} free of "
                f"{fmt_bytes(self.device_total_bytes)}, margin {fmt_bytes(self.margin_bytes)}")
        cfg = (f"n_ctx {self.n_ctx} (max {self.max_ctx}), slots {self.slots}"
               + (f" of {self.requested_slots} asked" if self.slots != self.requested_slots
                  else "")
               + (", draft dropped" if self.draft_dropped else ""))
        cols = ("model", "name", "weights", "KV/token", "KV total", "workspace", "host",
                "total")
        body: list[tuple[str, ...]] = [cols]
        for r in self.rows:
            w = "shared" if r.weights_shared else fmt_bytes(r.weights_bytes)
            body.append((r.role, r.name, w, fmt_bytes(r.kv_bytes_per_token),
                         fmt_bytes(r.kv_bytes), fmt_bytes(r.workspace_bytes),
                         fmt_bytes(r.host_bytes), fmt_bytes(r.total_bytes)))
        pad = ("",) * (len(cols) - 2)
        if self.runtime_bytes:
            body.append(("runtime", *pad, fmt_bytes(self.runtime_bytes)))
        if self.load_peak_bytes > self.steady_bytes:
            body.append(("load peak", *pad, fmt_bytes(self.load_peak_bytes)))
        body.append(("total", *pad, fmt_bytes(self.total_bytes)))
        body.append(("free after", *pad, fmt_bytes(self.free_after_bytes)))
        widths = [max(len(row[i]) for row in body) for i in range(len(cols))]
        lines = [head, cfg, ""]
        for row in body:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            cells += [c.rjust(w) for c, w in zip(row[2:], widths[2:], strict=True)]
            lines.append("  ".join(cells).rstrip())
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _configs(slots: int, has_draft: bool, on_fail: Sequence[str]) -> list[tuple[int, bool]]:
    """(slots, with draft) in the order they are tried."""
    out = [(slots, has_draft)]
    draft, reduced = has_draft, False
    for step in on_fail:
        if step == "fewer_slots":
            out += [(s, draft) for s in range(slots - 1, 0, -1)]
            reduced = True
        elif step == "drop_draft":
            if draft:
                draft = False
                out += [(s, False) for s in (range(slots, 0, -1) if reduced else [slots])]
        else:
            raise ValueError(f"unknown on_fail step {step!r} (one of {ON_FAIL_STEPS})")
    return list(dict.fromkeys(out))  # in order, each candidate once


def _rows(target: ModelCost, second: ModelCost | None, n_ctx: int, slots: int,
          shares: bool, beside: ModelCost | None = None, vision: ModelCost | None = None,
          history_bytes: int = 0) -> list[ModelRow]:
    rows = [ModelRow("target", target.name, target.weights_bytes, target.kv_bytes_per_token,
                     target.kv_bytes(n_ctx, slots), target.workspace_bytes_at(n_ctx),
                     host_bytes=target.metadata_bytes + target.tokenizer_bytes)]
    if second is not None:  # recomputed at every candidate: its workspace follows n_ctx
        rows.append(ModelRow("draft", second.name, 0 if shares else second.weights_bytes,
                             second.kv_bytes_per_token, second.kv_bytes(n_ctx, slots),
                             second.workspace_bytes_at(n_ctx), weights_shared=shares,
                             host_bytes=second.metadata_bytes))
    if beside is not None:  # one sequence, at the context as far as its training goes
        own = min(n_ctx, beside.n_ctx_train or n_ctx)
        rows.append(ModelRow("embedding", beside.name, beside.weights_bytes,
                             beside.kv_bytes_per_token, beside.kv_bytes(own, 1),
                             beside.workspace_bytes_at(own),
                             host_bytes=beside.metadata_bytes + beside.tokenizer_bytes))
    if vision is not None:  # no cache: its weights and one image's activations
        rows.append(ModelRow("vision", vision.name, vision.weights_bytes, 0, 0,
                             vision.workspace_bytes_at(0), host_bytes=vision.metadata_bytes))
    if history_bytes > 0:  # the suffix index's arrays at their bound, whatever the context
        rows.append(ModelRow("history", HISTORY_ROW_NAME, 0, 0, 0, 0,
                             host_bytes=history_bytes))
    return rows


def _load_peak(costs: Sequence[ModelCost], rows: Sequence[ModelRow], runtime: int) -> int:
    """Highest point while the models load in order (headers and tokenizer first, then
    each session: weights + load overhead, then its KV). The history row (after the
    models' rows) counts as held from the start: its bound is what it may reach."""
    peak, loaded = 0, runtime + sum(r.host_bytes for r in rows)
    for cost, row in zip(costs, rows[:len(costs)], strict=True):
        extra = cost.load_extra_bytes if row.weights_bytes else 0
        peak = max(peak, loaded + row.weights_bytes + extra)
        loaded += row.weights_bytes + row.kv_bytes
    return peak


def _need(target: ModelCost, other: ModelCost | None, n_ctx: int, slots: int,
          shares: bool, beside: ModelCost | None = None, vision: ModelCost | None = None,
          history_bytes: int = 0) -> tuple[int, list[ModelRow], int]:
    """(peak bytes, rows, load peak) of one candidate; every call recomputes each model."""
    rows = _rows(target, other, n_ctx, slots, shares, beside, vision, history_bytes)
    costs = [c for c in (target, other, beside, vision) if c is not None]
    runtime = max(c.runtime_bytes for c in costs)
    load = _load_peak(costs, rows, runtime)
    return max(runtime + sum(r.total_bytes for r in rows), load), rows, load


def _ceiling(target: ModelCost, second: ModelCost | None, max_ctx: int | None) -> int:
    limits = [c.n_ctx_train for c in (target, second) if c is not None and c.n_ctx_train]
    if max_ctx is not None:
        limits.append(max_ctx)
    if not limits:
        raise ValueError("max_ctx is needed when the models' trained context is unknown")
    top = min(limits) // ATTN_BUCKET * ATTN_BUCKET
    if top < ATTN_BUCKET:
        raise FitError(f"a context of at least {ATTN_BUCKET} tokens is needed; the limit "
                       f"is {min(limits)}")
    return top


def fit(target: ModelCost, second: ModelCost | None = None, *, probe: MemoryProbe,
        slots: int = 1, margin_bytes: int = DEFAULT_MARGIN_BYTES,
        min_ctx: int = DEFAULT_MIN_CTX, max_ctx: int | None = None,
        shares_target_weights: bool = False,
        on_fail: Sequence[str] = ON_FAIL_STEPS, beside: ModelCost | None = None,
        vision: ModelCost | None = None, history_bytes: int = 0) -> Plan:
    """The largest context (then the most slots, then the draft) that fits `probe`'s free
    memory minus `margin_bytes`. max_ctx defaults to the models' trained context. `beside`:
    a model always loaded with them, one sequence at the same context (the embedding
    model), whose bytes every configuration counts; `vision`: the vision encoder
    (vision_cost), counted the same way; `history_bytes`: the history index's bound, a
    row every configuration counts (0: none)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, not {slots}")
    if history_bytes < 0:
        raise ValueError(f"history_bytes must be >= 0, not {history_bytes}")
    for step in on_fail:
        if step not in ON_FAIL_STEPS:
            raise ValueError(f"unknown on_fail step {step!r} (one of {ON_FAIL_STEPS})")
    mem = probe.read()
    budget = mem.free_bytes - margin_bytes
    warnings: list[str] = []
    lo_asked = -(-max(min_ctx, 1) // ATTN_BUCKET) * ATTN_BUCKET
    failures: list[str] = []
    smallest_need: tuple[int, str] | None = None
    for n_slots, with_draft in _configs(slots, second is not None, on_fail):
        other = second if with_draft else None
        hi = _ceiling(target, other, max_ctx)
        lo = min(lo_asked, hi)
        chosen = None
        for n in range(hi, lo - 1, -ATTN_BUCKET):  # largest first; the need grows with n
            total, rows, load = _need(target, other, n, n_slots, shares_target_weights,
                                      beside, vision, history_bytes)
            if total <= budget:
                chosen = (n, rows, load)
                break
        what = f"{n_slots} slot{'s' if n_slots > 1 else ''}" + (" + draft" if other else "")
        if chosen is None:
            total = _need(target, other, lo, n_slots, shares_target_weights, beside,
                          vision, history_bytes)[0]
            if other is not None:
                failures.append(f"{what} needs {fmt_bytes(total)} at n_ctx {lo}")
            if smallest_need is None or total < smallest_need[0]:
                smallest_need = (total, f"{what} at n_ctx {lo}")
            continue
        n, rows, load = chosen
        runtime = max(c.runtime_bytes for c in (target, other, beside, vision)
                      if c is not None)
        if lo_asked > hi:
            warnings.append(f"context capped at {hi}, below the {min_ctx} asked for at least: "
                            "the models' trained context or the largest context asked is "
                            "smaller")
        if second is not None and not with_draft:
            warnings.append(f"draft model dropped: target + draft do not fit "
                            f"({'; '.join(failures)}; {fmt_bytes(max(budget, 0))} usable = "
                            f"{fmt_bytes(mem.free_bytes)} free - {fmt_bytes(margin_bytes)} "
                            f"margin); running without the draft model")
        if n_slots < slots:
            warnings.append(f"slots reduced from {slots} to {n_slots}: more do not fit at "
                            f"n_ctx {lo} ({fmt_bytes(max(budget, 0))} usable)")
        if other is not None and other.n_ctx_train and other.n_ctx_train < min(
                x for x in (target.n_ctx_train, max_ctx, 1 << 62) if x):
            warnings.append(f"context capped at {hi} by the draft's trained context "
                            f"({other.n_ctx_train})")
        if n < hi:
            warnings.append(f"context limited to {n} of {hi} tokens by free memory")
        return Plan(mem.device, n, n_slots, slots, hi, second is not None,
                    second is not None and not with_draft, rows, runtime, load, margin_bytes,
                    mem.total_bytes, mem.free_bytes, warnings)
    assert smallest_need is not None
    raise FitError(f"nothing fits on {mem.device}: the smallest configuration ("
                   f"{smallest_need[1]}) needs {fmt_bytes(smallest_need[0])} but only "
                   f"{fmt_bytes(mem.free_bytes)} is free ({fmt_bytes(margin_bytes)} margin "
                   f"kept, {fmt_bytes(max(budget, 0))} usable)")
