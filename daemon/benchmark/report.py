"""`specd bench` results: medians and ratios per cell, a markdown table, JSON and a plot."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from .run import Cell

PEER_TARGET = "llama.cpp target"  # weight_bytes key: the target's GGUF bytes read per token


def summarize(result: dict[str, Any], *, bandwidth: float | None, weight_bytes: dict[str, int],
              machine: str, command: str, memory: bool = True) -> dict[str, Any]:
    """`weight_bytes`: bytes read per decode step, by "target", "draft" (specd's layouts)
    and PEER_TARGET; each decode rate is also given as a multiple of the memory-bandwidth
    bound of a single target step of its runner (speculation can exceed 1). `memory`:
    whether process RSS is the models' memory (not on a GPU)."""
    cells: dict[tuple[str, float, str], Cell] = result["cells"]
    bound = {k: bandwidth / v for k, v in weight_bytes.items()} if bandwidth else {}
    rows = []
    for (pname, temp, name), cell in cells.items():
        limit = bound.get(PEER_TARGET if name.startswith("llama.cpp") else "target")
        base = cells.get((pname, temp, "llama.cpp target-only"))
        own = cells.get((pname, temp, "target-only"))
        row = {
            "prompt": pname, "temperature": temp, "config": name,
            "decode_tps": round(cell.median("decode_tps"), 2),
            "decode_tps_range": [round(x, 2) for x in cell.spread("decode_tps")],
            "prefill_tps": round(cell.median("prefill_tps"), 1),
            "ttft_s": round(cell.median("ttft_s"), 3),
            "mean_acceptance_length": round(cell.median("mean_acceptance_length"), 3),
            "lookup_share": round(cell.median("lookup_share"), 3),
            "per_position": [round(statistics.median(v), 3) for v in zip(
                *[r.per_position for r in cell.runs if r.per_position], strict=False)],
            "split_ms_per_token": [round(statistics.median(v), 2) for v in zip(
                *[r.split_ms for r in cell.runs], strict=True)],
            "decode_tps_runs": [round(r.decode_tps, 2) for r in cell.runs],
            **paired_ratio("vs_target_only", cell, own),
            **paired_ratio("vs_llama_cpp", cell, base),
            "vs_bound": round(cell.median("decode_tps") / limit, 3) if limit else None,
            "memory_mb": round(cell.median("memory_bytes") / 1e6) if memory else None,
        }
        rows.append(row)
    return {"machine": machine, "command": command, "date": time.strftime("%Y-%m-%d"),
            "bandwidth_gbs": round(bandwidth / 1e9, 2) if bandwidth else None,
            "weight_bytes": weight_bytes,
            "bound_tps": {k: round(v, 1) for k, v in bound.items()},
            "peak_rss_mb": round(result["peak_rss"] / 1e6, 1),
            "machine_drift": machine_drift(cells), "rows": rows}


def paired_ratio(key: str, cell: Cell, base: Cell | None) -> dict[str, Any]:
    """`cell`'s decode rate over `base`'s, paired by repeat: each repeat runs every
    configuration of a prompt back to back, so the ratio of two runs of one repeat sees
    one machine state; their median (and min–max, `key`_range) is what is reported.
    On a shared host single runs swing by ±15% over minutes, which a ratio of the two
    medians would carry whole.

    Where `base` also ran at the end of each repeat's group (`closing_runs`: specd's
    target-only), a run is compared with the geometric mean of the two runs around it,
    which cancels a drift of the machine that is steady over the group; `base` against
    itself is its closing run over its opening one: how far the machine alone moved."""
    if base is None or not base.runs:
        return {key: None, f"{key}_range": None}
    bases = [b.decode_tps for b in base.runs]
    if len(base.closing_runs) == len(base.runs):
        closing = [c.decode_tps for c in base.closing_runs]
        if cell is base:
            pairs = list(zip(closing, bases, strict=True))
        else:
            pairs = list(zip([r.decode_tps for r in cell.runs],
                             [math.sqrt(b * c) for b, c in zip(bases, closing, strict=True)],
                             strict=True))
    else:
        pairs = list(zip([r.decode_tps for r in cell.runs], bases, strict=True))
    ratios = [r / b for r, b in pairs if b > 0]
    if not ratios:
        return {key: None, f"{key}_range": None}
    return {key: round(statistics.median(ratios), 3),
            f"{key}_range": [round(min(ratios), 3), round(max(ratios), 3)]}


def machine_drift(cells: dict[tuple[str, float, str], Cell]) -> list[float]:
    """Every group's closing target-only run over its opening one, ascending: ratios two
    runs of the same work gave (1.0 on a quiet machine)."""
    return sorted(round(c.decode_tps / o.decode_tps, 3) for (_, _, name), cell in cells.items()
                  if name == "target-only" and len(cell.closing_runs) == len(cell.runs)
                  for o, c in zip(cell.runs, cell.closing_runs, strict=True) if o.decode_tps)


def _ratio_text(r: dict[str, Any], key: str) -> str:
    if r[key] is None:
        return ""
    lo, hi = r[f"{key}_range"]
    return str(r[key]) if lo == hi else f"{r[key]} ({lo}–{hi})"


def markdown_table(summary: dict[str, Any]) -> str:
    lines = ["| prompt | T | config | decode tok/s (min–max) | × target-only | × llama.cpp "
             "| × bound | accept len | per-position acceptance | lookup share "
             "| ms/token draft+verify+other | prefill tok/s | TTFT s | memory MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lo, hi = r["decode_tps_range"]
        split = r["split_ms_per_token"]
        cols = [r["prompt"], r["temperature"], r["config"], f"{r['decode_tps']} ({lo}–{hi})",
                _ratio_text(r, "vs_target_only"), _ratio_text(r, "vs_llama_cpp"),
                r["vs_bound"] or "",
                r["mean_acceptance_length"], " ".join(map(str, r["per_position"])),
                r["lookup_share"] if "ngram" in r["config"] else "",
                "+".join(map(str, split)) if any(split) else "", r["prefill_tps"],
                r["ttft_s"], r["memory_mb"]]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cols) + " |")
    lines += ["", footnote(summary)]
    return "\n".join(lines)


def footnote(summary: dict[str, Any]) -> str:
    """What the × bound and memory columns are measured against."""
    parts = ["× target-only, × llama.cpp: median (min–max) over the repeats of the ratio "
             "of two runs of one repeat (run back to back, on one machine state)."]
    drift = summary.get("machine_drift")
    if drift:
        mid = statistics.median(drift)
        parts.append(
            "specd's target-only ran at both ends of each repeat's group: × target-only is "
            "taken against the geometric mean of those two runs, and target-only's own × "
            "target-only is its closing run over its opening one. Over all groups that "
            f"ratio of two runs of the same work was {mid:.3f} (median), {drift[0]:.3f}–"
            f"{drift[-1]:.3f}: how far the machine alone moved a ratio in this run.")
    if summary.get("bandwidth_gbs"):
        bounds = ", ".join(f"{k} {summary['weight_bytes'][k] / 1e6:.0f} MB/token → "
                           f"{v} tok/s" for k, v in summary["bound_tps"].items())
        parts.append(f"× bound: decode tok/s over the read bandwidth "
                     f"({summary['bandwidth_gbs']} GB/s, measured) / bytes a single target "
                     f"step reads in its runner's layout ({bounds}).")
    if any(r["memory_mb"] is not None for r in summary["rows"]):
        parts.append("memory MB: process RSS growth at the configuration's model loads and "
                     "first runs plus the run's peak above its start (median); "
                     f"peak RSS of the process {summary['peak_rss_mb']:.0f} MB.")
    else:
        parts.append("memory MB: not measured (on a GPU the process RSS is not the models' "
                     "memory; `specd fit` measures it on the device).")
    parts.append("lookup share: of the drafting rounds, those whose draft came from prompt "
                 "lookup.")
    return " ".join(parts)


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Decode tokens/s per configuration, grouped by prompt and temperature (min–max as
    error bars, llama.cpp hatched), and acceptance per draft position of the fixed-length
    configurations (adaptive ones reach late positions too rarely to draw)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = summary["rows"]
    groups = list(dict.fromkeys((r["prompt"], r["temperature"]) for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by_key = {(r["prompt"], r["temperature"], r["config"]): r for r in rows}
    colors = plt.get_cmap("tab10")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5),
                                   gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(len(configs), 1)
    for ci, name in enumerate(configs):
        xs, ys, lo, hi = [], [], [], []
        for gi, (p, t) in enumerate(groups):
            r = by_key.get((p, t, name))
            if r is None:
                continue
            xs.append(gi - 0.4 + width * (ci + 0.5))
            ys.append(r["decode_tps"])
            lo.append(r["decode_tps"] - r["decode_tps_range"][0])
            hi.append(r["decode_tps_range"][1] - r["decode_tps"])
        ax1.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name, color=colors(ci % 10),
                hatch="//" if name.startswith("llama.cpp") else None, edgecolor="white")
    ax1.set_xticks(range(len(groups)), [f"{p}\nT = {t}" for p, t in groups])
    ax1.set_ylabel("decode tokens/s (median, min–max)")
    ax1.legend(fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax1.grid(axis="y", alpha=0.3)
    styles = {0.0: "-", 0.7: "--"}
    prompts = list(dict.fromkeys(p for p, _ in groups))
    for p, t in groups:
        for ci, name in enumerate(configs):
            r = by_key.get((p, t, name))
            if r is None or not r["per_position"] or "adaptive" in name:
                continue
            ax2.plot(range(1, len(r["per_position"]) + 1), r["per_position"],
                     marker="os^vD<>p*h"[ci % 10], markersize=4,
                     color=colors(prompts.index(p) % 10), linestyle=styles.get(t, ":"),
                     label=f"{p} T {t} {name}")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("conditional acceptance (median)")
    ax2.set_ylim(0, 1.02)
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.grid(alpha=0.3)
    if ax2.lines:
        ax2.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{summary.get('machine', '')}   {summary.get('date', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def write_outputs(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(summary, indent=1))
    paths[1].write_text(markdown_table(summary) + "\n")
    if plot(summary, out_dir / "bench.png"):
        paths.append(out_dir / "bench.png")
    return paths


def machine_description() -> str:
    """The machine, its CPU model where the OS tells it, and whether specd's own kernels
    ran (they change specd's speed by half)."""
    import platform

    from specd.ort_models import native_ops

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        pass
    why = native_ops.unavailable_reason()
    kernels = f"specd kernels off ({why})" if why else "specd kernels on"
    return ", ".join(p for p in (platform.machine(), cpu, f"{os.cpu_count()} cores",
                                 platform.platform(), kernels) if p)
