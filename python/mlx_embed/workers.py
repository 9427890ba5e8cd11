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
import re
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


@dataclasses.dataclass(frozen=True)
class CgroupMount:
    """One cgroup hierarchy mounted here, from ``/proc/self/mountinfo``:
    ``root`` is the group the mount shows at ``mount_point`` (``/`` for the
    whole hierarchy; a container's own group where Docker bind-mounts it
    without a cgroup namespace); ``controllers`` a v1 mount's (empty for v2)."""

    version: int
    root: str
    mount_point: str
    controllers: frozenset = frozenset()


def _unescape(field: str) -> str:
    # mountinfo writes a space, tab, newline or backslash in a path as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup mounts in a ``/proc/<pid>/mountinfo``'s text: each line is
    ``id parent major:minor root mount_point options [optional...] - fstype
    source super_options``; v1's controllers are among its super options."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        # The separator follows the six fixed fields and the optional ones;
        # a root or mount point that is itself "-" comes before it.
        sep = next((i for i in range(6, len(fields)) if fields[i] == "-"), None)
        if sep is None or len(fields) < sep + 2:
            continue
        fstype = fields[sep + 1]
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2":
            mounts.append(CgroupMount(2, root, point))
        elif fstype == "cgroup" and len(fields) > sep + 3:
            options = frozenset(fields[sep + 3].split(","))
            mounts.append(CgroupMount(1, root, point, options))
    return mounts


def parse_proc_cgroup(text: str) -> list[tuple[frozenset, str]]:
    """A ``/proc/<pid>/cgroup``'s lines as (controllers, the group's path):
    ``0::<path>`` is cgroup v2's unified group (no controllers named),
    ``<id>:<controllers>:<path>`` a v1 hierarchy's."""
    groups = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        groups.append((frozenset(c for c in controllers.split(",") if c), path))
    return groups


def _holds(mount_root: str, group: str) -> bool:
    """Whether a mount of ``mount_root``'s group shows ``group`` (the group
    itself or one under it)."""
    rel, base = group.strip("/"), mount_root.strip("/")
    return ".." not in rel.split("/") and (not base or rel == base or rel.startswith(base + "/"))


def _group_folders(mount_point: str, mount_root: str, group: str) -> list[str]:
    """The folders of ``group`` and each group above it that ``mount_point``
    shows (which holds ``mount_root``'s group and those under it), nearest
    first. A group not under the mount's root (a cgroup namespace's path,
    relative to where the process was when it was made) is read as under
    the mount point, and so reaches the mount point's own files; one that
    climbs out of the namespace (``/../x``) is the mount point's alone, as
    no folder under it is that group's."""
    rel = group.strip("/")
    if ".." in rel.split("/"):
        return [mount_point]
    base = mount_root.strip("/")
    if base and (rel == base or rel.startswith(base + "/")):
        rel = rel[len(base):].strip("/")
    return _up_from(mount_point, rel)


def _quota_v2(folder: str) -> Optional[int]:
    # cpu.max is "max <period>" (no quota) or "<quota> <period>".
    read = _read(os.path.join(folder, "cpu.max"))
    fields = read.split() if read is not None else []
    if len(fields) == 2 and fields[0] != "max":
        return _cores(fields[0], fields[1])
    return None


def _quota_v1(folder: str) -> Optional[int]:
    quota = _read(os.path.join(folder, "cpu.cfs_quota_us"))
    period = _read(os.path.join(folder, "cpu.cfs_period_us"))
    if quota is not None and period is not None and quota.strip() != "-1":
        return _cores(quota, period)
    return None


def quota_cores(root: Optional[str] = None, *, proc_cgroup: Optional[str] = None,
                mountinfo: Optional[str] = None) -> Optional[int]:
    """The whole cores the container's CPU quota grants this process (its
    quota over its period, at least 1: as Rust's ``available_parallelism``
    counts them), or None where no quota is set or none can be read. Reads
    cgroup v2's ``cpu.max`` and v1's ``cpu.cfs_quota_us`` from the process's
    own group (``/proc/self/cgroup``) up to the hierarchy's root (a
    parent's quota bounds its children too), where the hierarchy is
    mounted (``/proc/self/mountinfo``: a nested group, a mount elsewhere
    than ``/sys/fs/cgroup``, a mount of the container's own group, which
    Docker without a cgroup namespace bind-mounts at ``/sys/fs/cgroup``,
    are each found there; of several mounts of a hierarchy, those showing
    the process's group are read, not one of another group's). Where
    mountinfo is unreadable or names no cgroup
    mount, ``/sys/fs/cgroup`` (v2) and its controller folders (v1) are read
    as the hierarchy's root. ``root``: where ``/proc`` and ``/sys`` are (a
    test's tree; mount points are read under it); ``proc_cgroup``,
    ``mountinfo``: those two files' paths, where not under ``root``."""
    root = root or _cgroup_root()
    text = _read(proc_cgroup or os.path.join(root, "proc/self/cgroup"))
    if text is None:
        return None
    mounts = parse_mountinfo(_read(mountinfo or os.path.join(root, "proc/self/mountinfo")) or "")

    def under_root(point: str) -> str:
        return os.path.join(root, point.lstrip("/"))

    fs = os.path.join(root, "sys/fs/cgroup")
    found: list[int] = []
    for controllers, group in parse_proc_cgroup(text):
        if not controllers:
            if not group.startswith("/"):
                continue
            places = [(under_root(m.mount_point), m.root) for m in mounts if m.version == 2] or [(fs, "/")]
            read = _quota_v2
        elif "cpu" in controllers:
            places = [(under_root(m.mount_point), m.root) for m in mounts
                      if m.version == 1 and "cpu" in m.controllers]
            if not places:
                # v1's usual layout: the cpu controller's folder, named for
                # it or for the group of controllers it is in.
                named = ",".join(sorted(controllers))
                places = [(os.path.join(fs, mount), "/")
                          for mount in dict.fromkeys((named, "cpu", "cpu,cpuacct"))]
            read = _quota_v1
        else:
            continue
        # A mount showing the process's group is read, not another of the
        # same hierarchy showing some other group (a second container's, a
        # host's hierarchy mounted for an agent): that group's quota is not
        # this process's. Only where none shows it are all read as above.
        places = [p for p in places if _holds(p[1], group)] or places
        for point, mount_root in places:
            for folder in _group_folders(point, mount_root, group):
                cores = read(folder)
                if cores is not None:
                    found.append(cores)
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
