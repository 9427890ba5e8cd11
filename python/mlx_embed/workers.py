"""The most CPU workers a load takes: the one owner of that bound.

Every way to set the workers comes through here: ``load(workers=)``, its
``MLX_EMBED_WORKERS`` fallback, and the server's ``--workers`` (the Rust
launcher asks :func:`refusal` through the bridge, before any model loads,
rather than counting cores itself). Each worker is a thread computing its
own sub-batches with single-threaded kernels (see ``scheduler.py``): past
one per core they only take turns on the same cores, holding their
sub-batches' memory meanwhile. Four per core leaves room to measure
oversubscription, while a value that cannot be meant (2000 once started
2000 threads on 2 cores; 65535 passed /health, then failed the first batch)
is refused. No MLX here: asking the bound loads no engine.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

MAX_WORKERS = 256
WORKERS_PER_CORE = 4


@dataclasses.dataclass(frozen=True)
class WorkersBound:
    """The cores this process may run on, and whether a container's CPU
    quota is what counted them."""

    cores: int
    quota: bool = False

    @property
    def most(self) -> int:
        return min(MAX_WORKERS, WORKERS_PER_CORE * self.cores)

    def why(self) -> str:
        s = "s" if self.cores != 1 else ""
        quota = " (the CPU quota's)" if self.quota else ""
        return f"{WORKERS_PER_CORE} per core on {self.cores} core{s}{quota}, {MAX_WORKERS} at most"

    def refusal(self, setting: str, value: int, given: object = None) -> Optional[str]:
        """Why ``value`` of ``setting`` is refused, or None where it is
        taken: the one wording whichever way the value came (``given``: the
        value as it was written, where that was text)."""
        if value > self.most:
            shown = value if given is None else given
            return f"{setting} must be at most {self.most} ({self.why()}), got {shown!r}"
        return None


def _cgroup_root() -> str:
    return "/"


def quota_cores(root: Optional[str] = None) -> Optional[int]:
    """The whole cores the container's CPU quota grants this process (its
    quota over its period, at least 1: as Rust's ``available_parallelism``
    counts them), or None where no quota is set or none can be read. Reads
    cgroup v2's ``cpu.max`` and v1's ``cpu.cfs_quota_us`` from the process's
    cgroup up to the hierarchy's root (a parent's quota bounds its children
    too). A group the mount does not hold under its own path (Docker
    without a cgroup namespace bind-mounts the container's group itself at
    ``/sys/fs/cgroup``) is read at the mount's own files, which the walk up
    reaches: Rust's std finds those through mountinfo on v1 and not at all
    on v2, so there this may count fewer cores than it, never more.
    ``root``: where ``/proc`` and ``/sys`` are (a test's tree)."""
    root = root or _cgroup_root()
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    fs = os.path.join(root, "sys/fs/cgroup")
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip("/")
        if controllers == "":
            # v2: one unified tree, cpu.max is "max <period>" or "<quota> <period>".
            for folder in _up_from(fs, rel):
                read = _read(os.path.join(folder, "cpu.max"))
                if read is None:
                    continue
                fields = read.split()
                if len(fields) == 2 and fields[0] != "max":
                    found.append(_cores(fields[0], fields[1]))
        elif "cpu" in controllers.split(","):
            # v1: the cpu controller's mount, named for it or for the group it is in.
            for mount in dict.fromkeys((controllers, "cpu", "cpu,cpuacct")):
                for folder in _up_from(os.path.join(fs, mount), rel):
                    quota = _read(os.path.join(folder, "cpu.cfs_quota_us"))
                    period = _read(os.path.join(folder, "cpu.cfs_period_us"))
                    if quota is not None and period is not None and quota.strip() != "-1":
                        found.append(_cores(quota, period))
    valid = [n for n in found if n > 0]
    return min(valid) if valid else None


def _up_from(base: str, rel: str) -> list[str]:
    """``base/rel`` and each folder above it up to ``base``."""
    parts = [p for p in rel.split("/") if p]
    return [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cores(quota: str, period: str) -> int:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return 0
    if q <= 0 or p <= 0:
        return 0
    return max(1, q // p)


def workers_bound(root: Optional[str] = None) -> WorkersBound:
    """The cores this process may run on: its affinity (else the machine's),
    fewer where a container's CPU quota grants fewer."""
    try:
        cores = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = quota_cores(root)
    if quota is not None and quota < cores:
        return WorkersBound(quota, quota=True)
    return WorkersBound(cores)


def most_workers() -> tuple[int, str]:
    """The most workers this process takes, and why."""
    bound = workers_bound()
    return bound.most, bound.why()


def refusal(setting: str, value: int) -> Optional[str]:
    """Why ``value`` workers, given as ``setting``, are refused here, or
    None: what the Rust launcher asks for ``--workers``."""
    return workers_bound().refusal(setting, value)


def from_environment() -> Optional[int]:
    """``MLX_EMBED_WORKERS``, load()'s fallback, checked as ``load(workers=)``
    is; None where it is unset or empty."""
    from .errors import InvalidOption

    env = os.environ.get("MLX_EMBED_WORKERS", "").strip()
    if not env:
        return None
    if not (env.isdecimal() and env.isascii() and int(env) >= 1):
        raise InvalidOption(f"MLX_EMBED_WORKERS must be a whole number of at least 1, got {env!r}")
    why = workers_bound().refusal("MLX_EMBED_WORKERS", int(env), env)
    if why is not None:
        raise InvalidOption(why)
    return int(env)
