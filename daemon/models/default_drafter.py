"""Which drafter a catalog target speculates with when none is named: the one measured
fastest beside it.

`packaged/speculation.json` holds, per catalog target, each measured drafter's decode
speed as a multiple of target-only decoding, per workload (prompt kind and temperature),
as `bench/head_vs_draft.py --write-choice` wrote it from one benchmark run. The choice is
the drafter with the highest geometric mean over the workloads; no drafter where none is
faster than the target alone. A drafter named `a+b` is a head and a draft model run side by
side (spec type head+draft).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .catalog import CATALOG

CHOICE_FILE = "speculation.json"


@dataclass(frozen=True)
class DrafterChoice:
    draft: str | None  # a catalog name, or two joined by "+"; None: decode without
    reason: str  # one line for the user: what was measured and what it showed
    # the other drafters measured faster than target-only, fastest first: where `draft`
    # does not fit in memory beside the target, the next that does
    fallbacks: tuple[str, ...] = ()


def choice_table(path: Path | None = None) -> dict[str, Any]:
    """The measurements (an empty table where specd ships none)."""
    if path is None:
        from .store import packaged_dir

        path = packaged_dir() / CHOICE_FILE
    if not path.is_file():
        return {}
    table: dict[str, Any] = json.loads(path.read_text())
    return table


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def default_drafter(target: str, table: dict[str, Any] | None = None) -> DrafterChoice | None:
    """The measured fastest drafter for catalog target `target` (None: nothing measured)."""
    entry = (choice_table() if table is None else table).get(target)
    if not entry:
        return None
    speeds = {name: _geomean(list(cells.values()))
              for name, cells in entry["speedup"].items()
              if cells and all(part in CATALOG for part in name.split("+"))}
    if not speeds:
        return None
    ranked = sorted(speeds.items(), key=lambda kv: kv[1], reverse=True)
    best, best_speed = ranked[0]
    others = "; ".join(f"{name} {speed:.2f}×" for name, speed in ranked[1:])
    measured = (f"decode speed against target-only, geometric mean over "
                f"{', '.join(entry['workloads'])}: {best} {best_speed:.2f}×"
                + (f"; {others}" if others else "") + f" ({entry['measured']})")
    if best_speed <= 1.0:
        return DrafterChoice(None, f"no speculation for {target}: no drafter measured faster "
                                   f"than the target alone ({measured})")
    return DrafterChoice(best, f"speculation for {target}: {best}, the fastest measured "
                               f"({measured}); -md names another, -md none decodes without",
                         tuple(name for name, speed in ranked[1:] if speed > 1.0))
