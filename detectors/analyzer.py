"""Everything megatrace concludes about one job, from its aligned collectives and records.

:class:`JobAnalyzer` is the per-job composition of the detectors: the step
assembler (wait-time model), the step-time change-point detector, the
critical-path slowdown localiser, the link monitor, the hang localiser and the
verdict book. It is pure: time comes from the records (and from
:meth:`tick`, which the caller drives with event time), it does no I/O, and
it pickles. The same object runs in the Bytewax flow and offline.

Inputs: job metadata records; from the communicators,
:class:`~detectors.align.Instance` (complete or partial),
:class:`~detectors.parts.StepPart` (one communicator's or several merged),
:class:`~detectors.merge.CommLiveness`, :class:`~detectors.edges.EdgeThroughput`
and stuck :class:`ProxySummary`; from the nodes,
:class:`~detectors.node.NodeDigest` (or raw :class:`LinkSample`, which go
through a node analyzer kept here); :class:`Heartbeat`; other records only
move its clock. Outputs: :class:`AlignedCollective`, :class:`StepSummary`,
:class:`RankStep` and :class:`Verdict` records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from detectors import texts
from detectors.align import Instance, aligned_record
from detectors.changepoint import ShiftDetector
from detectors.edges import EdgeThroughput
from detectors.folder import StepFolder
from detectors.gpu_wait import GpuWaitBaseline
from detectors.hang import HangDiagnosis
from detectors.links import LinkEvent, LinkMonitor
from detectors.merge import CommLiveness
from detectors.node import NodeAnalyzer, NodeDigest
from detectors.parts import StepPart
from detectors.schedule import CommSchedule, ScheduleBook
from detectors.slowdown import SlowdownLocalizer
from detectors.steps import StepAssembler, StepReport
from detectors.topology import Position, Topology
from detectors.verdicts import VerdictBook
from detectors.watchdog import HangWatch, JobView
from schemas.codec import encode
from schemas.config import DetectSettings
from schemas.enums import Cause, CollOp, DeadLetterReason, Phase, VerdictKind
from schemas.records import (
    CommInfo,
    CommStructure,
    DeadLetter,
    Heartbeat,
    Iteration,
    JobInfo,
    LinkSample,
    ProxySummary,
    RankInfo,
    RankStep,
    StepSummary,
    event_time,
)

#: A shift whose first steps name the network or nobody is localised again until it has
#: lasted this many steps (a rank's lateness takes a few steps to stand out of the noise).
_SETTLE_STEPS = 8
#: Records of a job held until its job record comes (they may overtake it); beyond, refused.
_EARLY_HELD = 100_000
#: A culprit whose sends wait this many times longer than usual on their own data
#: (SendGPUWait) is confirmed as a GPU producing late (the decision table of docs/method.md).
GPU_WAIT_CONFIRMS = 3.0


#: the hang watchdog's state, as a version that kept it in the job pickled it
_OLD_HANG_STATE = {
    "partials": "partials", "stuck": "stuck", "last_progress_ns": "last_progress_ns",
    "hb_latest": "hb_latest", "hb_done": "hb_done", "hb_progress_ns": "hb_progress_ns",
    "hb_now_ns": "hb_now_ns", "hang_open": "open", "_hang_detected_ns": "detected_ns",
    "_final": "final",
}  # fmt: skip


class JobAnalyzer:
    """The detectors of one job (see the module docstring)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "hangs" not in state:  # pickled before the watchdog had a class of its own
            hangs = HangWatch()
            for old, new in _OLD_HANG_STATE.items():
                if old in state:
                    setattr(hangs, new, state.pop(old))
            state["hangs"] = hangs
        if isinstance(state.get("gpu_wait"), dict):  # kept as a plain dict before
            gpu_wait = GpuWaitBaseline()
            gpu_wait._ranks = state["gpu_wait"]
            state["gpu_wait"] = gpu_wait
        self.__dict__.update(state)

    def __init__(self, job: str, settings: DetectSettings | None = None) -> None:
        self.job = job
        self.settings = settings or DetectSettings()
        self._reset()

    def _reset(self) -> None:
        st = self.settings
        self.topo: Topology | None = None
        self._pending_meta: list[RankInfo | CommInfo] = []
        self._early: list[Any] = []
        self.assembler: StepAssembler | None = None
        self.shift = ShiftDetector(
            warmup=st.warmup_steps,
            min_shift=st.min_shift,
            persistence=st.persistence,
            alpha=st.alpha,
        )
        self.localizer = SlowdownLocalizer(
            warmup=st.warmup_steps,
            node_margin=st.node_margin,
            alpha=st.alpha,
            host_lead_drop=st.host_lead_drop,
        )
        # per node: link samples against each link's baseline (the flow sends digests made
        # per node; raw samples given here go through the same analyzers)
        self.nodes: dict[str, NodeAnalyzer] = {}
        # link throughput measured from proxy summaries: its own baselines, never mixed
        self.proxy_links = LinkMonitor(warmup=st.warmup_steps, drop=st.link_drop)
        self.book = VerdictBook(self.job)
        self.recent: deque[StepReport] = deque(maxlen=16)
        self.hangs = HangWatch()
        self.now_ns = 0  # the newest time any input showed
        self.coll_now_ns = 0  # the newest time the collective records showed
        self.durations: deque[int] = deque(maxlen=20)
        self.slow_open: list[str] = []  # open slowdown incidents' culprits, oldest first
        self.bursts: dict[str, list[tuple[int, float, int]]] = {}
        self.link_culprits: dict[tuple[int, int], str] = {}  # degraded edge -> its incident
        self.link_onset: dict[tuple[int, int], int] = {}  # degraded edge -> since when (ns)
        self.link_fields: dict[str, dict[str, Any]] = {}  # incident -> cause and culprit fields
        # open step-time incident (link or slowdown culprit) -> when it began: its onset
        # step once a step reached it (None before), and its onset time (ns)
        self.onset_at: dict[str, tuple[int | None, int]] = {}
        self.onset_level: dict[str, float] = {}  # -> the step time before it (ns), once known
        # node -> its newest link sample (ns); any: the job's sources send link samples
        self.link_seen: dict[str, int] = {}
        # a confirmed step-time shift whose cause waits for the links' samples to cover
        # it: (onset step, ratio, start of the step that confirmed it in ns)
        self.pending_shift: tuple[int, float, int] | None = None
        # per sending rank: how late its sends find their data, against its own baseline
        self.gpu_wait = GpuWaitBaseline()
        self.refused = 0  # items kept as dead letters: outside the layout, or no job record
        #: (comm, sender, receiver) -> its step as its calls show it
        self.structure: dict[tuple[int, int, int], CommStructure] = {}
        #: the job's own folders, for instances that reach it unfolded (see _instance)
        self.folders: dict[int, StepFolder] = {}
        self.folded_elsewhere: set[int] = set()  # communicators folded by their own worker
        self.marks: dict[int, tuple[int, int]] = {}  # iteration markers: step -> (end, rank)

    # ------------------------------------------------------------------ inputs
    def update(self, item: Any) -> list[msgspec.Struct]:
        handle = _HANDLERS.get(type(item))
        if handle is not None and self.topo is not None and not self._early:
            if (refused := self._outside(item)) is not None:
                return [refused]
            return handle(self, item)  # the usual case: the job is known, nothing held back
        if self.topo is None and not isinstance(item, JobInfo):
            if isinstance(item, RankInfo | CommInfo):
                self._pending_meta.append(item)
            elif len(self._early) < _EARLY_HELD:  # records that overtook the job record
                self._early.append(item)
            else:  # bounded: beyond it, kept as dead letters, never silently dropped
                return [self._no_job_record(item)]
            return []
        out: list[msgspec.Struct] = []
        if self._early and not isinstance(item, JobInfo | RankInfo | CommInfo):
            early, self._early = self._early, []  # the metadata burst is over: replay in order
            for rec in early:
                out += self.update(rec)
        handle = _HANDLERS.get(type(item))
        if handle is None:  # a record the analysis only keeps time by
            self.now_ns = max(self.now_ns, event_time(item))
            return out
        if self.topo is not None and (refused := self._outside(item)) is not None:
            return [*out, refused]
        return out + handle(self, item)

    def _no_job_record(self, item: Any) -> DeadLetter:
        self.refused += 1
        return DeadLetter(
            ts_ns=event_time(item) if isinstance(item, msgspec.Struct) else _item_time(item),
            reason=DeadLetterReason.NO_JOB_RECORD,
            error=f"job {self.job} sent no job record before {_EARLY_HELD:,} of its records: "
            "not analysed (its layout is unknown)",
            step_id="analyze",
            raw=encode(item) if isinstance(item, msgspec.Struct) else _describe(item),
        )

    def _outside(self, item: Any) -> DeadLetter | None:
        """A dead letter (reason ``out_of_layout``) for an item naming a rank outside the
        job's layout, or a communicator's member that is not one: a record of another
        job, or a corrupt one, is never evidence (it once made a false hang)."""
        assert self.topo is not None
        world = self.topo.job.world_size
        ranks = _ranks_of(item)
        if not ranks:
            return None
        bad = next((r for r in ranks if r >= world), None)
        why = f"rank {bad} is outside job {self.job}'s {world} ranks"
        if bad is None and isinstance(item, Instance):
            info = self.topo.comms.get(item.comm_hash)
            if info is None:
                return None
            members = set(info.ranks)
            bad = next((r for r in item.ranks if r not in members), None)
            # a transfer's instance is its two ends, whatever the communicator's size
            if bad is None and (item.sender >= 0 or item.comm_size == len(info.ranks)):
                return None
            why = (
                f"rank {bad} is not a member of communicator {item.comm_hash:016x}"
                if bad is not None
                else f"communicator {item.comm_hash:016x} has {len(info.ranks)} members, "
                f"not {item.comm_size}"
            )
        elif bad is None:
            return None
        self.refused += 1
        return DeadLetter(
            ts_ns=event_time(item) if isinstance(item, msgspec.Struct) else _item_time(item),
            reason=DeadLetterReason.OUT_OF_LAYOUT,
            error=f"{why}: not used as evidence",
            field="rank",
            step_id="analyze",
            raw=encode(item) if isinstance(item, msgspec.Struct) else _describe(item),
        )

    def _record_time(self, rec: Any) -> None:
        self.now_ns = max(self.now_ns, event_time(rec))

    def _job_in(self, job: JobInfo) -> list[msgspec.Struct]:
        self._record_time(job)
        return self._job(job)

    def _meta_in(self, rec: RankInfo | CommInfo) -> list[msgspec.Struct]:
        self._record_time(rec)
        assert self.topo is not None
        self.topo.add(rec)
        return []

    def _structure_in(self, note: CommStructure) -> list[msgspec.Struct]:
        """A communicator's step as its calls show it (stored; the job's account of where
        the layout does not hold)."""
        self.folded_elsewhere.add(note.comm_hash)
        if note.clock == "learning":  # it will send parts: its steps wait for them
            if self.assembler is not None:
                self.assembler.expect(note.comm_hash)
            return []
        self.structure[(note.comm_hash, note.sender, note.receiver)] = note
        out: list[msgspec.Struct] = [note]
        folder = self.folders.get(note.comm_hash)
        if folder is not None:  # what it held waiting for its own learning is placed now
            rows, items = folder.adopt(note)
            out += [*rows, *self._from_folder(items)]
        return out

    def _proxy_in(self, p: ProxySummary) -> list[msgspec.Struct]:
        """Stuck proxy operations (and their completion) for the hang diagnosis."""
        self._record_time(p)
        self.hangs.proxy(p)
        return []

    def _node(self, name: str) -> NodeAnalyzer:
        node = self.nodes.get(name)
        if node is None:
            st = self.settings
            node = self.nodes[name] = NodeAnalyzer(st.warmup_steps, st.link_drop)
        return node

    def _link_in(self, s: LinkSample) -> list[msgspec.Struct]:
        """A raw link sample: through its node's analyzer, as the flow does."""
        digest = self._node(s.node).update((s,))
        return self._digest(digest) if digest is not None else []

    def _digest(self, d: NodeDigest) -> list[msgspec.Struct]:
        """A node's links that changed."""
        if d.ts_ns > self.now_ns:
            self.now_ns = d.ts_ns
        self.link_seen[d.node] = max(d.ts_ns, self.link_seen.get(d.node, d.ts_ns))
        out: list[msgspec.Struct] = []
        for ev, ts in d.links:
            out += self._link_event(ev, ts)
        if self.pending_shift is not None and self.recent:
            out += self._judge_shift(self.recent[-1])
        return out

    def _heartbeat_in(self, hb: Heartbeat) -> list[msgspec.Struct]:
        """Liveness and progress (see :meth:`HangWatch.heartbeat`)."""
        if hb.ts_ns > self.now_ns:
            self.now_ns = hb.ts_ns
        return self.hangs.heartbeat(hb, self.book)

    def _progress_in(self, p: CommLiveness) -> list[msgspec.Struct]:
        return self._progress(p.last_arrival_ns, p.last_end_ns)

    def _job(self, info: JobInfo) -> list[msgspec.Struct]:
        if self.topo is None:
            self.topo = Topology.from_job(info)
            for m in self._pending_meta:
                self.topo.add(m)
            self._pending_meta = []
            self.assembler = StepAssembler(self.topo)
        else:
            self.topo.add(info)
        return []

    def _instance(self, inst: Instance) -> list[msgspec.Struct]:
        """An instance that reached the job unfolded: partial (a hang's evidence), its
        completion, or one of a communicator whose folder had no schedule yet. A
        communicator whose folder works elsewhere (it sent parts or its structure) has
        its completions placed where that folder places them; the others' instances go
        through the job's own folder of the communicator (the same one)."""
        assert self.assembler is not None
        key = inst.key
        folder = self._folder(inst.comm_hash)
        if not inst.complete:
            self.now_ns = max(self.now_ns, max(inst.arrival))
            self.coll_now_ns = max(self.coll_now_ns, max(inst.arrival))
            self.hangs.partial(inst)
            pos = folder.position(inst) if folder is not None else None
            return [aligned_record(self.job, self.topo, inst, pos)]
        self.hangs.completed(key)
        out: list[msgspec.Struct] = self._progress(max(inst.arrival), max(inst.end))
        if folder is None:  # a communicator the job has no record of
            return [aligned_record(self.job, self.topo, inst, None), *out]
        if inst.comm_hash in self.folded_elsewhere:  # a partial one's completion: its step
            pos = folder.position(inst, now=True)  # is open, the newest marker's next at most
            out.insert(0, aligned_record(self.job, self.topo, inst, pos))
            for rep in self.assembler.add(inst, pos):
                out += self._step(rep)
            return out
        rows, items = folder.update(inst)
        return [*rows, *out, *self._from_folder(items)]

    def _folder(self, comm_hash: int) -> StepFolder | None:
        """The job's own folder of a communicator it has the record of."""
        folder = self.folders.get(comm_hash)
        if folder is None and self.topo is not None:
            info = self.topo.comms.get(comm_hash)
            if info is None:
                return None
            folder = self.folders[comm_hash] = StepFolder()
            folder.learn(CommSchedule(self.topo.job, info))
            for step, (end, rank) in self.marks.items():
                folder.mark(step, end, rank)
            for (h, _, _), note in self.structure.items():
                if h == comm_hash:
                    folder.adopt(note)
        return folder

    def _from_folder(self, items: list[Any]) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = []
        for x in items:
            if isinstance(x, StepPart):
                out += self._part(x, own=True)
            elif isinstance(x, CommStructure):
                if x.clock == "learning":
                    if self.assembler is not None:
                        self.assembler.expect(x.comm_hash)
                    continue
                self.structure[(x.comm_hash, x.sender, x.receiver)] = x
                out.append(x)
            elif isinstance(x, Instance):
                out += self._instance(x)
        return out

    def _iteration_in(self, it: Iteration) -> list[msgspec.Struct]:
        """One of the job's iteration markers: its own folders place steps by them."""
        if it.step in self.marks:
            return []
        self.marks[it.step] = (it.end_ns, it.rank)
        if len(self.marks) > ScheduleBook.recent_marks:
            del self.marks[min(self.marks)]
        out: list[msgspec.Struct] = []
        for folder in self.folders.values():
            rows, items = folder.mark(it.step, it.end_ns, it.rank)
            out += [*rows, *self._from_folder(items)]
        return out

    def _part(self, part: StepPart, own: bool = False) -> list[msgspec.Struct]:
        """A communicator's folded share of a step (see :class:`~detectors.folder.StepFolder`);
        ``own``: from the job's own folder."""
        assert self.assembler is not None
        if not own:
            self.folded_elsewhere.update(part.comms or (part.comm_hash,))
        out = self._progress(part.last_arrival, part.end)
        for rep in self.assembler.add_part(part):
            out += self._step(rep)
        return out

    def _progress(self, arrival_ns: int, end_ns: int) -> list[msgspec.Struct]:
        """Collectives completed up to ``end_ns``: the job moves (and a hang may be over)."""
        self.now_ns = max(self.now_ns, arrival_ns, end_ns)
        self.coll_now_ns = max(self.coll_now_ns, arrival_ns, end_ns)
        return self.hangs.progress(end_ns, self.book)

    # ------------------------------------------------------------------ steps
    def _step(self, rep: StepReport) -> list[msgspec.Struct]:
        topo = self.topo
        assert topo is not None and self.assembler is not None
        out: list[msgspec.Struct] = []
        if rep.complete:
            self.durations.append(rep.duration_ns)
        self.recent.append(rep)
        baseline = self.shift.baseline
        ratio = rep.duration_ns / baseline if baseline else None
        out.append(
            StepSummary(
                job=self.job,
                step=rep.step,
                start_ns=rep.start_ns,
                end_ns=rep.end_ns,
                duration_ns=rep.duration_ns,
                expected_ns=int(baseline) if baseline else None,
                throughput_ratio=(1 / ratio) if ratio else None,
                slowest_pp_group=self._slowest_replica(rep),
                critical_path=self._critical_names(rep),
                instances=rep.n_instances,
                expected_instances=self.assembler.expected_instances(),
                late_instances=self.assembler.late_instances,
            )
        )
        for r in range(topo.job.world_size):
            if rep.first_ns[r] < 0:
                continue
            out.append(
                RankStep(
                    job=self.job,
                    step=rep.step,
                    rank=r,
                    node=topo.node(r),
                    pp_stage=topo.coords(r)[0],
                    start_ns=int(rep.first_ns[r]),
                    end_ns=int(max(rep.last_end_ns[r], rep.first_ns[r])),
                    wait_ns=int(rep.wait_ns[r]),
                    lateness_ns=float(rep.lateness_ns[r]),
                    blame_ns=int(rep.blame_ns[r]),
                )
            )
        if not rep.complete or rep.step == 0:
            return out
        ev = self.shift.update(rep.duration_ns, rep.step)
        if not self.localizer.ready or (ev is None and not self.shift.shifted):
            self.localizer.learn(rep)
        if ev is not None:
            out += self._shift_event(ev.kind, ev.onset, ev.ratio, ev.length, rep)
        elif self.shift.shifted and self.slow_open:
            out += self._slowdown_update(rep, self.recent[-1].duration_ns / self.shift.baseline)
        if ev is None and self.pending_shift is not None:
            out += self._judge_shift(rep)
        return out

    def _since(self, onset: int) -> list[StepReport]:
        return [r for r in self.recent if r.step >= onset]

    def _shift_event(
        self, kind: str, onset: int, ratio: float, length: int, rep: StepReport
    ) -> list[msgspec.Struct]:
        if kind == "shift":
            self.pending_shift = (onset, ratio, rep.start_ns)
            return self._judge_shift(rep)
        if kind == "recovered":
            self.pending_shift = None
            out = []
            for culprit in self.slow_open:
                if v := self.book.resolve(_kind_of(culprit).value, culprit, rep.end_ns):
                    out.append(v)
                self._forget_onset(culprit)
            self.slow_open = []
            out += self._link_severity(0.0, rep)
            return out
        return self._burst(onset, ratio, length, rep)

    def _judge_shift(self, rep: StepReport, final: bool = False) -> list[msgspec.Struct]:
        """Localise the pending shift (as of step ``rep``, the newest) once every node's link
        samples reached the step that confirmed it, or ``link_wait_ms`` after that step
        (or now: ``final``, no more input).

        Topics are read at different paces: a degraded link whose samples are read a
        few steps after the collectives would otherwise leave its slowdown to the job
        (cause unknown) or to the rank at its end, and then be reported beside it."""
        assert self.pending_shift is not None
        onset, ratio, confirmed_ns = self.pending_shift
        links_behind = bool(self.link_seen) and min(self.link_seen.values()) < confirmed_ns
        waited = rep.end_ns - confirmed_ns >= self.settings.link_wait_ms * 1e6
        if links_behind and not waited and not final:
            return []
        reps = self._since(onset)
        if not final and len(reps) < _SETTLE_STEPS:
            # who waits for whom takes a few steps to show: a network or nobody, named
            # from the first steps of a shift, is only believed once it settled
            found = self._culprit(reps)
            if found is None or found[0].startswith("nodes:"):
                return []
        self.pending_shift = None
        return self._slowdown(rep, ratio, onset)

    def _culprit(self, reps: list[StepReport]) -> tuple[str, dict[str, Any]] | None:
        """The first localised candidate not explained by a degraded link (MEGATRACE checks
        links first: a rank whose NIC is slow arrives late without computing slowly)."""
        topo = self.topo
        assert topo is not None
        # a link explains its ends' lateness only from when it degraded: a GPU that slowed
        # before its own link did is still the culprit of what it began
        first_end = reps[0].end_ns if reps else 0
        link_ends = {
            r
            for edge in self.link_culprits
            if self.link_onset.get(edge, 0) < first_end
            for r in edge
        }
        increase = float(np.mean([r.duration_ns for r in reps])) - self._level_before(reps)
        found = self.localizer.localize(reps, topo)
        if not any(r.spans for r in reps) or not self.link_culprits:
            # last: who made the others wait (no schedule to walk, or nothing on it); and
            # if nobody did, the transfers between nodes that took longer
            found += self.localizer.who_waits(reps, topo, increase)
            if not self.link_culprits:
                found += self.localizer.slow_transfers(reps, topo, increase)
        for f in found:
            if f.rank is not None and f.rank in link_ends:
                continue
            growth = f.evidence.get("rank_lateness_growth_ns")
            if growth is not None and growth < 0.25 * increase:
                continue  # too little of the lost time is this rank's own lateness
            fields: dict[str, Any] = {
                "pp_stage": f.stage,
                "microbatch": f.microbatch,
                "phase": Phase(f.phase) if f.phase else None,
                "node": f.node,
                "evidence": dict(f.evidence),
            }
            if f.rank is not None:
                fields.update(rank=f.rank, gpu=topo.gpu(f.rank))
                return f"rank:{f.rank}", {"cause": f.cause, **fields}
            if f.link is not None:  # the network between nodes
                fields.update(link=f.link, phase=Phase.TRANSFER)
                return f"nodes:{f.link}", {"cause": f.cause, **fields}
            return f"node:{f.node}", {"cause": f.cause, **fields}
        return None

    def _level_before(self, reps: list[StepReport]) -> float:
        """The step time a slowdown starting at ``reps[0]`` adds to (see
        :meth:`_level_before_step`)."""
        return self._level_before_step(reps[0].step) if reps else self.shift.baseline or 0.0

    def _level_before_step(self, onset: int, steps: int = 3) -> float:
        """The step time an incident beginning at step ``onset`` adds to: the baseline, or
        the level of the steps just before it when those were slow already (a shift on
        top of an earlier one, e.g. a degraded link: a culprit explains only what it added)."""
        base = self.shift.baseline or 0.0
        before = [
            r.duration_ns for r in self.recent if r.complete and onset - steps <= r.step < onset
        ]
        level = float(np.mean(before)) if before else base
        return level if level > base * (1 + self.settings.min_shift) else base

    def _slowdown_update(self, rep: StepReport, ratio: float) -> list[msgspec.Struct]:
        """The open incidents' severities at a step ``ratio`` x the baseline (each keeps its
        cause, culprit and onset; the book announces only material changes)."""
        duration = ratio * (self.shift.baseline or 0.0)
        return self._link_severity(duration, rep) + self._reprice(duration, rep)

    def _reprice(
        self, duration: float, rep: StepReport, skip: str | None = None
    ) -> list[msgspec.Struct]:
        """Open slowdowns (but ``skip``) at their shares of a step of ``duration`` ns."""
        out: list[msgspec.Struct] = []
        for culprit in self.slow_open:
            current = self.book.current(_kind_of(culprit).value, culprit)
            if culprit == skip or current is None:
                continue
            if v := self.book.report(
                _kind_of(culprit),
                current.cause,
                culprit,
                onset_step=current.onset_step,
                onset_ns=current.onset_ns,
                detected_ns=rep.end_ns,
                severity=self._share(culprit, duration),
                confidence=current.confidence,
            ):
                out.append(v)
        return out

    def _slowdown(self, rep: StepReport, ratio: float, onset: int) -> list[msgspec.Struct]:
        """A confirmed shift of step time since step ``onset``: localise what it added.

        A culprit already open (its slowdown grew) keeps its incident, onset and the
        level it began at; another culprit opens an incident of its own beside it."""
        duration = ratio * (self.shift.baseline or 0.0)
        reps = self._since(onset)
        found = self._culprit(reps)
        if found is None:
            if self.link_culprits:  # the link verdict carries this slowdown
                return self._slowdown_update(rep, ratio)
            culprit, fields = "job", {"cause": Cause.UNKNOWN}
        else:
            culprit, fields = found
        grew = culprit in self.slow_open  # its slowdown grew: it keeps its onset
        if grew and (known := self.onset_at[culprit][0]) is not None:
            onset = known
            reps = self._since(onset) or reps
        onset_rep = reps[0] if reps else rep
        if not grew:
            self.slow_open.append(culprit)
            self.onset_at[culprit] = (onset, onset_rep.start_ns)
        severity = self._share(culprit, duration)
        out = self._link_severity(duration, rep)
        cause = fields.pop("cause")
        kind = _kind_of(culprit)
        who = (
            texts.who(fields["rank"], fields.get("gpu"), fields.get("node"))
            if "rank" in fields
            else _network(fields["link"])
            if culprit.startswith("nodes:")
            else f"host {fields.get('node')}"
            if culprit != "job"
            else "an unlocalised part of the job"
        )
        phase = fields.get("phase")
        where = texts.where(None, phase.value if phase else None, fields.get("microbatch"),
                            fields.get("pp_stage"))  # fmt: skip
        fields["summary"] = (
            f"{kind.value.replace('_', ' ')}: {who} - iteration {ratio:.2f}x slower since step "
            f"{onset} ({texts.percent(severity)} throughput lost to it), cause "
            f"{cause.value.replace('_', ' ')}{f', {where}' if where else ''}"
        )
        fields["evidence"] = {
            **fields.get("evidence", {}),
            **self.gpu_wait.evidence(fields.get("rank")),
            "step_time_ratio": ratio,
            "baseline_step_ns": float(self.shift.baseline or 0),
        }
        v = self.book.report(
            kind,
            cause,
            culprit,
            onset_step=onset,
            onset_ns=onset_rep.start_ns,
            detected_ns=rep.end_ns,
            severity=severity,
            # the culprit's own sends waiting on their data confirm its GPU (decision table)
            confidence=(
                (
                    0.95
                    if fields["evidence"].get("send_gpu_wait_ratio", 0.0) >= GPU_WAIT_CONFIRMS
                    else 0.9
                )
                if found
                else 0.5
            ),
            step=onset,
            **fields,
        )
        out += self._reprice(duration, rep, skip=culprit)  # the others' shares moved too
        return [*out, v] if v else out

    def _share(self, culprit: str, duration: float) -> float:
        """The fraction of a step of ``duration`` ns that open incident ``culprit`` costs:
        the step time it added, from the level before it to the level before the next
        incident (or ``duration``). Incidents that began at one level share what was
        added; the shares of all open incidents sum to ``1 - baseline / duration``."""
        base = self.shift.baseline
        if duration <= 0 or not base:
            return 0.0
        own = self._onset_level(culprit) or base
        levels = [self._onset_level(c) or base for c in self.onset_at]
        top = min([lv for lv in levels if lv > own] + [duration])
        tied = sum(1 for lv in levels if lv == own) or 1
        return max(0.0, top - own) / duration / tied

    def _onset_level(self, culprit: str) -> float | None:
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
            step = self._step_reaching(onset_ns)
            if step is None:  # no step reached its onset yet: the level so far
                return self._level_before_step(self.recent[-1].step + 1) if self.recent else None
            self.onset_at[culprit] = (step, onset_ns)
        level = self.onset_level[culprit] = self._level_before_step(step)
        return level

    def _step_reaching(self, ts_ns: int) -> int | None:
        """The first step seen that ended at or after ``ts_ns`` (None: none yet)."""
        return next((r.step for r in self.recent if r.end_ns >= ts_ns), None)

    def _forget_onset(self, culprit: str) -> None:
        self.onset_at.pop(culprit, None)
        self.onset_level.pop(culprit, None)

    def _link_severity(self, duration: float, rep: StepReport) -> list[msgspec.Struct]:
        """Update the open link incidents' severities to their shares of a step of
        ``duration`` ns (0: the job recovered)."""
        out = []
        for culprit in dict.fromkeys(self.link_culprits.values()):
            severity = self._share(culprit, duration)
            fields = dict(self.link_fields[culprit])
            cause = fields.pop("cause")
            # opened before any step was seen: placed once a step reaches its onset
            current = self.book.current(VerdictKind.LINK_DEGRADATION.value, culprit)
            if current is not None and current.step is None:
                step = self._step_reaching(self.onset_at[culprit][1])
                if step is not None:
                    fields["step"] = step
            if v := self.book.report(
                VerdictKind.LINK_DEGRADATION,
                cause,
                culprit,
                onset_step=None,
                onset_ns=0,
                detected_ns=rep.end_ns,
                severity=severity,
                confidence=0.9,
                **fields,
            ):
                out.append(v)
        return out

    def _burst(
        self, onset: int, ratio: float, length: int, rep: StepReport
    ) -> list[msgspec.Struct]:
        found = self._culprit(self._since(onset))
        if found is None:
            return []
        culprit, fields = found
        cause = fields.pop("cause")
        bursts = self.bursts.setdefault(culprit, [])
        bursts.append((onset, ratio, length))
        if len(bursts) < 2:
            return self._transient(culprit, cause, fields, onset, ratio, length, rep)
        first = bursts[0][0]
        span = max(1, rep.step - first + 1)
        extra = sum((r - 1) * n for _, r, n in bursts)
        severity = extra / (span + extra)
        fields["evidence"] = {
            **fields.get("evidence", {}),
            "bursts": float(len(bursts)),
            "mean_burst_ratio": float(np.mean([r for _, r, _ in bursts])),
            "burst_period_steps": float(np.mean(np.diff([b[0] for b in bursts]))),
        }
        who = texts.who(fields.get("rank"), fields.get("gpu"), fields.get("node"))
        fields["summary"] = (
            f"intermittent slowdown: {who or 'an unlocalised part of the job'} - "
            f"{texts.plural(len(bursts), 'burst')} of "
            f"~{fields['evidence']['mean_burst_ratio']:.2f}x since step "
            f"{first} ({texts.percent(severity)} throughput lost)"
        )
        reps = [r for r in self.recent if r.step == first]
        v = self.book.report(
            VerdictKind.INTERMITTENT_SLOWDOWN,
            cause,
            culprit,
            onset_step=first,
            onset_ns=reps[0].start_ns if reps else rep.start_ns,
            detected_ns=rep.end_ns,
            severity=severity,
            confidence=0.8,
            step=first,
            **fields,
        )
        return [v] if v else []

    def _transient(
        self,
        culprit: str,
        cause: Cause,
        fields: dict[str, Any],
        onset: int,
        ratio: float,
        length: int,
        rep: StepReport,
    ) -> list[msgspec.Struct]:
        """A straggler for a step or a few, over already: reported with its culprit and the
        time it cost, and resolved at once (a second one makes it intermittent). Only one
        that stands out: a rank or host named, and well over the noise (at least 1.5x,
        and twice the bar a shift must clear)."""
        if "rank" not in fields and not culprit.startswith("node:"):
            return []
        if ratio < 1.0 + max(0.5, 2 * self.shift.bar):
            return []
        reps = [r for r in self.recent if onset <= r.step < onset + length and r.complete]
        level = self._level_before_step(onset)
        lost = sum(max(0.0, r.duration_ns - level) for r in reps)
        fields["evidence"] = {
            **fields.get("evidence", {}),
            "time_lost_ns": float(lost),
            "steps": float(length),
            "step_time_ratio": float(ratio),
            "baseline_step_ns": float(level),
        }
        who = texts.who(fields.get("rank"), fields.get("gpu"), fields.get("node"))
        steps = f"step {onset}" if length == 1 else f"steps {onset}-{onset + length - 1}"
        fields["summary"] = (
            f"transient straggler: {who or 'an unlocalised part of the job'} - {steps} "
            f"{ratio:.2f}x slower, {lost / 1e9:.2f} s lost"
        )
        start = reps[0].start_ns if reps else rep.start_ns
        end = reps[-1].end_ns if reps else rep.end_ns
        v = self.book.report(
            VerdictKind.TRANSIENT_STRAGGLER,
            cause,
            culprit,
            onset_step=onset,
            onset_ns=start,
            detected_ns=rep.end_ns,
            severity=1.0 - 1.0 / ratio if ratio > 1 else 0.0,
            confidence=0.8 if culprit != "job" else 0.5,
            step=onset,
            **fields,
        )
        done = self.book.resolve(VerdictKind.TRANSIENT_STRAGGLER.value, culprit, end)
        return [x for x in (v, done) if x is not None]

    # ------------------------------------------------------------------ links
    def _edge_throughput(self, e: EdgeThroughput) -> list[msgspec.Struct]:
        """Link throughput measured from proxy summaries, for jobs without link samples.

        Used only once the warm-up steps passed without any link sample from the job's
        sources (which then have no NIC counters), with baselines of its own."""
        self.now_ns = max(self.now_ns, e.ts_ns)
        warm = self.recent and self.recent[-1].step >= self.settings.warmup_steps
        if warm:
            self.gpu_wait.update(e.src_rank, float(e.gpu_wait_ns))
        if self.link_seen or self.topo is None or not warm:
            return []
        topo = self.topo
        sample = LinkSample(
            job=self.job,
            node=topo.node(e.src_rank),
            rank=e.src_rank,
            ts_ns=e.ts_ns,
            window_ns=e.window_ns,
            nic=topo.nic(e.src_rank),
            src_rank=e.src_rank,
            dst_rank=e.dst_rank,
            dst_node=topo.node(e.dst_rank),
            dst_nic=topo.nic(e.dst_rank),
            size_bytes=e.size_bytes,
            throughput_gbps=e.throughput_gbps,
        )
        ev = self.proxy_links.update(sample)
        return [] if ev is None else self._link_event(ev, e.ts_ns)

    def _link_event(self, ev: LinkEvent, ts_ns: int) -> list[msgspec.Struct]:
        """A link that degraded or recovered (seen at ``ts_ns``): its verdict."""
        if self.topo is None:
            return []
        topo = self.topo
        edge = (ev.src_rank, ev.dst_rank)
        if ev.kind == "recovered":
            culprit = self.link_culprits.pop(edge, f"link:{ev.src_rank}->{ev.dst_rank}")
            self.link_onset.pop(edge, None)
            if culprit in self.link_culprits.values():
                return []  # other links of that NIC are still slow
            self.link_fields.pop(culprit, None)
            self._forget_onset(culprit)
            v = self.book.resolve(VerdictKind.LINK_DEGRADATION.value, culprit, ts_ns)
            return [v] if v else []
        step = reached = self._step_reaching(ev.onset_ns)
        if step is None and self.recent:  # samples ran ahead of the steps: extrapolate
            last = self.recent[-1]
            per_step = max(self.expected_step_ns() or last.duration_ns, 1)
            step = last.step + 1 + int(max(0, ev.onset_ns - last.end_ns) // per_step)
        # docs/method.md's decision table, last row: several slow links leaving one NIC are that NIC
        siblings = sorted(
            {d for (u, d) in self.link_culprits if u == ev.src_rank and d != ev.dst_rank}
        )
        if siblings:
            culprit = self.link_culprits[(ev.src_rank, siblings[0])]
            nic = f"{topo.node(ev.src_rank)}/{topo.nic(ev.src_rank)}"
            dsts = [*siblings, ev.dst_rank]
            fields: dict[str, Any] = {
                "cause": Cause.NIC,
                "rank": ev.src_rank,
                "node": topo.node(ev.src_rank),
                "gpu": topo.gpu(ev.src_rank),
                "link": nic,
                "src_rank": ev.src_rank,
                "dst_rank": None,
                "phase": Phase.TRANSFER,
                "pp_stage": topo.coords(ev.src_rank)[0],
            }
            summary = (
                f"NIC degradation: {nic} - {len(dsts)} links from it below their baselines "
                f"(towards ranks {', '.join(map(str, dsts))}; latest {ev.current_gbps:.0f} Gb/s, "
                f"{ev.drop:.0%} down)"
            )
        else:
            culprit = f"link:{ev.src_rank}->{ev.dst_rank}"
            link = topo.link_name(ev.src_rank, ev.dst_rank)
            fields = {
                "cause": Cause.NETWORK_LINK,
                "rank": ev.src_rank,
                "node": topo.node(ev.src_rank),
                "gpu": topo.gpu(ev.src_rank),
                "link": link,
                "src_rank": ev.src_rank,
                "dst_rank": ev.dst_rank,
                "phase": Phase.TRANSFER,
                "pp_stage": topo.coords(ev.src_rank)[0],
            }
            summary = (
                f"link degradation: {link} at {ev.current_gbps:.0f} Gb/s, "
                f"{ev.drop:.0%} below its {ev.baseline_gbps:.0f} Gb/s baseline"
            )
        self.link_culprits[edge] = culprit
        self.link_onset[edge] = ev.onset_ns
        self.link_fields[culprit] = fields
        self.onset_at.setdefault(culprit, (reached, ev.onset_ns))
        shifted = self.shift.shifted and self.recent
        severity = self._share(culprit, self.recent[-1].duration_ns) if shifted else 0.0
        report = dict(fields)
        cause = report.pop("cause")
        v = self.book.report(
            VerdictKind.LINK_DEGRADATION,
            cause,
            culprit,
            onset_step=None,
            onset_ns=ev.onset_ns,
            detected_ns=ts_ns,
            severity=severity,
            confidence=0.9,
            step=step,
            summary=summary,
            evidence={
                "baseline_gbps": ev.baseline_gbps,
                "current_gbps": ev.current_gbps,
                "drop": ev.drop,
                "slow_links_from_nic": float(len(siblings) + 1),
                **self.gpu_wait.evidence(ev.src_rank),
            },
            **report,
        )
        return [v] if v else []

    # ------------------------------------------------------------------ hangs
    def expected_step_ns(self) -> float | None:
        if not self.durations:
            return None
        return float(np.median(self.durations))

    def tick(self, now_ns: int, final: bool = False) -> list[msgspec.Struct]:
        """The hang watchdog (:meth:`HangWatch.tick`): call periodically with the current
        (event) time; ``final``: the input ended."""
        self.now_ns = max(self.now_ns, now_ns)
        if self.topo is None:
            return []
        view = JobView(self.topo, self.book, self.expected_step_ns() or 0.0, self.coll_now_ns,
                       self._place, self.settings)  # fmt: skip
        return self.hangs.tick(now_ns, view, final)

    def _place(
        self,
        diag: HangDiagnosis,
        partial: Instance | None,
        op: CollOp | None,
        sender_stage: int | None,
        receiver_stage: int | None,
    ) -> Position | None:
        """Where a hung call sits: where its folder places it, else the layout's schedule
        where the calls follow it."""
        assert self.topo is not None
        folder = self._folder(diag.comm_hash)
        note = next((n for (h, _, _), n in self.structure.items() if h == diag.comm_hash), None)
        if partial is not None and folder is not None:
            return folder.position(partial, now=True)
        if note is None or note.agrees:
            return self.topo.position(
                diag.comm_hash, diag.seq, op or CollOp.ALL_REDUCE, sender_stage, receiver_stage
            )
        return None

    def finish(self) -> list[msgspec.Struct]:
        """End of input: a hang it ended in (see :meth:`tick`), the steps still open
        closed, and a shift still waiting for link samples that will not come judged."""
        if self.assembler is None:
            return []
        out: list[msgspec.Struct] = self.tick(self.now_ns, final=True)
        for folder in self.folders.values():  # what the job's own folders still hold
            rows, items = folder.flush()
            out += [*rows, *self._from_folder(items)]
        for rep in self.assembler.flush():
            out += self._step(rep)
        if self.pending_shift is not None and self.recent:
            out += self._judge_shift(self.recent[-1], final=True)
        return out

    # ------------------------------------------------------------------ tables
    def _slowest_replica(self, rep: StepReport) -> int | None:
        slowest = rep.slowest_replicas(1)
        return slowest[0] if slowest else None

    def _critical_names(self, rep: StepReport) -> list[str]:
        from detectors.critical_path import critical_path

        d = self._slowest_replica(rep)
        if d is None or self.topo is None:
            return []
        cp = critical_path(rep.node_durations(d), self.topo.job.pp, self.topo.job.num_microbatches)
        return [f"{ph[0].upper()}{mb}s{s}" for s, ph, mb in cp.path]


def _kind_of(culprit: str) -> VerdictKind:
    """The kind of a step-time incident by its culprit: the network between nodes is a
    link's degradation, anyone else's a slowdown."""
    return VerdictKind.LINK_DEGRADATION if culprit.startswith("nodes:") else VerdictKind.SLOWDOWN


def _network(link: str) -> str:
    """'the network between a and b' for "a<->b", 'the network links of n' for one node."""
    nodes = link.split("<->")
    if len(nodes) == 1:
        return f"the network links of {nodes[0]}"
    return f"the network between {', '.join(nodes[:-1])} and {nodes[-1]}"


def _ranks_of(item: Any) -> tuple[int, ...]:
    """The ranks an item speaks of (checked against the layout)."""
    match item:
        case Instance():
            return item.ranks
        case Heartbeat():
            return (item.rank,)
        case ProxySummary():
            return (item.rank, item.peer)
        case LinkSample():
            return (item.rank, item.src_rank, item.dst_rank)
        case EdgeThroughput():
            return (item.src_rank, item.dst_rank)
        case NodeDigest():
            return tuple(r for ev, _ in item.links for r in (ev.src_rank, ev.dst_rank))
    return ()


def _item_time(item: Any) -> int:
    if isinstance(item, Instance):
        return max(item.arrival)
    return int(getattr(item, "ts_ns", 0))


def _describe(item: Any) -> bytes:
    """An item the flow made (not a record) as JSON, for its dead letter."""
    if isinstance(item, Instance):
        keys = ("comm_hash", "seq", "op", "sender", "comm_size", "ranks", "arrival")
        return msgspec.json.encode({"instance": {k: getattr(item, k) for k in keys}})
    return msgspec.json.encode({type(item).__name__: repr(item)[:2000]})


#: What the job does with each kind of item (anything else only moves its clock).
_HANDLERS: dict[type, Callable[[JobAnalyzer, Any], list[msgspec.Struct]]] = {
    StepPart: JobAnalyzer._part,
    CommStructure: JobAnalyzer._structure_in,
    Iteration: JobAnalyzer._iteration_in,
    LinkSample: JobAnalyzer._link_in,
    NodeDigest: JobAnalyzer._digest,
    EdgeThroughput: JobAnalyzer._edge_throughput,
    Heartbeat: JobAnalyzer._heartbeat_in,
    CommLiveness: JobAnalyzer._progress_in,
    Instance: JobAnalyzer._instance,
    ProxySummary: JobAnalyzer._proxy_in,
    JobInfo: JobAnalyzer._job_in,
    RankInfo: JobAnalyzer._meta_in,
    CommInfo: JobAnalyzer._meta_in,
}

__all__ = ["JobAnalyzer"]
