"""Peers' rules, reimplemented over our records so ``megatrace eval`` can compare.

Each baseline sees the same record stream and says what its rule would have
reported, with the time it would have said it. They are deliberately the
published rules (docs/method.md, section 8), not tuned versions:

* :class:`LatestArrival` (Holistic Trace Analysis): each iteration, the rank whose
  gradient-sync NCCL kernel starts last; a rank that is last in most
  iterations of a window is reported as a straggler.
* :class:`KernelScore` (NVIDIA Resiliency Extension): straggler score = best
  median compute-kernel time across ranks / this rank's median, over a window;
  flag below 0.75. NCCL kernels are excluded.
* :class:`MissingAtTimeout` (PyTorch Flight Recorder): when no collective
  completed for the watchdog timeout (600 s), report the ranks that never
  joined the newest collective.
* :class:`FixedThreshold` (MegaScale-style heat map): a rank whose compute
  time in an iteration exceeds a fixed 1.2 x the job-wide median is slow.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable

import numpy as np

from detectors.verdicts import verdict_id
from schemas.enums import Cause, CollOp, KernelKind, VerdictKind
from schemas.records import Collective, Kernel
from schemas.results import Verdict


def _verdict(
    job: str,
    name: str,
    kind: VerdictKind,
    cause: Cause,
    rank: int,
    node: str,
    onset_ns: int,
    detected_ns: int,
    summary: str,
) -> Verdict:
    return Verdict(
        job=job,
        verdict_id=verdict_id(job, f"{name}:{kind.value}", f"rank:{rank}", None),
        kind=kind,
        cause=cause,
        rank=rank,
        node=node,
        onset_ns=onset_ns,
        detected_ns=detected_ns,
        severity=0.0,
        confidence=0.5,
        summary=f"[{name}] {summary}",
    )


class _Baseline:
    name = "baseline"

    def __init__(self) -> None:
        self.found: dict[int, Verdict] = {}
        self.job = ""

    def _flag(
        self,
        kind: VerdictKind,
        cause: Cause,
        rank: int,
        node: str,
        onset_ns: int,
        detected_ns: int,
        summary: str,
    ) -> None:
        if rank not in self.found:
            self.found[rank] = _verdict(
                self.job, self.name, kind, cause, rank, node, onset_ns, detected_ns, summary
            )

    def run(self, records: Iterable[object]) -> list[Verdict]:
        for r in records:
            self.update(r)
        self.finish()
        return list(self.found.values())

    def update(self, rec: object) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> None:
        pass


class LatestArrival(_Baseline):
    """HTA: the last rank into each iteration's gradient-sync collective."""

    name = "hta"

    def __init__(self, window: int = 10, share: float = 0.5, warmup: int = 5) -> None:
        super().__init__()
        self.window, self.share, self.warmup = window, share, warmup
        self._by_seq: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
        self._last: deque[int] = deque(maxlen=window)
        self._sizes: dict[int, int] = {}
        self._seen = 0

    def update(self, rec: object) -> None:
        if (
            not isinstance(rec, Collective)
            or rec.op not in (CollOp.REDUCE_SCATTER, CollOp.ALL_REDUCE)
            or rec.comm_size < 2
        ):
            return
        self.job = rec.job
        key = (rec.comm_hash, rec.seq)
        group = self._by_seq[key]
        group.append((rec.arrival_ns, rec.rank, rec.node))
        if len(group) < rec.comm_size:
            return
        del self._by_seq[key]
        if rec.size_bytes < max(self._sizes.values(), default=0):
            return  # not the dominant collective
        self._sizes[rec.comm_hash] = rec.size_bytes
        a, rank, node = max(group)
        self._seen += 1
        self._last.append(rank)
        if self._seen > self.warmup and self._last.count(rank) >= self.share * self.window:
            self._flag(
                VerdictKind.SLOWDOWN,
                Cause.COMPUTE,
                rank,
                node,
                a,
                a,
                f"rank {rank} arrives last in most iterations",
            )


class KernelScore(_Baseline):
    """NVRx: best median compute-kernel time / this rank's median < 0.75."""

    name = "nvrx"

    def __init__(self, window: int = 200, threshold: float = 0.75) -> None:
        super().__init__()
        self.threshold = threshold
        self._k: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self._node: dict[int, str] = {}
        self._n = 0

    def update(self, rec: object) -> None:
        if not isinstance(rec, Kernel) or rec.kind != KernelKind.COMPUTE:
            return
        self.job = rec.job
        self._k[rec.rank].append(rec.end_ns - rec.start_ns)
        self._node[rec.rank] = rec.node
        self._n += 1
        if self._n % 2000:
            return
        med = {r: float(np.median(v)) for r, v in self._k.items() if len(v) >= 20}
        if len(med) < 2:
            return
        best = min(med.values())
        for r, m in med.items():
            if best / m < self.threshold:
                self._flag(
                    VerdictKind.SLOWDOWN,
                    Cause.COMPUTE,
                    r,
                    self._node[r],
                    rec.end_ns,
                    rec.end_ns,
                    f"rank {r} straggler score {best / m:.2f}",
                )


class MissingAtTimeout(_Baseline):
    """Flight Recorder: at the watchdog timeout, the ranks that never joined collective N."""

    name = "flight-recorder"

    def __init__(self, timeout_s: float = 600.0) -> None:
        super().__init__()
        self.timeout_ns = int(timeout_s * 1e9)
        self._last_done = 0
        self._open: dict[tuple[int, int, int], dict[int, str]] = {}
        self._members: dict[int, int] = {}

    def update(self, rec: object) -> None:
        if not isinstance(rec, Collective):
            return
        self.job = rec.job
        sender = rec.rank if rec.op == CollOp.SEND else (rec.peer if rec.op == CollOp.RECV else -1)
        key = (rec.comm_hash, sender if sender is not None else -1, rec.seq)
        if rec.end_ns is not None:
            self._last_done = max(self._last_done, rec.end_ns)
            return
        self._open.setdefault(key, {})[rec.rank] = rec.node
        self._members[rec.comm_hash] = 2 if rec.op.is_p2p else rec.comm_size

    def finish(self) -> None:
        if not self._open or not self._last_done:
            return
        fire = self._last_done + self.timeout_ns  # the dump happens at the watchdog timeout
        key = max(self._open, key=lambda k: k[2])
        joined = self._open[key]
        # FR reports the ranks missing from collective N; it cannot name them beyond "not these"
        rank = min(joined)
        self._flag(
            VerdictKind.HANG,
            Cause.UNKNOWN,
            rank,
            joined[rank],
            self._last_done,
            fire,
            f"{self._members.get(key[0], 0) - len(joined)} ranks never joined seq "
            f"{key[2]}; first waiting rank {rank}",
        )


class FixedThreshold(_Baseline):
    """MegaScale-style: per-iteration compute time over a fixed 1.2 x the job median."""

    name = "fixed-threshold"

    def __init__(self, factor: float = 1.2, warmup: int = 5) -> None:
        super().__init__()
        self.factor, self.warmup = factor, warmup
        self._cur: dict[int, float] = defaultdict(float)
        self._node: dict[int, str] = {}
        self._corr = -1
        self._steps = 0

    def update(self, rec: object) -> None:
        if (
            isinstance(rec, Collective)
            and rec.op in (CollOp.REDUCE_SCATTER, CollOp.ALL_REDUCE)
            and rec.end_ns is not None
            and rec.comm_size > 1
            and rec.rank == 0
        ):
            self._close(rec.end_ns)
        if not isinstance(rec, Kernel) or rec.kind != KernelKind.COMPUTE:
            return
        self.job = rec.job
        self._cur[rec.rank] += rec.end_ns - rec.start_ns
        self._node[rec.rank] = rec.node

    def _close(self, ts: int) -> None:
        self._steps += 1
        if self._cur and self._steps > self.warmup:
            med = float(np.median(list(self._cur.values())))
            for r, v in self._cur.items():
                if v > self.factor * med:
                    self._flag(
                        VerdictKind.SLOWDOWN,
                        Cause.COMPUTE,
                        r,
                        self._node[r],
                        ts,
                        ts,
                        f"rank {r} computes {v / med:.2f}x the job median",
                    )
        self._cur = defaultdict(float)


BASELINES: dict[str, type[_Baseline]] = {
    b.name: b for b in (LatestArrival, KernelScore, MissingAtTimeout, FixedThreshold)
}
