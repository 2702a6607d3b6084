"""Score verdicts against ground-truth labels (pure; used by ``megatrace eval``).

Matching: a verdict matches a label of the same kind detected at or after the
label's onset. A slowdown that costs less than ``required_cost`` of
throughput need not be found (a match still counts); a fault labelled off the
critical path (a pipeline bubble) must *not* be reported: a slowdown verdict
naming its rank is a false positive. A degraded link is measured directly and
is reported even when it costs no throughput (its label may say off the
critical path: a data-parallel edge whose transfer overlaps). A transient
straggler naming the culprit of an intermittent fault is its first burst. Unmatched
verdicts are false positives.

Recall is also kept by what the faults cost (:data:`COST_BANDS`): a one-step
straggler twice as slow as its step costs that step half its throughput, a mild
slowdown costs 5-10%, and a miss means something else in each.

>>> s = Score()
>>> _ = s.add_kind("hang")
>>> s.kinds["hang"].tp += 1
>>> round(s.kinds["hang"].f1, 2)
1.0
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.enums import Cause, VerdictKind
from schemas.results import FaultLabel, Verdict

#: the throughput a fault cost, in bands (lower bounds): recall is kept per band
COST_BANDS = (0.05, 0.1, 0.5)


def cost_band(cost: float) -> float:
    """The band of a fault that cost ``cost`` of the throughput: its lower bound.

    >>> cost_band(0.07), cost_band(0.5), cost_band(1.0), band_name(0.05), band_name(0.5)
    (0.05, 0.5, 0.5, '5-10%', '50%+')
    """
    return max((b for b in COST_BANDS if cost >= b), default=0.0)


def band_name(low: float) -> str:
    higher = [b for b in COST_BANDS if b > low]
    return f"{low:.0%}+" if not higher else f"{low * 100:.0f}-{higher[0]:.0%}"


@dataclass
class KindScore:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    culprit_ok: int = 0
    latency_s: list[float] = field(default_factory=list)
    latency_steps: list[float] = field(default_factory=list)
    #: cost band (its lower bound) -> [found, required]: the faults that had to be found
    by_cost: dict[float, list[int]] = field(default_factory=dict)

    def count(self, cost: float, found: bool) -> None:
        band = self.by_cost.setdefault(cost_band(cost), [0, 0])
        band[0] += found
        band[1] += 1

    def add(self, other: KindScore) -> None:
        """Another set of runs' counts, added to these."""
        self.tp += other.tp
        self.fp += other.fp
        self.fn += other.fn
        self.culprit_ok += other.culprit_ok
        self.latency_s += other.latency_s
        self.latency_steps += other.latency_steps
        for band, (found, n) in other.by_cost.items():
            mine = self.by_cost.setdefault(band, [0, 0])
            mine[0] += found
            mine[1] += n

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def culprit_accuracy(self) -> float:
        return self.culprit_ok / self.tp if self.tp else 0.0


@dataclass
class Score:
    kinds: dict[str, KindScore] = field(default_factory=dict)
    healthy_steps: int = 0
    healthy_alarms: int = 0

    def add_kind(self, kind: str) -> KindScore:
        return self.kinds.setdefault(kind, KindScore())

    def add(self, other: Score) -> None:
        """Another score's runs, added to this one's (several folders of recordings)."""
        for kind, k in other.kinds.items():
            self.add_kind(kind).add(k)
        self.healthy_steps += other.healthy_steps
        self.healthy_alarms += other.healthy_alarms

    def add_run(
        self,
        labels: Sequence[FaultLabel],
        verdicts: Sequence[Verdict],
        steps: int,
        step_ns: float,
        required_cost: float = 0.05,
    ) -> None:
        latest: dict[str, Verdict] = {}
        for v in verdicts:
            latest[v.verdict_id] = v
        vs = list(latest.values())
        if not labels:
            self.healthy_steps += steps
            self.healthy_alarms += len(vs)
            for v in vs:
                self.add_kind(v.kind.value).fp += 1
            return
        used: set[str] = set()
        served: dict[str, set[int]] = {}  # a verdict's ranks matched to a label each
        for lab in labels:
            ks = self.add_kind(lab.kind.value)
            if not lab.on_critical_path and lab.kind != VerdictKind.LINK_DEGRADATION:
                bad = [v for v in vs if v.kind == VerdictKind.SLOWDOWN and v.rank == lab.rank]
                for v in bad:
                    ks.fp += 1
                    used.add(v.verdict_id)
                continue
            match = [
                v
                for v in vs
                if v.kind == lab.kind
                and (v.verdict_id not in used or _names_too(v, lab, served))
                and v.detected_ns >= lab.onset_ns
            ]
            match.sort(key=lambda v: (not _culprit_ok(lab, v), v.detected_ns))
            required = lab.throughput_cost >= required_cost or lab.kind == VerdictKind.HANG
            cost = 1.0 if lab.kind == VerdictKind.HANG else lab.throughput_cost
            if not match:
                if required:
                    ks.fn += 1
                    ks.count(cost, False)
                continue
            v = match[0]
            used.add(v.verdict_id)
            if lab.rank is not None:
                served.setdefault(v.verdict_id, set()).add(lab.rank)
            if required:
                ks.count(cost, True)
            ks.tp += 1
            ks.culprit_ok += _culprit_ok(lab, v)
            lat = (v.detected_ns - lab.onset_ns) / 1e9
            ks.latency_s.append(lat)
            ks.latency_steps.append(lat * 1e9 / step_ns if step_ns else 0.0)
        # a straggler's first burst is told as a transient one before it recurs: part of
        # the intermittent fault it begins, not a false alarm
        for lab in labels:
            if lab.kind is VerdictKind.INTERMITTENT_SLOWDOWN:
                used.update(
                    v.verdict_id
                    for v in vs
                    if v.kind is VerdictKind.TRANSIENT_STRAGGLER
                    and v.detected_ns >= lab.onset_ns
                    and _culprit_ok(lab, v)
                )
        for v in vs:
            if v.verdict_id not in used:
                self.add_kind(v.kind.value).fp += 1

    def table(self) -> list[str]:
        head = (
            f"{'kind':<22} {'TP':>4} {'FP':>4} {'FN':>4} {'prec':>6} {'recall':>6} "
            f"{'F1':>5} {'culprit':>7} {'lat p50':>8} {'lat p95':>8} {'steps p50':>9}"
        )
        rows = [head, "-" * len(head)]
        for kind, k in sorted(self.kinds.items()):
            p50 = np.median(k.latency_s) if k.latency_s else float("nan")
            p95 = np.percentile(k.latency_s, 95) if k.latency_s else float("nan")
            s50 = np.median(k.latency_steps) if k.latency_steps else float("nan")
            rows.append(
                f"{kind:<22} {k.tp:>4} {k.fp:>4} {k.fn:>4} {k.precision:>6.2f} "
                f"{k.recall:>6.2f} {k.f1:>5.2f} {k.culprit_accuracy:>7.0%} "
                f"{_secs(p50):>8} {_secs(p95):>8} {_num(s50):>9}"
            )
        bands = [
            f"  {kind}: "
            + ", ".join(
                f"{band_name(b)} {found} of {n}" for b, (found, n) in sorted(k.by_cost.items())
            )
            for kind, k in sorted(self.kinds.items())
            if k.by_cost and kind != VerdictKind.HANG.value
        ]
        if bands:
            rows += ["found, by the throughput the fault cost:", *bands]
        per10k = self.healthy_alarms / self.healthy_steps * 1e4 if self.healthy_steps else 0.0
        rows.append(
            f"false alarms per 10,000 healthy steps: {per10k:.1f} "
            f"({self.healthy_alarms} over {self.healthy_steps} steps)"
        )
        return rows


def _secs(x: float) -> str:
    return "-" if np.isnan(x) else f"{x:.2f}s"


def _num(x: float) -> str:
    return "-" if np.isnan(x) else f"{x:.1f}"


def _names_too(v: Verdict, lab: FaultLabel, served: dict[str, set[int]]) -> bool:
    """Whether ``v``, matched to another label already, also names ``lab``'s rank among
    its several culprits, not matched yet: one incident for ranks faulted together (one
    alert) finds each of them."""
    return (
        lab.rank is not None
        and lab.rank in v.culprit_ranks
        and lab.rank not in served.get(v.verdict_id, set())
    )


def _culprit_ok(lab: FaultLabel, v: Verdict) -> bool:
    if lab.kind == VerdictKind.HANG and v.cause != lab.cause:
        return False  # a hang's culprit includes what stopped: the GPU or the network
    if lab.link is not None:
        return v.link == lab.link
    if lab.cause is Cause.NETWORK_LINK and v.link:  # the node whose link it is (degraded
        # or failed: a hang in the network)
        return lab.node == v.node or lab.node in _link_nodes(v.link)
    if lab.rank is not None:  # named alone, or among the several the verdict names
        return v.rank == lab.rank or lab.rank in v.culprit_ranks
    return v.node == lab.node


def _link_nodes(link: str) -> set[str]:
    """The nodes at the ends of a verdict's link: a NIC's (``node/nic->node/nic``) or the
    network between nodes (``node<->node``).

    >>> sorted(_link_nodes("n0/mlx5_0->n1/mlx5_0")), sorted(_link_nodes("n0<->n1"))
    (['n0', 'n1'], ['n0', 'n1'])
    """
    return {end.split("/")[0] for end in re.split(r"<->|->", link)}
