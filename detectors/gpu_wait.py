"""How late each rank's sends find their data, against the rank's own baseline.

NCCL's proxy records, per send, how long it waited for the GPU to produce the data
(SendGPUWait). A rank whose sends wait far longer than they used to is a GPU producing
late: the GPU column of the decision table (docs/method.md), which confirms a
compute culprit named from arrival times.

>>> base = GpuWaitBaseline(windows=2)
>>> for wait in (100.0, 120.0, 110.0):  # windows of normal sends
...     base.update(3, wait)
>>> base.update(3, 900.0)  # its sends now wait on their data
>>> ev = base.evidence(3)
>>> round(ev["send_gpu_wait_ratio"], 1), base.evidence(4)
(4.6, {})
"""

from __future__ import annotations


class GpuWaitBaseline:
    """Per sending rank: a baseline SendGPUWait per send from its first ``windows``
    measures, then a moving average of the latest (half each new one).

    Parameters
    ----------
    windows
        Measures (each a window of a rank's completed sends) that make the baseline.
    """

    def __init__(self, windows: int = 4) -> None:
        if windows < 1:
            raise ValueError(f"windows must be at least 1, not {windows}")
        self.windows = windows
        self._reset()

    def _reset(self) -> None:
        self._ranks: dict[int, list[float]] = {}  # rank -> [baseline sum, measures, latest]

    def update(self, rank: int, wait_ns: float) -> None:
        """One window's mean SendGPUWait per send of ``rank``."""
        t = self._ranks.get(rank)
        if t is None:
            t = self._ranks[rank] = [0.0, 0.0, wait_ns]
        if t[1] < self.windows:
            t[0] += wait_ns
            t[1] += 1
        t[2] = 0.5 * t[2] + 0.5 * wait_ns

    def evidence(self, rank: int | None) -> dict[str, float]:
        """How late ``rank``'s sends find their data lately, and that over its baseline
        (nothing where it is not known)."""
        t = self._ranks.get(rank) if rank is not None else None
        if t is None or not t[1]:
            return {}
        base = t[0] / t[1]
        return {"send_gpu_wait_ns": t[2], "send_gpu_wait_ratio": t[2] / max(base, 1.0)}


__all__ = ["GpuWaitBaseline"]
