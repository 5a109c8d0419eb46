"""fastload.system: affinity and cgroup CPU quota."""

from __future__ import annotations

from fastload.system import cgroup_cpu_quota, cpu_budget


def test_cgroup_v2_quota_tightest_ancestor_wins(tmp_path):
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "cpu.max").write_text("400000 100000\n")
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("250000 100000\n")
    quota, where = cgroup_cpu_quota(tmp_path, "0::/kubepods/pod1\n")
    assert quota == 2.5 and where.endswith("pod1/cpu.max")
    b = cpu_budget(tmp_path, "0::/kubepods/pod1\n", affinity=set(range(8)))
    assert b.available == 3 and b.affinity_cpus == 8
    assert "cgroup quota 2.5 CPUs" in b.explain()


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu,cpuacct").mkdir()
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("150000")
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_quota(tmp_path, "")[0] == 1.5
    assert cpu_budget(tmp_path, "", affinity={0, 1, 2, 3}).available == 2


def test_no_quota_means_affinity(tmp_path):
    assert cgroup_cpu_quota(tmp_path, "0::/\n") is None
    (tmp_path / "cpu.max").write_text("max 100000")
    b = cpu_budget(tmp_path, "0::/\n", affinity={0, 5})
    assert b.available == 2 and b.cgroup_quota is None
