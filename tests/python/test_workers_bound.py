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


# mountinfo lines as the kernel writes them: id parent major:minor root
# mount_point options [optional fields] - fstype source super_options.
V2_MOUNT = "30 24 0:26 {root} {point} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "35 25 0:31 {root} {point} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup cgroup rw,{controllers}\n"
ROOT_FS = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"


def _mounted(tmp_path, cgroup: str, mountinfo: str, files: dict[str, str]):
    """A fake root whose ``/proc/self/mountinfo`` says where cgroups are;
    ``files`` are under the root itself (mount points are absolute)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_mountinfo_is_parsed_for_cgroup_mounts_alone():
    text = (ROOT_FS
            + V2_MOUNT.format(root="/", point="/sys/fs/cgroup/unified")
            + V1_MOUNT.format(root="/docker/abc", point="/sys/fs/cgroup/cpu,cpuacct", controllers="cpu,cpuacct")
            # No optional fields, and a space in the mount point (\040).
            + "40 25 0:33 /a /mnt/my\\040cgroups rw - cgroup2 none rw\n"
            + "garbage line\n")
    assert workers.parse_mountinfo(text) == [
        workers.CgroupMount(2, "/", "/sys/fs/cgroup/unified"),
        workers.CgroupMount(1, "/docker/abc", "/sys/fs/cgroup/cpu,cpuacct", frozenset({"rw", "cpu", "cpuacct"})),
        workers.CgroupMount(2, "/a", "/mnt/my cgroups"),
    ]
    assert workers.parse_proc_cgroup("0::/a/b\n3:cpu,cpuacct:/docker/x\nbad\n2:name=systemd:/\n") == [
        (frozenset(), "/a/b"), (frozenset({"cpu", "cpuacct"}), "/docker/x"), (frozenset({"name=systemd"}), "/"),
    ]


def test_a_nested_v2_group_is_read_where_mountinfo_mounts_the_hierarchy(tmp_path):
    """A v2 hierarchy mounted away from /sys/fs/cgroup: the process's own
    group, three levels down, and its parents are read there; a decoy at
    /sys/fs/cgroup, where the old reading looked, is not."""
    root = _mounted(tmp_path, "0::/kubepods/burstable/pod7/c1\n",
                    ROOT_FS + V2_MOUNT.format(root="/", point="/run/cg2"), {
                        "run/cg2/kubepods/burstable/pod7/c1/cpu.max": "max 100000\n",
                        "run/cg2/kubepods/burstable/pod7/cpu.max": "350000 100000\n",
                        "run/cg2/kubepods/cpu.max": "800000 100000\n",
                        "sys/fs/cgroup/kubepods/burstable/pod7/c1/cpu.max": "100000 100000\n",
                    })
    assert workers.quota_cores(root) == 3


def test_a_v2_mount_of_the_containers_own_group_is_read_at_its_mount_point(tmp_path):
    """Docker without a cgroup namespace: mountinfo says the mount at
    /sys/fs/cgroup is the group /system.slice/docker-abc.scope itself, so
    the process's group (that path) is the mount point's own files."""
    group = "/system.slice/docker-abc.scope"
    root = _mounted(tmp_path, f"0::{group}/app\n",
                    ROOT_FS + V2_MOUNT.format(root=group, point="/sys/fs/cgroup"), {
                        "sys/fs/cgroup/app/cpu.max": "max 100000\n",
                        "sys/fs/cgroup/cpu.max": "600000 100000\n",
                    })
    assert workers.quota_cores(root) == 6


def test_a_v1_cpu_controller_is_found_through_mountinfo(tmp_path):
    """The cpu controller mounted by a name the old reading did not try,
    holding a nested group below its mount's root."""
    root = _mounted(tmp_path, "5:memory:/k/p\n4:cpuacct,cpu:/k/p/c\n",
                    ROOT_FS
                    + V1_MOUNT.format(root="/", point="/cgroup/memory", controllers="memory")
                    + V1_MOUNT.format(root="/k", point="/cgroup/compute", controllers="cpuacct,cpu"), {
                        "cgroup/compute/p/c/cpu.cfs_quota_us": "-1\n",
                        "cgroup/compute/p/c/cpu.cfs_period_us": "100000\n",
                        "cgroup/compute/p/cpu.cfs_quota_us": "500000\n",
                        "cgroup/compute/p/cpu.cfs_period_us": "100000\n",
                        # The memory controller's mount holds no cpu files to read.
                        "cgroup/memory/p/cpu.cfs_quota_us": "100000\n",
                        "cgroup/memory/p/cpu.cfs_period_us": "100000\n",
                    })
    assert workers.quota_cores(root) == 5


def test_the_proc_files_can_be_given_by_path(tmp_path):
    (tmp_path / "cgroup.txt").write_text("0::/g\n")
    (tmp_path / "mountinfo.txt").write_text(V2_MOUNT.format(root="/", point="/hier"))
    (tmp_path / "hier/g").mkdir(parents=True)
    (tmp_path / "hier/g/cpu.max").write_text("200000 100000\n")
    assert workers.quota_cores(str(tmp_path), proc_cgroup=str(tmp_path / "cgroup.txt"),
                               mountinfo=str(tmp_path / "mountinfo.txt")) == 2
    # Without mountinfo's word, /sys/fs/cgroup is the hierarchy (none here).
    assert workers.quota_cores(str(tmp_path), proc_cgroup=str(tmp_path / "cgroup.txt"),
                               mountinfo=str(tmp_path / "none.txt")) is None


def test_a_mountinfo_without_cgroup_mounts_falls_back_to_sys_fs_cgroup(tmp_path):
    root = _mounted(tmp_path, "0::/c\n", ROOT_FS, {"sys/fs/cgroup/c/cpu.max": "300000 100000\n"})
    assert workers.quota_cores(root) == 3


def test_a_mount_of_another_group_is_not_read_where_one_shows_the_process(tmp_path):
    """Two mounts of the v2 hierarchy: the whole of it at /sys/fs/cgroup,
    and another container's group at /mnt/other (as an agent mounts one).
    The process's group is under the first alone: the other's 1-core quota
    is not this process's."""
    root = _mounted(tmp_path, "0::/user.slice/app\n",
                    ROOT_FS
                    + V2_MOUNT.format(root="/", point="/sys/fs/cgroup")
                    + V2_MOUNT.format(root="/kubepods/other", point="/mnt/other"), {
                        "sys/fs/cgroup/user.slice/cpu.max": "400000 100000\n",
                        "mnt/other/cpu.max": "100000 100000\n",
                    })
    assert workers.quota_cores(root) == 4


def test_a_mountinfo_line_whose_mount_point_is_a_dash_is_still_a_cgroup_mount():
    text = "41 25 0:34 / - rw shared:5 - cgroup2 cgroup2 rw\n"
    assert workers.parse_mountinfo(text) == [workers.CgroupMount(2, "/", "-")]


def test_a_group_outside_the_namespace_does_not_climb_out_of_the_mount(tmp_path):
    """/proc/self/cgroup's /../sibling (moved out of its cgroup namespace's
    root): no folder above the mount point is read as its group."""
    root = _mounted(tmp_path, "0::/../sibling\n",
                    ROOT_FS + V2_MOUNT.format(root="/", point="/sys/fs/cgroup/ns"), {
                        "sys/fs/sibling/cpu.max": "100000 100000\n",
                        "sys/fs/cgroup/sibling/cpu.max": "100000 100000\n",
                    })
    assert workers.quota_cores(root) is None
    (tmp_path / "sys/fs/cgroup/ns").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/ns/cpu.max").write_text("700000 100000\n")
    assert workers.quota_cores(root) == 7
