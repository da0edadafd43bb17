"""Durations as Ollama reads `keep_alive` and OLLAMA_KEEP_ALIVE: a number of seconds or a
Go duration ("5m", "1h30m", "300ms"), negative for forever."""

from __future__ import annotations

import math
import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float) -> float:
    """Seconds (< 0: forever); ValueError for anything else (NaN and infinity too)."""
    seconds = _seconds(value)
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"not a duration: {value!r} (seconds, or such as \"5m\" or "
                         "\"1h30m\")")
    return seconds


def _seconds(value: str | float) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    try:
        return sign * float(text)
    except ValueError:
        parts = _PART.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sign * sum(float(n) * _SECONDS[u] for n, u in parts)
    return None
