"""Where a cold start goes: seconds per startup stage, for the startup log
and ``spec().details``. Stages are recorded once, in the order they ran."""

from __future__ import annotations

import os
import time
from typing import Optional

_stages: dict[str, float] = {}


def process_age() -> Optional[float]:
    """Seconds since this process started (Linux; 10 ms resolution), which
    covers what ran before Python code did: the Rust binary and the
    interpreter's own start. None where /proc is not available."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def record(stage: str, seconds: float) -> None:
    _stages.setdefault(stage, seconds)


class timed:
    """``with timed("stage"):`` records the block's wall time once."""

    def __init__(self, stage: str):
        self.stage = stage

    def __enter__(self) -> "timed":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        record(self.stage, time.perf_counter() - self._t0)


def stages() -> dict[str, float]:
    return dict(_stages)


def describe(extra: Optional[dict[str, float]] = None) -> str:
    """``process_start=120ms import=150ms ...``: one line for logs and /info."""
    items = {**_stages, **(extra or {})}
    return " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in items.items())
