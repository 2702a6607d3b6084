"""Stragglers over already: a burst of slow steps is a transient straggler (culprit,
steps, time lost); the same culprit bursting again is intermittent.

A burst counts well clear of the job's noise (twice the change-point detector's bar),
or where its rank, the last to arrive, made the others wait a good share of its steps
longer than it used to: no noise does that, and the floor alone is its bar.

A burst that cost the job less than ``transient_min_lost_ms`` is none: a rank the host's
scheduler kept waiting for a few of its time slices loses tens of milliseconds, and in a
job of 20 ms steps that is a step 2-3x slower, as often as every few hundred steps on a
busy host; a straggler worth a verdict costs more (a GPU twice as slow for one step
costs its step, 0.1 s or more in training). Unless the kernel counted why: a burst a
CPU quota made is that quota's straggler, whatever it cost (:mod:`detectors.quota_bursts`),
and so is a step whose timings name nobody (its transfers took longer, nobody came late:
on CPU collectives a busy host as much as a network), or a lone slow step within the
job's noise, where the kernel counted a quota that held a rank back then and let it go.

A burst the job spent saving a checkpoint is none either: a rank saving for at least half
the time the burst lost (:class:`~detectors.saves.Saves`, where the heartbeats carry the
saves) held the others up at their next collective, as the job was written to.

A burst is judged once as many steps as confirm a shift have followed it: slow steps
that come back within them and stay are the first of a slowdown (a CPU quota lets a
fast step through now and then), reported as that slowdown alone; another burst within
them, of the same culprit, its host or one of its host's ranks (or none named), is the
same episode, judged as one once the steps after it passed. While a straggler's stalls
recur (its intermittent slowdown open), a slower stretch of the job's steps that names
its rank, its tensor-parallel peer or its host is those stalls again: its verdict
carries it, and no slowdown is opened beside it.

:class:`Stragglers` is the part of :class:`~detectors.slowdown_tracker.SlowdownTracker`
that judges the change-point detector's bursts; it uses the tracker's verdict book,
ledger and localisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

from detectors import texts
from detectors.changepoint import SPIKE_OVER_REST
from detectors.episodes import episode, one_culprit
from detectors.incidents import Culprit, Incident, StepTimeLedger
from detectors.quota_bursts import QuotaBursts
from detectors.recurrence import Recurrence
from detectors.steps import StepReport
from detectors.topology import Topology
from detectors.verdicts import VerdictBook
from schemas.enums import VerdictKind

#: a burst waiting to be reported: (onset, ratio, length, the step it is reported at,
#: its incident (None: no rank or host named, held for a CPU quota's count only), and
#: the change-point detector's bar when it ended)
HeldBurst = tuple[int, float, int, int, Incident | None, float]

if TYPE_CHECKING:
    from detectors.changepoint import ShiftDetector
    from detectors.saves import Saves
    from detectors.slowdown import SlowdownLocalizer


class Stragglers(QuotaBursts, Recurrence):
    """Bursts of slow steps, judged with the tracker's verdict book, ledger, change-point
    detector and localisation (the attributes below)."""

    book: VerdictBook
    ledger: StepTimeLedger
    bursts: dict[Culprit, list[tuple[int, float, int]]]
    transient_floor: float
    held_share: float
    #: for a tracker pickled before it had it
    transient_min_lost_ms: float = 50.0
    saves: Saves | None = None

    shift: ShiftDetector
    localizer: SlowdownLocalizer
    #: each culprit's bursts as last named (a later burst naming one of its ranks goes
    #: on from them; None: one pickled before)
    _burst_named: dict[Culprit, Incident] | None = None
    #: the burst waiting to be reported, if any
    _held: HeldBurst | None = None

    def _hold_burst(
        self, onset: int, ratio: float, length: int, rep: StepReport, topo: Topology
    ) -> list[msgspec.Struct]:
        """A burst that ended at step ``rep``, localised now: reported once the steps that
        would confirm a shift followed (an earlier one held is reported now). A burst is
        a straggler's only with a rank or host named (transfers that took longer for a
        step are as often a busy host's collectives as its network's), or where the CPU
        counters that cover it name a quota that held a rank back then and let it go
        since."""
        # the burst and the step after it (where its waits may spill): for a burst that
        # just ended, every step since its onset; for a spike that opened a shift, not
        # the shift's steps that followed
        inc = self.locate([r for r in self.ledger.since(onset) if r.step <= onset + length], topo)
        if inc is not None and inc.rank is None and inc.culprit.kind != "node":
            inc = None
        held, due = self._held, rep.step + self.shift.persistence
        if (
            held is not None
            and rep.step <= held[3]
            and (inc is None or (held[4] is not None and one_culprit(inc, held[4])))
        ):
            # another burst before the held one was due, of its culprit (or its host's,
            # or one of its host's ranks) or of none named: one episode (a CPU quota lets
            # a fast step through), held as one
            first, top, _, _, found, bar = held
            self._held = (first, max(top, ratio), onset + length - first, due, found, bar)
            return []
        out = self._release_burst(rep, topo)
        if inc is not None or (self.cpu is not None and not self.cpu.empty):
            # one that names nobody may still be a CPU quota's, once its counters came
            self._held = (onset, ratio, length, due, inc, self.shift.bar)
        return out

    def _hold_lone(
        self, onset: int, ratio: float, rep: StepReport, topo: Topology
    ) -> list[msgspec.Struct]:
        """A lone slow step within the job's noise (the job's own, its timings name
        nobody), held as a burst that names nobody: a CPU quota's straggler if the
        counters that cover it name one that held a rank back then and let it go. Not
        while a burst is held, which is judged as it would be without it, unless that
        one is a lone step too over which the counters show no quota (two lone steps
        are no episode: each is within the noise)."""
        if self.cpu is None or self.cpu.empty:
            return []
        if self._held is not None and (
            self._held[4] is not None or not self._no_quota_over(self._held[0], self._held[2])
        ):
            return []
        out = self._release_burst(rep, topo)
        self._held = (onset, ratio, 1, rep.step + self.shift.persistence, None, self.shift.bar)
        return out

    def _release_burst(
        self, rep: StepReport, topo: Topology, now: bool = True
    ) -> list[msgspec.Struct]:
        """The burst held, reported as of step ``rep`` if its time came (or ``now``): once
        as many steps as confirm a shift followed it, and the job came back to its level
        (at most as many again: steps slow still after a burst may be the first of a
        slowdown, in a job whose noise hides them a while)."""
        held = self._held
        if held is None or (not now and rep.step < held[3]):
            return []
        if not now and rep.step < held[3] + self.shift.persistence and self._still_slow(held):
            return []
        if not now and self._cpu_pending(held[0], held[2], rep):
            return []
        self._held = None
        return self._burst(held, rep, topo)

    def _still_slow(self, held: HeldBurst) -> bool:
        """Whether the steps since the held burst ended are slow still: their mean over
        the level before it not yet back within half the bar a shift must clear (as the
        change-point detector tells a recovery)."""
        onset, _, length, _, _, bar = held
        after = [r.duration_ns for r in self.ledger.since(onset + length) if r.complete]
        level = self.ledger.level_before_step(onset)
        return bool(after) and level > 0 and float(np.mean(after)) >= level * (1.0 + bar / 2)

    def _burst_before_shift(
        self, onset: int, ratio: float, rep: StepReport, topo: Topology
    ) -> tuple[int, list[msgspec.Struct]]:
        """A shift of ``ratio`` since step ``onset`` confirmed while a burst is held: the
        burst was its first steps (the shift's onset is the burst's), unless it towers
        over it as the change-point detector's spikes do (a straggler, then a smaller
        change), and is told on its own."""
        held = self._held
        if held is None:
            return onset, []
        if held[4] is None:  # nobody named: not the shift's first steps, but a quota's?
            return onset, self._release_burst(rep, topo)
        if held[1] - 1.0 >= SPIKE_OVER_REST * max(ratio - 1.0, 0.0):
            return onset, self._release_burst(rep, topo)
        self._held = None
        return min(onset, held[0]), []

    def _burst(self, held: HeldBurst, rep: StepReport, topo: Topology) -> list[msgspec.Struct]:
        """A burst (``held``: its onset, ratio, length, due step, incident ``inc`` and the
        bar when it ended): a transient straggler, or intermittent if it came before.
        Its steps are judged by their own times against the level before them (what is
        reported; the detector's ratio is clipped, and over a noisy job's baseline).
        Only one well clear of the noise (twice ``bar``, as a lone slow value must be)
        counts: a step a few percent slow, explained or not, repeats no straggler; unless
        its rank held the others up, as the last to arrive, for ``held_share`` of those
        steps more than it used to: the noise is no explanation for that (as for the
        change-point detector's explained steps), and the floor alone is its bar."""
        onset, ratio, length, _, inc, bar = held
        reps, level, measured = self._over_level(onset, onset + length)
        ratio = measured or ratio
        quota = self._quota_held(reps, rep, topo, proven=inc is None)
        if quota is not None:
            inc = quota
        if inc is None:  # nobody named, and no quota's count names anyone
            return []
        if quota is not None or self._held_others_up(inc, reps):
            bar = 0.0
        if ratio < 1.0 + 2 * bar:
            return []
        lost = _lost(reps, level)
        if quota is None and lost < self.transient_min_lost_ms * 1e6:
            return []  # a few of the host scheduler's time slices: no straggler's cost
        if self._saving(reps or [rep], lost):
            return []
        episode = self._episode(inc, topo)
        bursts = self.bursts.setdefault(episode.culprit, [])
        bursts.append((onset, ratio, length))
        if self._recurs(episode, bursts, rep):
            self._burst_named[episode.culprit] = episode
            return self._intermittent(episode, bursts, rep)
        if episode.culprit != inc.culprit:  # the earlier bursts were told already: this
            self.bursts[inc.culprit] = [bursts.pop()]  # one begins its own culprit's
            del self.bursts[episode.culprit]
        self._burst_named[inc.culprit] = inc
        return self._transient(inc, onset, ratio, length, rep, bar, reps, level)

    def _saving(self, reps: list[StepReport], lost: float) -> bool:
        """Whether a rank of the job saved a checkpoint for half the time ``lost`` or more
        around the steps ``reps``: the job's own pause, not a straggler."""
        saves = self.saves
        return saves is not None and saves.most(reps[0].start_ns, reps[-1].end_ns) >= lost / 2

    def _episode(self, inc: Incident, topo: Topology) -> Incident:
        """The bursts ``inc``'s burst goes on from (:func:`~detectors.episodes.episode`)."""
        if self._burst_named is None:
            self._burst_named = {}
        return episode(inc, self._burst_named, self.bursts, topo)

    def _short_episode(self, calm: int, rep: StepReport) -> list[msgspec.Struct]:
        """The job recovered from its open slowdowns, calm since step ``calm``. Where that
        came as soon as a shift can be told from a burst (its slow steps fewer than twice
        those that confirm a shift: over within as many again), its slowdowns of a rank
        or a host were a straggler for a few steps. Each is told again as a transient
        straggler with its steps and the time they lost (the same verdict, resolved: one
        alert, whose record says what it was) and is its culprit's burst (another makes
        it intermittent). One under a straggler's bar (:meth:`_transient`'s) stays a
        slowdown, resolved."""
        onsets = [s for c in self.open if (s := self.ledger.onset_step(c)) is not None]
        onset = min(onsets, default=calm)
        if calm - onset >= 2 * self.shift.persistence:
            return []
        reps, level, ratio = self._over_level(onset, calm)
        if ratio is None or ratio < self._straggler_bar(self.shift.bar):
            return []
        out: list[msgspec.Struct] = []
        for culprit in [c for c in self.open if c.kind in ("rank", "node")]:
            kind = culprit.verdict_kind.value
            if (v := self.book.current(kind, culprit.key)) is None:
                continue
            inc = Incident(culprit, v.cause, rank=v.rank, gpu=v.gpu, node=v.node,
                           pp_stage=v.pp_stage, evidence=dict(v.evidence),
                           ranks=tuple(v.culprit_ranks))  # fmt: skip
            summary = self._told(inc, onset, calm - onset, ratio, reps, level)
            if told := self.book.retell(
                kind, culprit.key, VerdictKind.TRANSIENT_STRAGGLER, reps[-1].end_ns,
                severity=1.0 - 1.0 / ratio, summary=summary, evidence=inc.evidence,
            ):  # fmt: skip
                out.append(told)
            bursts = self.bursts.setdefault(culprit, [])
            bursts.append((onset, ratio, calm - onset))
            if self._recurs(inc, bursts, rep):
                out += self._intermittent(inc, bursts, rep)
        return out

    def _over_level(self, onset: int, end: int) -> tuple[list[StepReport], float, float | None]:
        """The complete steps kept from ``onset`` to ``end`` (excluded), the step time
        before them, and their mean time over it (None: no step, or no level)."""
        reps = [r for r in self.ledger.recent if onset <= r.step < end and r.complete]
        level = self.ledger.level_before_step(onset)
        mean = float(np.mean([r.duration_ns for r in reps])) if reps else 0.0
        return reps, level, mean / level if reps and level > 0 else None

    def _straggler_bar(self, bar: float) -> float:
        """The step ratio a straggler's steps must reach: the floor, and twice the bar a
        shift must clear (``bar``)."""
        return 1.0 + max(self.transient_floor, 2 * bar)

    def _held_others_up(self, inc: Incident, reps: list[StepReport]) -> bool:
        """Whether ``inc``'s rank made the others wait longer than it used to, as the last
        to arrive, by ``held_share`` of the steps ``reps`` or more."""
        grew = self.localizer.blame_grew(reps) if inc.rank is not None else None
        if grew is None or inc.rank >= len(grew):
            return False
        return bool(grew[inc.rank] >= self.held_share * np.mean([r.duration_ns for r in reps]))

    @staticmethod
    def _told(
        inc: Incident, onset: int, length: int, ratio: float, reps: list[StepReport], level: float
    ) -> str:
        """A straggler's steps ``reps`` from ``onset``, ``ratio`` times ``level``: the time
        they lost and their level in ``inc``'s evidence, and its summary."""
        lost = _lost(reps, level)
        inc.evidence = {
            **inc.evidence,
            "time_lost_ns": float(lost),
            "steps": float(length),
            "step_time_ratio": float(ratio),
            "baseline_step_ns": float(level),
        }
        return texts.transient_summary(
            who=inc.who, onset=onset, length=length, ratio=ratio, lost_ns=lost
        )

    def _transient(
        self,
        inc: Incident,
        onset: int,
        ratio: float,
        length: int,
        rep: StepReport,
        bar: float,
        reps: list[StepReport],
        level: float,
    ) -> list[msgspec.Struct]:
        """A straggler for a step or a few, over already: reported with its culprit and the
        time it cost, and resolved at once (a second one makes it intermittent). Only one
        that stands out: a rank or host named, and well over the noise (``bar``: the
        change-point detector's when it ended)."""
        if ratio < self._straggler_bar(bar):
            return []
        summary = self._told(inc, onset, length, ratio, reps, level)
        start = reps[0].start_ns if reps else rep.start_ns
        end = reps[-1].end_ns if reps else rep.end_ns
        kind, key = VerdictKind.TRANSIENT_STRAGGLER, inc.culprit.key
        v = self.book.report(
            kind,
            inc.cause,
            key,
            onset_step=onset,
            onset_ns=start,
            detected_ns=rep.end_ns,
            severity=1.0 - 1.0 / ratio if ratio > 1 else 0.0,
            confidence=0.8,
            step=onset,
            summary=summary,
            **inc.fields(),
        )
        done = self.book.resolve(kind.value, key, end)
        return [x for x in (v, done) if x is not None]

    def _stalls_again(self, inc: Incident, topo: Topology) -> bool:
        """Whether a shift localised to ``inc`` is a straggler's recurring stalls: an
        intermittent slowdown is open whose bursts named its rank, its tensor-parallel
        peer or its host (:func:`~detectors.episodes.episode`). Stalls that come every few
        steps make a slower stretch of the job's steps, which names the stalled rank or
        one it held up with it: no new fault."""
        if inc.rank is None and inc.culprit.kind != "node":
            return False
        ep = episode(inc, self._burst_named or {}, self.bursts, topo)
        if ep is inc:
            return False
        key = ep.culprit.key
        return self.book.current(VerdictKind.INTERMITTENT_SLOWDOWN.value, key) is not None


def _lost(reps: list[StepReport], level: float) -> float:
    """The time steps ``reps`` took beyond ``level`` (ns)."""
    return sum(max(0.0, r.duration_ns - level) for r in reps)


__all__ = ["Stragglers"]
