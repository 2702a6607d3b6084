"""What ``megatrace bench pipeline`` measures besides time: the CPU a run took (the
flow's own thread, the rest of its process, the local broker's), the process's resident
memory, and the latency from a record's production to its storage."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from infra.stack import Stack


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now_mb() -> float | None:
    """The process's resident memory now (not its peak), or None off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


class Probe:
    """Collects (records, produced ms, stored ms) from the ClickHouse sink, and the
    process's resident memory after each insert."""

    def __init__(self) -> None:
        self.n = 0
        self.lat: list[tuple[int, int]] = []
        self.rss: list[tuple[int, float]] = []  # (records stored so far, MB resident)

    def __call__(self, count: int, produced_ms: int, stored_ms: int) -> None:
        self.n += count
        if produced_ms > 0:
            self.lat.append((stored_ms - produced_ms, count))
        if (mb := rss_now_mb()) is not None:
            self.rss.append((self.n, mb))

    def rss_at(self, share: float) -> float | None:
        """Resident MB once ``share`` of the records seen were stored (None: unknown)."""
        return next((mb for n, mb in self.rss if n >= share * self.n), None)

    def rss_row(self) -> tuple[str, str]:
        """Resident memory at a quarter, half and all of the run, and its growth over the
        second half (a flow whose state is bounded stays flat once warm).

        >>> p = Probe()
        >>> p.rss = [(100, 900.0), (250, 1000.0), (500, 1100.0), (1000, 1210.0)]
        >>> p.n = 1000
        >>> p.rss_row()
        ('1,000 / 1,100 / 1,210 MB', '+10.0% over the second half')
        """
        known = [mb for q in (0.25, 0.5, 1.0) if (mb := self.rss_at(q)) is not None]
        if len(known) < 3:
            return "unknown (no /proc)", ""
        quarter, half, end = known
        growth = f"{end / half - 1:+.1%} over the second half"
        return f"{quarter:,.0f} / {half:,.0f} / {end:,.0f} MB", growth

    def percentile(self, q: float) -> float:
        if not self.lat:
            return float("nan")
        v = np.repeat([x for x, _ in self.lat], [c for _, c in self.lat])
        return float(np.percentile(v, q))


@dataclass(frozen=True)
class Cpu:
    """CPU seconds a run took: the flow's own thread (every Python step runs there), the
    rest of its process (the embedded ClickHouse engine's threads, the Kafka client's,
    the insert threads) and the local broker's process (None: not known)."""

    flow: float
    rest: float
    broker: float | None

    def per_record(self, n: int) -> str:
        us = 1e6 / max(1, n)
        broker = "" if self.broker is None else f", broker {self.broker * us:.1f}"
        return f"flow thread {self.flow * us:.1f}, rest of the process {self.rest * us:.1f}{broker}"


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux), or None."""
    if pid is None:
        return None
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one read of a tiny file
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_meter(stack: Stack) -> Callable[[], Cpu]:
    """Start counting CPU in this thread, this process and the local broker; the returned
    function says what was spent since."""
    info = stack.broker.status() if stack.uses_local_broker else None
    pid = None if info is None else info.pid
    b0, c0, p0 = process_cpu_s(pid), time.thread_time(), time.process_time()

    def spent() -> Cpu:
        c1, p1, b1 = time.thread_time(), time.process_time(), process_cpu_s(pid)
        broker = None if b0 is None or b1 is None else b1 - b0
        return Cpu(c1 - c0, (p1 - p0) - (c1 - c0), broker)

    return spent


__all__ = ["Cpu", "Probe", "cpu_meter", "process_cpu_s", "rss_mb", "rss_now_mb"]
