"""This process's resident memory: now, its peak over a block (nestable), and freed
heap memory given back."""

from __future__ import annotations

import ctypes
import sys
import threading
import time


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def trim_heap() -> bool:
    """Give the heap's free memory back to the system (glibc's malloc_trim, every arena:
    threads' arenas keep what a big request freed resident otherwise). False where the
    allocator has no such call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return False
    trim(0)
    return True


def read_hwm() -> int:
    """Peak RSS (VmHWM) in bytes since the last reset; 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def lifetime_peak() -> int:
    """Peak RSS so far (reset by PeakRss on Linux): VmHWM, else getrusage."""
    hwm = read_hwm()
    if hwm:
        return hwm
    try:
        import resource
    except ImportError:  # Windows
        return rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return read_hwm() > 0
    except OSError:
        return False


_active: list[PeakRss] = []  # open blocks, outermost first


class PeakRss:
    """Peak resident set size of this process over a block; `start` is the RSS it began
    at, `growth` what it left allocated (RSS at the end minus `start`).

    Linux: VmHWM from /proc/self/status, reset to the current RSS by writing 5 to
    /proc/self/clear_refs (process-wide, so entering a block first folds the mark into the
    blocks already open). Elsewhere (or if that is refused) a thread samples the RSS every
    `interval_s`.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.start = self.peak = self.growth = 0
        self._hwm = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        if _active:
            mark = max(read_hwm(), rss_bytes())
            for outer in _active:
                outer.peak = max(outer.peak, mark)
        self._hwm = _reset_hwm()
        self.start = self.peak = rss_bytes()
        if not self._hwm:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        _active.append(self)
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        end = rss_bytes()
        self.peak = max(self.peak, end, read_hwm() if self._hwm else 0)
        self.growth = end - self.start
        _active.remove(self)
        for outer in _active:
            outer.peak = max(outer.peak, self.peak)
