"""How many CPUs this process may use: its affinity mask, capped by its cgroup's CPU limit (a pod's
`resources.limits.cpu`), since torch's default thread count sees every core of the node."""

from __future__ import annotations

import math
import os
from pathlib import Path


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU limit of this process's cgroup (v2 `cpu.max`, or v1 quota / period), or None (no limit)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def available_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on, at most its cgroup's limit rounded up; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def split(cpus: int, parts: int) -> int:
    """Threads for each of `parts` processes sharing `cpus` CPUs (at least 1)."""
    return max(1, cpus // max(1, parts))
