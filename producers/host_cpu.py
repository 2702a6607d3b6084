r"""How much CPU this process got, and how long it waited for one.

Linux keeps, per thread, the time it ran and the time it was runnable but not
running (``/proc/<pid>/task/<tid>/schedstat``: run time, run-queue wait, slices).
The wait counts a crowded run queue and a cgroup's CPU quota alike (a throttled
thread stays runnable), so it is the direct measure of a rank starved of CPU:
its host oversubscribed, its container's limit, a noisy neighbour.

A container's CPU limit is also accounted by the kernel on its own: the CPU cgroup's
``cpu.stat`` says how long the group was throttled, its quota spent while it had work
to run (``throttled_time`` in ns under cgroup v1, ``throttled_usec`` under v2).
:func:`cgroup_throttled` sums it over this process's CPU cgroup and the groups above it
(a pod's limit and its container's alike). Unlike the run-queue wait, it counts a quota
alone: a crowded host adds nothing to it, and a rank whose threads mostly sleep in
their transfers still shows the time its quota held it back.

>>> got = process_cpu()
>>> got is None or (got[0] > 0 and got[1] >= 0)
True
>>> throttled_in("nr_periods 40\nnr_throttled 9\nthrottled_time 123456789\n")
123456789
>>> throttled_in("usage_usec 9\nnr_throttled 2\nthrottled_usec 1500\n")
1500000
"""

from __future__ import annotations

import functools
import os

_TASKS = "/proc/self/task"
_PROC = "/proc/self"


def process_cpu(tasks: str = _TASKS) -> tuple[int, int] | None:
    """(run ns, wait ns) summed over the process's live threads; None where the kernel
    does not keep them. A thread that ended takes its counts with it: readers take
    differences between readings and clip them at zero."""
    run = wait = 0
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:
            continue  # the thread ended while we listed them
        if len(fields) >= 2:
            run += int(fields[0])
            wait += int(fields[1])
    return (run, wait) if run > 0 else None


def throttled_in(stat: str) -> int | None:
    """The throttled time, in ns, a CPU cgroup's ``cpu.stat`` text gives (v1 or v2);
    None where it has none (v2 without the cpu controller)."""
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "throttled_time":
            return int(value)
        if name == "throttled_usec":
            return int(value) * 1000
    return None


@functools.lru_cache(maxsize=8)
def _cpu_mounts(proc: str) -> tuple[tuple[bool, str, str], ...]:
    """The CPU cgroup hierarchies mounted here: (v2, the mount's root in the hierarchy,
    where it is mounted), from ``mountinfo`` (a container sees its own group as root)."""
    out = []
    try:
        with open(f"{proc}/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return ()
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) < 5 or len(kind) < 3:
            continue
        if kind[0] == "cgroup2":
            out.append((True, fields[3], fields[4]))
        elif kind[0] == "cgroup" and "cpu" in kind[2].split(","):
            out.append((False, fields[3], fields[4]))
    return tuple(out)


def cgroup_throttled(proc: str = _PROC) -> int | None:
    """ns this process's CPU cgroup and those above it (to the mount's root) were
    throttled, summed; None where no CPU cgroup is readable. Read anew each time: a
    process can be moved to another group, whose counter starts again (readers take
    differences and clip them at zero)."""
    try:
        with open(f"{proc}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths: dict[bool, str] = {}
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and not ctrls:
            paths.setdefault(True, path)
        elif "cpu" in ctrls.split(","):
            paths[False] = path
    # a v1 cpu hierarchy holds the controller where both are mounted (hybrid)
    for v2, root, mount in sorted(_cpu_mounts(proc), key=lambda m: m[0]):
        path = paths.get(v2)
        if path is None:
            continue
        rel = os.path.relpath(path, root) if path.startswith(root) else None
        if rel is None or rel.startswith(".."):
            continue
        total, seen, here = 0, False, os.path.normpath(os.path.join(mount, rel))
        while True:
            try:
                with open(f"{here}/cpu.stat") as f:
                    got = throttled_in(f.read())
            except OSError:
                got = None
            if got is not None:
                total, seen = total + got, True
            if here == os.path.normpath(mount):
                break
            here = os.path.dirname(here)
        if seen:
            return total
    return None


__all__ = ["cgroup_throttled", "process_cpu", "throttled_in"]
