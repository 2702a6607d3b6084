"""How much CPU this process got, and how long it waited for one.

Linux keeps, per thread, the time it ran and the time it was runnable but not
running (``/proc/<pid>/task/<tid>/schedstat``: run time, run-queue wait, slices).
The wait counts a crowded run queue and a cgroup's CPU quota alike (a throttled
thread stays runnable), so it is the direct measure of a rank starved of CPU:
its host oversubscribed, its container's limit, a noisy neighbour.

>>> got = process_cpu()
>>> got is None or (got[0] > 0 and got[1] >= 0)
True
"""

from __future__ import annotations

import os

_TASKS = "/proc/self/task"


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


__all__ = ["process_cpu"]
