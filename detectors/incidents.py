"""Step-time incidents: who one is about, what a verdict says of it, and what it costs.

A :class:`Culprit` names whom an incident is about (a rank, a host, the network
between nodes, one link, or nobody localised: the job); its :attr:`Culprit.key` is
the string the verdict book files it under, so a verdict's id is the same however
the incident was found. An :class:`Incident` is a culprit with its cause and where it
sits (the verdict's fields). The :class:`StepTimeLedger` keeps the job's recent steps
and, for every open step-time incident (slowdowns and degraded links alike), when it
began and the step time before it: an incident is charged only what it added.

>>> from detectors.changepoint import ShiftDetector
>>> ledger = StepTimeLedger(ShiftDetector(warmup=3))
>>> ledger.shift.baseline = 100.0  # a 100 ns step, learnt
>>> ledger.open(Culprit.rank(5), step=10, onset_ns=0)
>>> ledger.open(Culprit.link(2, 3), step=10, onset_ns=0)
>>> round(ledger.share(Culprit.rank(5), 150.0), 3)  # two incidents at one level share it
0.167
>>> Culprit.network("n0<->n1").key, Culprit.parse("rank:5") == Culprit.rank(5)
('nodes:n0<->n1', True)

One whose evidence explains at most a tenth of the step (a rank starved of CPU for a
tenth of the time) leaves the rest to the other:

>>> ledger.cap(Culprit.rank(5), 0.1)
>>> [round(ledger.share(c, 150.0), 3) for c in (Culprit.rank(5), Culprit.link(2, 3))]
[0.1, 0.233]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from detectors import texts
from detectors.changepoint import ShiftDetector
from detectors.steps import StepReport
from schemas.enums import Cause, Phase, VerdictKind


@dataclass(frozen=True)
class Culprit:
    """Whom an incident is about: ``kind`` is rank, node (a host), nodes (the network
    between them), link (one directed link, or the NIC it leaves) or job (nobody
    localised), ``name`` who within that kind."""

    kind: str
    name: str = ""

    KINDS: ClassVar[tuple[str, ...]] = ("rank", "node", "nodes", "link", "job")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"culprit kind {self.kind!r} is not one of {', '.join(self.KINDS)}")

    @classmethod
    def rank(cls, rank: int) -> Culprit:
        return cls("rank", str(rank))

    @classmethod
    def node(cls, node: str) -> Culprit:
        return cls("node", node)

    @classmethod
    def network(cls, link: str) -> Culprit:
        """The network between nodes (``"a<->b"``) or one node's links (``"a"``)."""
        return cls("nodes", link)

    @classmethod
    def link(cls, src_rank: int, dst_rank: int) -> Culprit:
        return cls("link", f"{src_rank}->{dst_rank}")

    @classmethod
    def parse(cls, key: str) -> Culprit:
        """The culprit filed under ``key`` (the inverse of :attr:`key`)."""
        kind, _, name = key.partition(":")
        return cls(kind, name)

    @property
    def key(self) -> str:
        """The verdict book's key (and part of the verdict's stable id)."""
        return self.kind if self.kind == "job" else f"{self.kind}:{self.name}"

    @property
    def verdict_kind(self) -> VerdictKind:
        """A step-time incident's kind by its culprit: the network between nodes (or a
        link) degraded, anyone else slowed down."""
        if self.kind in ("nodes", "link"):
            return VerdictKind.LINK_DEGRADATION
        return VerdictKind.SLOWDOWN

    @property
    def localised(self) -> bool:
        return self.kind != "job"


JOB = Culprit("job")

#: the evidence of an incident capped at the share of the step its evidence explains
#: (:meth:`StepTimeLedger.cap`)
EXPLAINED = "step_share_explained"


@dataclass
class Incident:
    """A culprit, its cause and where it sits: what its verdicts say of it."""

    culprit: Culprit
    cause: Cause
    rank: int | None = None
    gpu: int | None = None
    node: str | None = None
    link: str | None = None
    src_rank: int | None = None
    dst_rank: int | None = None
    pp_stage: int | None = None
    microbatch: int | None = None
    phase: Phase | None = None
    evidence: dict[str, float] = field(default_factory=dict)
    #: every culprit of an incident with several (``rank`` is the first); () for one
    ranks: tuple[int, ...] = ()

    _WHERE: ClassVar[tuple[str, ...]] = ("rank", "gpu", "node", "link", "src_rank", "dst_rank",
                                         "pp_stage", "microbatch", "phase")  # fmt: skip

    @property
    def named(self) -> tuple[int, ...]:
        """The ranks it names: its ranks, else its rank (none for a host or the network)."""
        return self.ranks or (() if self.rank is None else (self.rank,))

    @property
    def who(self) -> str:
        """Whom it is about, in words."""
        c = self.culprit
        if len(self.ranks) > 1:
            return "ranks " + texts.listed(list(self.ranks))
        if self.rank is not None:
            return texts.who(self.rank, self.gpu, self.node)
        if c.kind == "nodes":
            return texts.network(c.name)
        return f"host {self.node}" if c.kind == "node" else "an unlocalised part of the job"

    def fields(self, evidence: bool = True) -> dict[str, Any]:
        """The verdict's fields (:class:`~schemas.results.Verdict`): where it sits (nothing
        for an unlocalised one), and its ``evidence`` unless told not to."""
        out = {k: getattr(self, k) for k in self._WHERE} if self.culprit.localised else {}
        if len(self.ranks) > 1:
            out["culprit_ranks"] = list(self.ranks)
        if evidence:
            out["evidence"] = dict(self.evidence)
        return out


class StepTimeLedger:
    """The job's recent steps, and the open step-time incidents' onsets and shares.

    Parameters
    ----------
    shift
        The job's step-time change-point detector (its baseline is the healthy step).
    min_shift
        A level this far over the baseline counts as slow already (an incident on top
        of an earlier one is charged only what it added).
    keep
        Recent steps kept.
    """

    def __init__(self, shift: ShiftDetector, min_shift: float = 0.1, keep: int = 16) -> None:
        self.shift = shift
        self.min_shift = min_shift
        self.keep = keep
        self._reset()

    def _reset(self) -> None:
        self.recent: deque[StepReport] = deque(maxlen=self.keep)
        # open incident -> its onset step once a step reached it (None before) and its
        # onset time (ns); and the step time before it (ns), once known
        self.onset_at: dict[Culprit, tuple[int | None, int]] = {}
        self.onset_level: dict[Culprit, float] = {}
        # open incident -> the most of a step its evidence explains (a fraction of it)
        self.caps: dict[Culprit, float] = {}

    @property
    def baseline(self) -> float:
        return self.shift.baseline or 0.0

    def since(self, onset: int) -> list[StepReport]:
        return [r for r in self.recent if r.step >= onset]

    def open(self, culprit: Culprit, step: int | None, onset_ns: int) -> None:
        """An incident began at ``step`` (None: no step reached it yet) or ``onset_ns``;
        an open one keeps its onset."""
        self.onset_at.setdefault(culprit, (step, onset_ns))

    def begin(self, culprit: Culprit, step: int, onset_ns: int) -> None:
        """An incident begins at ``step`` (``onset_ns``), replacing any onset kept for it."""
        self.onset_at[culprit] = (step, onset_ns)

    def onset_step(self, culprit: Culprit) -> int | None:
        at = self.onset_at.get(culprit)
        return at[0] if at else None

    def onset_ns(self, culprit: Culprit) -> int:
        return self.onset_at[culprit][1]

    def cap(self, culprit: Culprit, fraction: float) -> None:
        """Open incident ``culprit`` costs at most ``fraction`` of a step: what its evidence
        explains. What it cannot take goes to the incidents that began at its level."""
        self._caps()[culprit] = fraction

    def caps_of(self, culprit: Culprit) -> float | None:
        """The most of a step open incident ``culprit`` costs (None: not capped)."""
        return self._caps().get(culprit)

    def rename(self, culprit: Culprit, to: Culprit) -> None:
        """Open incident ``culprit`` is ``to``'s from now on (its onset, level and cap
        kept)."""
        for kept in (self.onset_at, self.onset_level, self._caps()):
            if culprit in kept:
                kept[to] = kept.pop(culprit)  # type: ignore[index]

    def forget(self, culprit: Culprit) -> None:
        self.onset_at.pop(culprit, None)
        self.onset_level.pop(culprit, None)
        self._caps().pop(culprit, None)

    def _caps(self) -> dict[Culprit, float]:
        if getattr(self, "caps", None) is None:  # pickled before it had them
            self.caps = {}
        return self.caps

    def level_before(self, reps: list[StepReport]) -> float:
        """The step time a slowdown starting at ``reps[0]`` adds to."""
        return self.level_before_step(reps[0].step) if reps else self.baseline

    def level_before_step(self, onset: int, steps: int = 3, of: Culprit | None = None) -> float:
        """The step time an incident beginning at step ``onset`` (of culprit ``of``) adds
        to: the baseline, or the level of the steps just before it when those were slow
        already under another open incident (a shift on top of an earlier one, e.g. a
        degraded link: a culprit explains only what it added). Their median: one
        straggling step among them is not a level; and with no other incident open, slow
        steps before it were a burst, not a level."""
        base = self.baseline
        if not any(c != of for c in self.onset_at):
            return base
        before = [
            r.duration_ns for r in self.recent if r.complete and onset - steps <= r.step < onset
        ]
        level = float(np.median(before)) if before else base
        return level if level > base * (1 + self.min_shift) else base

    def level(self, culprit: Culprit) -> float:
        """The step time open incident ``culprit`` adds to (the baseline until known)."""
        return self._level(culprit) or self.baseline

    def level_now(self, culprits: list[Culprit]) -> float:
        """The step time now: the mean of the complete steps kept since the newest of open
        incidents ``culprits`` began (the steps before it ran at the level it added to).
        Throughput is steps over time, so a CPU quota that lets fast steps through between
        slow ones costs their mean; a median, or any one step, flaps between its cost and
        nothing as the fast ones come and go."""
        onsets = [at[0] for c in culprits if (at := self.onset_at.get(c)) and at[0] is not None]
        return self.mean_since(max(onsets, default=0)) or float(self.recent[-1].duration_ns)

    def ratio_since(self, onset: int) -> float | None:
        """:meth:`mean_since` over the baseline; None: no step kept, or no baseline yet."""
        mean, base = self.mean_since(onset), self.baseline
        return mean / base if mean is not None and base else None

    def mean_since(self, onset: int) -> float | None:
        """The mean time of the complete steps kept since step ``onset`` (None: none)."""
        durations = [r.duration_ns for r in self.recent if r.complete and r.step >= onset]
        return float(np.mean(durations)) if durations else None

    def step_reaching(self, ts_ns: int) -> int | None:
        """The first step seen that ended at or after ``ts_ns`` (None: none yet)."""
        return next((r.step for r in self.recent if r.end_ns >= ts_ns), None)

    def share(self, culprit: Culprit, duration: float) -> float:
        """The fraction of a step of ``duration`` ns that open incident ``culprit`` costs:
        the step time it added, from the level before it to the level before the next
        incident (or ``duration``). Incidents that began at one level share what was
        added, equally but for those capped (:meth:`cap`), whose remainder the others
        take; the shares of all open incidents sum to ``1 - baseline / duration``."""
        base = self.shift.baseline
        if duration <= 0 or not base:
            return 0.0
        own = self._level(culprit) or base
        levels = {c: self._level(c) or base for c in self.onset_at}
        top = min([lv for lv in levels.values() if lv > own] + [duration])
        added = max(0.0, top - own) / duration
        tied = [c for c, lv in levels.items() if lv == own] or [culprit]
        caps = self._caps()
        even = added / len(tied)
        free = [c for c in tied if c not in caps]
        if culprit in caps or not free:
            return min(even, caps.get(culprit, even))
        return (added - sum(min(even, caps[c]) for c in tied if c in caps)) / len(free)

    def _level(self, culprit: Culprit) -> float | None:
        """The step time before incident ``culprit`` began (None: not known yet).

        Final once a step reached its onset and the baseline is known: the steps before
        it are then all assembled, however late the incident itself was seen (a link's
        samples may be read before or after the steps around its onset)."""
        level = self.onset_level.get(culprit)
        at = self.onset_at.get(culprit)
        if level is not None or at is None or not self.shift.baseline:
            return level
        step, onset_ns = at
        if step is None:
            step = self.step_reaching(onset_ns)
            if step is None:  # no step reached its onset yet: the level so far
                nxt = self.recent[-1].step + 1 if self.recent else None
                return self.level_before_step(nxt, of=culprit) if nxt is not None else None
            self.onset_at[culprit] = (step, onset_ns)
        level = self.onset_level[culprit] = self.level_before_step(step, of=culprit)
        return level


__all__ = ["EXPLAINED", "JOB", "Culprit", "Incident", "StepTimeLedger"]
