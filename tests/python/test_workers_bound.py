"""The workers bound's one owner (``mlx_embed/workers.py``): 4 per core this
process may run on, 256 at most, the cores counted from a container's CPU
quota where it grants fewer; ``load(workers=)``, ``MLX_EMBED_WORKERS`` and
the server's ``--workers`` (through the bridge) all ask it."""

import os

import pytest

from mlx_embed import errors, workers


def _tree(tmp_path, cgroup: str, files: dict[str, str]):
    """A fake root with ``/proc/self/cgroup`` and files under ``/sys/fs/cgroup``."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_cgroup_v2_quota_is_the_least_on_the_way_up(tmp_path):
    root = _tree(tmp_path, "0::/kubepods/pod1/c1\n", {
        "kubepods/cpu.max": "300000 100000\n",
        "kubepods/pod1/cpu.max": "max 100000\n",
        "kubepods/pod1/c1/cpu.max": "250000 100000\n",
    })
    # 2.5 cores is 2 whole ones (as Rust's available_parallelism rounds).
    assert workers.quota_cores(root) == 2


def test_cgroup_v2_without_a_quota_counts_none(tmp_path):
    root = _tree(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert workers.quota_cores(root) is None


def test_a_quota_under_one_core_is_one_core(tmp_path):
    root = _tree(tmp_path, "0::/c\n", {"c/cpu.max": "50000 100000\n"})
    assert workers.quota_cores(root) == 1


def test_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    root = _tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    })
    assert workers.quota_cores(root) == 4
    unlimited = _tree(tmp_path / "u", "3:cpu,cpuacct:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert workers.quota_cores(unlimited) is None


def test_no_cgroup_files_count_no_quota(tmp_path):
    assert workers.quota_cores(str(tmp_path)) is None


def test_the_quota_lowers_the_cores_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    root = _tree(tmp_path, "0::/c\n", {"c/cpu.max": "200000 100000\n"})
    bound = workers.workers_bound(root)
    assert (bound.cores, bound.quota, bound.most) == (2, True, 8)
    assert bound.why() == "4 per core on 2 cores (the CPU quota's), 256 at most"
    # A quota above the affinity leaves the affinity's count.
    roomy = _tree(tmp_path / "r", "0::/c\n", {"c/cpu.max": "3200000 100000\n"})
    assert workers.workers_bound(roomy) == workers.WorkersBound(16)


def test_the_bound_is_4_per_core_and_256_at_most():
    assert workers.WorkersBound(1).most == 4
    assert workers.WorkersBound(2).most == 8
    assert workers.WorkersBound(64).most == 256
    assert workers.WorkersBound(100).most == 256
    assert workers.WorkersBound(1).why() == "4 per core on 1 core, 256 at most"


def test_the_refusal_names_the_setting_and_the_bound():
    bound = workers.WorkersBound(2)
    assert bound.refusal("--workers", 8) is None
    assert bound.refusal("--workers", 9) == (
        "--workers must be at most 8 (4 per core on 2 cores, 256 at most), got 9")
    assert workers.WorkersBound(100).refusal("workers", 257) == (
        "workers must be at most 256 (4 per core on 100 cores, 256 at most), got 257")
    # What the bridge asks for --workers is this process's bound.
    most, why = workers.most_workers()
    assert workers.refusal("--workers", most) is None
    assert workers.refusal("--workers", most + 1) == f"--workers must be at most {most} ({why}), got {most + 1}"


def test_the_environment_fallback_is_checked_by_the_same_owner(monkeypatch):
    most, why = workers.most_workers()
    monkeypatch.delenv("MLX_EMBED_WORKERS", raising=False)
    assert workers.from_environment() is None
    monkeypatch.setenv("MLX_EMBED_WORKERS", f" {most} ")
    assert workers.from_environment() == most
    monkeypatch.setenv("MLX_EMBED_WORKERS", str(most + 1))
    with pytest.raises(errors.InvalidOption) as refused:
        workers.from_environment()
    assert str(refused.value) == f"MLX_EMBED_WORKERS must be at most {most} ({why}), got '{most + 1}'"
    for bad in ("two", "0", "-1", "1.5"):
        monkeypatch.setenv("MLX_EMBED_WORKERS", bad)
        with pytest.raises(errors.InvalidOption, match="MLX_EMBED_WORKERS must be a whole number of at least 1"):
            workers.from_environment()


def test_a_bind_mounted_container_cgroup_is_read_at_the_mount(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup names the host's
    path, while /sys/fs/cgroup/<controller> is the container's own group (a
    bind mount of that path), so the named path is not there and the quota
    is the mount's own file (Rust's std finds it through mountinfo)."""
    v1 = _tree(tmp_path / "v1", "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "150000\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert workers.quota_cores(v1) == 1
    v2 = _tree(tmp_path / "v2", "0::/system.slice/docker-abc.scope\n", {"cpu.max": "300000 100000\n"})
    assert workers.quota_cores(v2) == 3


def test_a_hybrid_hierarchy_reads_the_v1_cpu_controller(tmp_path):
    """systemd's hybrid layout (this project's CI machine): a v2 line for
    the unified tree, which holds no cpu controller, beside the v1 ones."""
    root = _tree(tmp_path, "1:cpu:/job\n2:cpuacct:/\n0::/\n", {
        "cpu/job/cpu.cfs_quota_us": "200000\n",
        "cpu/job/cpu.cfs_period_us": "100000\n",
        "cpu/cpu.cfs_quota_us": "-1\n",
        "cpu/cpu.cfs_period_us": "100000\n",
        "unified/cgroup.controllers": "pids\n",
    })
    assert workers.quota_cores(root) == 2


def test_a_malformed_quota_counts_none(tmp_path):
    root = _tree(tmp_path, "0::/c\n", {"c/cpu.max": "lots 100000\n", "cpu.max": "100000 0\n"})
    assert workers.quota_cores(root) is None
