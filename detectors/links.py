"""Per-link throughput against each link's own baseline (MEGATRACE's WR measurement).

A link is degraded when its throughput stays more than ``drop`` below its
baseline for ``persistence`` samples in a row; it recovers after as many
samples back within half that drop.

>>> from schemas.records import LinkSample
>>> mon = LinkMonitor(warmup=3)
>>> def s(t, gbps):
...     return LinkSample(job="j", node="a", rank=0, ts_ns=t, window_ns=1, nic="x",
...                       src_rank=0, dst_rank=8, throughput_gbps=gbps)
>>> [e.kind for t, g in enumerate([400, 390, 410, 400, 150, 140]) if (e := mon.update(s(t, g)))]
['degraded']
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.records import LinkSample


@dataclass(frozen=True)
class LinkEvent:
    kind: str  # "degraded" | "recovered"
    src_rank: int
    dst_rank: int
    onset_ns: int
    baseline_gbps: float
    current_gbps: float

    @property
    def drop(self) -> float:
        return 1.0 - self.current_gbps / self.baseline_gbps if self.baseline_gbps else 0.0


@dataclass(slots=True)
class _Link:
    seed: list[float]
    baseline: float = 0.0
    run: int = 0
    run_start: int = 0
    degraded: bool = False


class LinkMonitor:
    def __init__(self, warmup: int = 5, drop: float = 0.2, persistence: int = 2) -> None:
        if warmup < 1 or not 0 < drop < 1 or persistence < 1:
            raise ValueError("warmup >= 1, 0 < drop < 1, persistence >= 1")
        self.warmup = warmup
        self.drop = drop
        self.persistence = persistence
        self._links: dict[tuple[int, int], _Link] = {}

    def update(self, s: LinkSample) -> LinkEvent | None:
        key = (s.src_rank, s.dst_rank)
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = _Link(seed=[])
        x = s.throughput_gbps
        if len(link.seed) < self.warmup:
            link.seed.append(x)
            if len(link.seed) == self.warmup:
                link.baseline = sorted(link.seed)[self.warmup // 2]
            return None
        low = x < (1 - self.drop) * link.baseline
        ok = x >= (1 - self.drop / 2) * link.baseline
        if not link.degraded:
            if low:
                link.run_start = link.run_start if link.run else s.ts_ns
                link.run += 1
                if link.run >= self.persistence:
                    link.degraded, link.run = True, 0
                    return LinkEvent("degraded", *key, link.run_start, link.baseline, x)
            else:
                link.run = 0
                if ok:
                    link.baseline += 0.05 * (x - link.baseline)
            return None
        if ok:
            link.run += 1
            if link.run >= self.persistence:
                link.degraded, link.run = False, 0
                return LinkEvent("recovered", *key, s.ts_ns, link.baseline, x)
        else:
            link.run = 0
        return None

    @property
    def degraded(self) -> list[tuple[int, int]]:
        return [k for k, v in self._links.items() if v.degraded]
