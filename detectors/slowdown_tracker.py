"""A job's step-time incidents: slowdowns, and stragglers (:mod:`detectors.stragglers`).

Every closed step's time goes to the change-point detector
(:class:`~detectors.changepoint.ShiftDetector`). A confirmed shift is localised
(:class:`~detectors.slowdown.SlowdownLocalizer`: the critical path where a pipeline is
known, then who made the others wait, then the transfers between nodes) once the
links' samples covered it, since a degraded link explains its ends' lateness; the
culprit's incident stays open, repriced each step, until the job recovers. A burst over
already is a transient straggler; the same culprit bursting again is intermittent.

A job's tracker, after a simulated GPU slowed down (rank 7 from step 15):

>>> from detectors.replay import Replay
>>> from producers.sim.scenarios import build
>>> replay = Replay()
>>> _ = list(replay.run(build("slow-gpu", scale="tiny", seed=0, steps=40).records()))
>>> tracker = replay.jobs["slow-gpu-tiny-s0"].slowdowns
>>> [(c.key, tracker.ledger.onset_step(c)) for c in tracker.open]
[('rank:7', 15)]
"""

from __future__ import annotations

import msgspec

from detectors import texts
from detectors.changepoint import ShiftDetector
from detectors.cpu_wait import CpuWaits, quota_holds
from detectors.gpu_wait import GpuWaitBaseline
from detectors.incidents import EXPLAINED, JOB, Culprit, Incident, StepTimeLedger
from detectors.judgement import Judgement
from detectors.link_tracker import LinkTracker
from detectors.rechecks import Rechecks
from detectors.remainders import Remainders
from detectors.saves import Saves
from detectors.slowdown import SlowdownLocalizer
from detectors.steps import StepReport
from detectors.stragglers import Stragglers
from detectors.topology import Topology
from detectors.verdicts import VerdictBook
from schemas.enums import Cause


class SlowdownTracker(Judgement, Stragglers, Rechecks, Remainders):
    """Open step-time incidents of one job, other than its links'.

    Parameters
    ----------
    book, ledger, links, gpu_wait
        The job's verdict book, step-time ledger, link incidents and GPU-wait baseline.
    warmup, node_margin, alpha, host_lead_drop
        The localiser's (:class:`~detectors.slowdown.SlowdownLocalizer`).
    settle_steps
        A shift whose first steps name the network, a host or nobody is localised again
        until it has lasted this many steps (a rank's lateness takes a few to stand out:
        at first, the peers it holds up come late with it). A rank named earlier is
        reported at once and checked again then: another rank or host found over those
        steps takes over its incident (the same verdict, revised).
    unexplained_steps
        A shift that nothing localises (the whole job slower) is reported once it has
        lasted this many steps and its newest step is still slow
        (:mod:`detectors.judgement`).
    settle_s
        Every shift is reported only once it has lasted this long (seconds of the job's
        time): a host's own hiccups last up to about a second, whatever the job's step.
        One over sooner is judged as a burst.
    link_wait_ms
        How long after the step that confirmed a shift it waits for link samples that
        are read behind the collectives.
    gpu_wait_confirms
        A culprit whose sends wait this many times longer than usual on their own data
        (SendGPUWait) is confirmed as a GPU producing late (docs/method.md's table).
    transient_floor
        A burst is a transient straggler only this far above the baseline (and twice
        the bar a shift must clear): one that stands out of the noise.
    transient_min_lost_ms
        ... and only where it cost the job this much time or more (a few of the host
        scheduler's time slices cost less).
    cpu
        The job's ranks' CPU wait (:class:`~detectors.cpu_wait.CpuWaits`), where its
        heartbeats carry it: ranks or a host starved of CPU since a shift are its cause.
    saves
        The job's ranks' checkpoint saves (:class:`~detectors.saves.Saves`), where its
        heartbeats carry them: a burst the job spent saving a checkpoint is no straggler.
    amplifies, look_beats
        A rank or host starved of CPU explains at most this many times the share of the
        time it was kept from running (a little over once: see
        :mod:`detectors.remainders`); once its shares are read over this many
        heartbeats, what the step lost beyond that is localised again
        (:mod:`detectors.remainders`).
    held_share
        A step in which the rank that made the others wait this share of it longer than
        it used to (as the last to arrive) did so in the step before too is slower for
        that reason, not noise: the change-point detector judges it against its least
        shift, not the noise. So is a slower step while a CPU quota holds ranks back
        (:func:`~detectors.cpu_wait.quota_holds`, over the last ``settle_s``).
    """

    # for one pickled before it had them
    held_share: float = 0.25
    _held_by: int = -1
    _unsettled: dict[Culprit, int] | None = None
    cpu: CpuWaits | None = None
    saves: Saves | None = None
    amplifies: float = 1.25
    look_beats: int = 8

    def __init__(
        self,
        book: VerdictBook,
        ledger: StepTimeLedger,
        links: LinkTracker,
        gpu_wait: GpuWaitBaseline,
        *,
        warmup: int = 5,
        node_margin: float = 0.1,
        alpha: float = 0.05,
        host_lead_drop: float = 0.3,
        settle_steps: int = 8,
        unexplained_steps: int = 10,
        settle_s: float = 1.0,
        link_wait_ms: float = 1000.0,
        gpu_wait_confirms: float = 3.0,
        transient_floor: float = 0.3,
        transient_min_lost_ms: float = 50.0,
        held_share: float = 0.25,
        amplifies: float = 1.25,
        look_beats: int = 8,
        cpu: CpuWaits | None = None,
        saves: Saves | None = None,
    ) -> None:
        if settle_steps < 1 or unexplained_steps < 1 or gpu_wait_confirms <= 1:
            raise ValueError(
                "settle_steps and unexplained_steps must be at least 1 and "
                f"gpu_wait_confirms over 1, not {settle_steps}, {unexplained_steps}, "
                f"{gpu_wait_confirms}"
            )
        if settle_s < 0:
            raise ValueError(f"settle_s must be 0 or more, not {settle_s}")
        if transient_floor <= 0 or transient_min_lost_ms < 0:
            raise ValueError(
                "transient_floor must be positive and transient_min_lost_ms 0 or more, not "
                f"{transient_floor}, {transient_min_lost_ms}"
            )
        if not 0 < held_share <= 1 or amplifies < 1 or look_beats < 2:
            raise ValueError(
                "held_share must be in (0, 1], amplifies at least 1 and look_beats at least "
                f"2, not {held_share}, {amplifies}, {look_beats}"
            )
        self.book, self.ledger, self.links, self.gpu_wait = book, ledger, links, gpu_wait
        self.warmup, self.node_margin, self.alpha = warmup, node_margin, alpha
        self.host_lead_drop = host_lead_drop
        self.settle_steps, self.unexplained_steps = settle_steps, unexplained_steps
        self.settle_s = settle_s
        self.link_wait_ms = link_wait_ms
        self.gpu_wait_confirms = gpu_wait_confirms
        self.transient_floor, self.transient_min_lost_ms = transient_floor, transient_min_lost_ms
        self.held_share = held_share
        self.amplifies, self.look_beats = amplifies, look_beats
        self.cpu, self.saves = cpu, saves
        self._reset()

    def _reset(self) -> None:
        self.localizer = SlowdownLocalizer(
            warmup=self.warmup,
            node_margin=self.node_margin,
            alpha=self.alpha,
            host_lead_drop=self.host_lead_drop,
        )
        self.open: list[Culprit] = []  # open slowdowns' culprits, oldest first
        self.bursts: dict[Culprit, list[tuple[int, float, int]]] = {}
        # a confirmed step-time shift whose cause waits for the links' samples to cover
        # it: (onset step, ratio, start of the step that confirmed it in ns)
        self.pending: tuple[int, float, int] | None = None
        self._held_by = -1  # the rank that held the others up in the last step, or -1
        # ranks named before their shift settled -> its onset step: checked once it has
        self._unsettled = {}
        self._held = None  # a burst waiting to be reported (see Stragglers)
        self._looks = {}  # starved culprits to look at again (see Remainders)

    @property
    def shift(self) -> ShiftDetector:
        return self.ledger.shift

    @property
    def steps_to_tell(self) -> int:
        """The fewest steps of a job in which a slowdown can be told: its first (step 0,
        no step's time: :meth:`step` leaves it out), the warm-up that learns its usual
        step, and the values that confirm a shift."""
        return 1 + self.shift.warmup + self.shift.persistence

    # ------------------------------------------------------------------ steps
    def step(self, rep: StepReport, topo: Topology) -> list[msgspec.Struct]:
        """A closed step (already among the ledger's recent ones)."""
        if not rep.complete or rep.step == 0:
            return []
        out: list[msgspec.Struct] = []
        # one rank holding the others up far longer than it used to, step after step,
        # explains a slower step: the step's own noise does not (a noisy job would
        # hide a slow rank otherwise)
        rank, share = self.localizer.held_up(rep)
        held = rank if share >= self.held_share else -1
        explained = (held >= 0 and held == self._held_by) or self._quota_holds(rep)
        self._held_by = held
        ev = self.shift.update(rep.duration_ns, rep.step, explained=explained)
        if not self.localizer.ready or (ev is None and not self.shift.excursion):
            self.localizer.learn(rep)  # not a burst's steps: a quota's bursts are not usual
        if ev is not None:
            out += self._shift_event(ev.kind, ev.onset, ev.ratio, ev.length, rep, topo)
        elif self.shift.lone is not None:  # within the noise: a quota's, if one held it
            out += self._hold_lone(*self.shift.lone, rep, topo)
        elif self.shift.shifted and self.open:
            out += self._update(rep, self.ledger.level_now(self.open) / self.shift.baseline)
        if ev is None and self.pending is not None:
            out += self.judge(rep, topo)
        if ev is None and self.pending is None and self._unsettled:
            out += self._recheck(rep, topo)
        if ev is None and self._looks:
            out += self._look(rep, topo)
        if ev is None:
            out += self._release_burst(rep, topo, now=False)
        return out

    def _quota_holds(self, rep: StepReport) -> bool:
        """Whether step ``rep``, slower than the baseline by the least shift, is so for a
        CPU quota: one that held ranks back through most of the time a shift must last
        up to it (``settle_s``; one for a step or two makes a burst, not a shift). In a
        shift, a faster step is no recovery while the quota holds (it let one through)."""
        base = self.shift.baseline
        if self.cpu is None or base is None:
            return False
        if not self.shift.shifted and rep.duration_ns < base * (1 + self.shift.min_shift):
            return False
        return quota_holds(self.cpu, rep.end_ns - int(self.settle_s * 1e9), rep.end_ns)

    def explained(self, but: Culprit | None = None) -> tuple[set[int], set[str]]:
        """The ranks and hosts its open slowdowns name (what they explain elsewhere), but
        incident ``but``'s."""
        ranks: set[int] = set()
        nodes: set[str] = set()
        for c in self.open:
            if c == but:
                continue
            if c.kind == "rank":
                ranks.add(int(c.name))
                if (v := self.book.current(c.verdict_kind.value, c.key)) is not None:
                    ranks.update(v.culprit_ranks)
            elif c.kind == "node":
                nodes.add(c.name)
        return ranks, nodes

    def links_moved(self, topo: Topology) -> list[msgspec.Struct]:
        """The links' samples moved on: a shift waiting for them may be judged."""
        if self.pending is None or not self.ledger.recent:
            return []
        return self.judge(self.ledger.recent[-1], topo)

    def finish(self, topo: Topology) -> list[msgspec.Struct]:
        """No more input: a shift still waiting for link samples, and a burst held, are
        judged now."""
        if not self.ledger.recent:
            return []
        out = self._release_burst(self.ledger.recent[-1], topo)
        if self.pending is None:
            return out
        return out + self.judge(self.ledger.recent[-1], topo, final=True)

    def _shift_event(
        self, kind: str, onset: int, ratio: float, length: int, rep: StepReport, topo: Topology
    ) -> list[msgspec.Struct]:
        if kind == "shift":
            onset, out = self._burst_before_shift(onset, ratio, rep, topo)
            self.pending = (onset, ratio, rep.start_ns)
            first = self.ledger.since(onset)
            self.pending_since_ns = first[0].start_ns if first else rep.start_ns
            return out + self.judge(rep, topo)
        if kind == "recovered":
            out = []
            if self.pending is not None:  # over before it was believed: a burst
                (first, high, _), self.pending = self.pending, None
                out += self._hold_burst(first, high, onset - first, rep, topo)
            out += self._short_episode(onset, rep)  # those it retold are resolved already
            for culprit in self.open:
                if v := self.book.resolve(culprit.verdict_kind.value, culprit.key, rep.end_ns):
                    out.append(v)
                self.ledger.forget(culprit)
            self.open = []
            self._unsettled = {}
            out += self.links.severities(0.0, rep)
            return out
        return self._hold_burst(onset, ratio, length, rep, topo)

    # ------------------------------------------------------------------ incidents
    def _update(self, rep: StepReport, ratio: float) -> list[msgspec.Struct]:
        """The open incidents' severities at a step ``ratio`` x the baseline (each keeps its
        cause, culprit and onset; the book announces only material changes)."""
        duration = ratio * self.ledger.baseline
        return self.links.severities(duration, rep) + self._reprice(duration, rep)

    def _reprice(
        self, duration: float, rep: StepReport, skip: Culprit | None = None
    ) -> list[msgspec.Struct]:
        """Open slowdowns (but ``skip``) at their shares of a step of ``duration`` ns."""
        out: list[msgspec.Struct] = []
        for culprit in self.open:
            kind = culprit.verdict_kind
            current = self.book.current(kind.value, culprit.key)
            if culprit == skip or current is None:
                continue
            # capped at what its evidence explains: its verdict says so (why its cost fell)
            cap = self.ledger.caps_of(culprit)
            evidence = current.evidence if cap is None else {**current.evidence, EXPLAINED: cap}
            if v := self.book.report(
                kind,
                current.cause,
                culprit.key,
                onset_step=current.onset_step,
                onset_ns=current.onset_ns,
                detected_ns=rep.end_ns,
                severity=self.ledger.share(culprit, duration),
                confidence=current.confidence,
                evidence=evidence,
            ):
                out.append(v)
        return out

    def _slowdown(
        self,
        rep: StepReport,
        ratio: float,
        onset: int,
        topo: Topology,
        located: Incident | None = None,
    ) -> list[msgspec.Struct]:
        """A confirmed shift of step time since step ``onset``: localise what it added.

        A culprit already open (its slowdown grew) keeps its incident, onset and the
        level it began at; another culprit opens an incident of its own beside it.
        ``located``: its culprit, found over those steps already."""
        duration = ratio * self.ledger.baseline
        reps = self.ledger.since(onset)
        found = located or self.locate(reps, topo)
        if found is None and self.links.open:  # the link verdict carries this slowdown
            return self._update(rep, ratio)
        inc = found or Incident(JOB, Cause.UNKNOWN)
        culprit = inc.culprit
        if culprit not in self.open and self._stalls_again(inc, topo):
            return self._update(rep, ratio)  # its intermittent verdict carries it
        # a rank named from a shift's first steps may have been this culprit seen early:
        # checked again first, so that one fault stays one incident
        out = self._recheck(rep, topo) if culprit not in self.open and self._unsettled else []
        grew = culprit in self.open  # its slowdown grew: it keeps its onset
        if grew and (known := self.ledger.onset_step(culprit)) is not None:
            onset = known
            reps = self.ledger.since(onset) or reps
        onset_rep = reps[0] if reps else rep
        if not grew:
            self.open.append(culprit)
            self.ledger.begin(culprit, onset, onset_rep.start_ns)
            if culprit.kind == "rank" and len(reps) < self.settle_steps:
                if self._unsettled is None:  # pickled before it had them
                    self._unsettled = {}
                self._unsettled[culprit] = onset
        self._look_later(inc, onset)  # (a rank renamed once settled, or a shift on top too)
        severity = self.ledger.share(culprit, duration)
        out += self.links.severities(duration, rep)
        kind = culprit.verdict_kind
        inc.evidence = {
            **inc.evidence,
            **self.gpu_wait.evidence(inc.rank),
            "step_time_ratio": ratio,
            "baseline_step_ns": float(self.shift.baseline or 0),
        }
        phase = inc.phase.value if inc.phase else None
        summary = texts.slowdown_summary(
            kind=kind, who=inc.who, ratio=ratio, onset=onset, severity=severity,
            cause=inc.cause, where=", ".join(filter(None, (
                texts.where(None, phase, inc.microbatch, inc.pp_stage),
                texts.cpu_wait(inc.evidence)))),
        )  # fmt: skip
        # the culprit's own sends waiting on their data confirm its GPU (decision table)
        confirmed = inc.evidence.get("send_gpu_wait_ratio", 0.0) >= self.gpu_wait_confirms
        v = self.book.report(
            kind,
            inc.cause,
            culprit.key,
            onset_step=onset,
            onset_ns=onset_rep.start_ns,
            detected_ns=rep.end_ns,
            severity=severity,
            confidence=(0.95 if confirmed else 0.9) if found else 0.5,
            step=onset,
            summary=summary,
            **inc.fields(),
        )
        out += self._reprice(duration, rep, skip=culprit)  # the others' shares moved too
        return [*out, v] if v else out


__all__ = ["SlowdownTracker"]
