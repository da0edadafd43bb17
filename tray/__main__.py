"""`python -m specd.tray`: the tray app without the rest of the CLI (same as `specd tray`)."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys

from .app import add_tray_args, run


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>`: where is a hung tray stuck? (a diagnostic only: the dump reads
    # other threads' frames unlocked, and a tray whose threads run may crash on it)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    p = argparse.ArgumentParser(prog="specd tray", description=(
        "A system-tray icon showing and controlling the specd daemon."))
    p.add_argument("-v", "--verbose", action="store_true")
    add_tray_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
