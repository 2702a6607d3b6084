"""Everything megatrace concludes about one job, from its aligned collectives and records.

:class:`JobAnalyzer` drives the job's detectors: it dispatches each input, keeps the
job's clock, folds the communicators that reach it unfolded, assembles steps
(:class:`~detectors.steps.StepAssembler`, the wait-time model) and writes their tables;
the incidents are its trackers': step-time shifts, stragglers and bursts
(:class:`~detectors.slowdown_tracker.SlowdownTracker`), links and NICs
(:class:`~detectors.link_tracker.LinkTracker`), hangs
(:class:`~detectors.watchdog.HangWatch`), sharing one verdict book and the job's
step-time ledger. Its inputs beside the collectives (heartbeats, proxies, links) are
handled in :mod:`detectors.job_inputs`. It is pure: time comes from the records (and
from :meth:`tick`, which the caller drives with event time), it does no I/O, and it
pickles. The same object runs in the Bytewax flow and offline.

Inputs: job metadata records; from the communicators,
:class:`~detectors.align.Instance` (complete or partial),
:class:`~detectors.parts.StepPart` (one communicator's or several merged),
:class:`~detectors.merge.CommLiveness`, :class:`~detectors.edges.EdgeThroughput`
and stuck :class:`ProxySummary`; from the nodes,
:class:`~detectors.node.NodeDigest` (or raw :class:`LinkSample`, which go
through a node analyzer kept here); :class:`Heartbeat`; other records only
move its clock. Outputs: :class:`AlignedCollective`, :class:`StepSummary`,
:class:`RankStep` and :class:`Verdict` records.

>>> from detectors.replay import Replay
>>> from producers.sim.scenarios import build
>>> run = build("slow-gpu", scale="tiny", seed=0, steps=40)
>>> [(v.kind.value, v.rank) for v in Replay().run(run.records()) if type(v).__name__ == "Verdict"]
[('slowdown', 7)]
>>> run.faults[0].rank
7
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np

from detectors import refusals
from detectors.align import Instance, OpenTimes, Passed
from detectors.aligned_rows import aligned_record
from detectors.changepoint import ShiftDetector
from detectors.cpu_wait import CpuWaits
from detectors.edges import EdgeThroughput
from detectors.gpu_wait import GpuWaitBaseline
from detectors.hang import HangDiagnosis
from detectors.incidents import StepTimeLedger
from detectors.job_folders import JobFolders
from detectors.job_inputs import Out, SideInputs
from detectors.link_tracker import LinkTracker
from detectors.merge import CommLiveness
from detectors.node import NodeAnalyzer, NodeDigest
from detectors.parts import StepPart
from detectors.saves import Saves
from detectors.slowdown_tracker import SlowdownTracker
from detectors.steps import StepAssembler, StepReport, step_tables
from detectors.topology import Position, Topology
from detectors.verdicts import VerdictBook
from detectors.watchdog import HangWatch, JobView
from schemas.config import DetectSettings
from schemas.enums import CollOp
from schemas.records import (
    CommInfo,
    Heartbeat,
    Iteration,
    JobInfo,
    LinkSample,
    ProxySummary,
    RankInfo,
)
from schemas.results import CommStructure

#: Records of a job held until its job record comes (they may overtake it); beyond, refused.
EARLY_HELD = 100_000


class JobAnalyzer(SideInputs):
    """The detectors of one job (see the module docstring)."""

    #: when the job was last started again (a rank's new process first beat; 0: never)
    restart_ns = 0

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
        shift = ShiftDetector(warmup=st.warmup_steps, min_shift=st.min_shift,
                              persistence=st.persistence, alpha=st.alpha)  # fmt: skip
        self.ledger = StepTimeLedger(shift, min_shift=st.min_shift)
        self.book = VerdictBook(self.job)
        # per sending rank: how late its sends find their data, against its own baseline
        self.gpu_wait = GpuWaitBaseline()
        self.cpu = CpuWaits()  # per rank: how long its threads waited for a CPU
        self.saves = Saves()  # per rank: when it saved checkpoints
        self.links = LinkTracker(self.book, self.ledger, self.gpu_wait, st.warmup_steps,
                                 st.link_drop)  # fmt: skip
        self.slowdowns = SlowdownTracker(
            self.book, self.ledger, self.links, self.gpu_wait, warmup=st.warmup_steps,
            node_margin=st.node_margin, alpha=st.alpha, host_lead_drop=st.host_lead_drop,
            link_wait_ms=st.link_wait_ms, settle_s=st.settle_s,
            transient_min_lost_ms=st.transient_min_lost_ms, cpu=self.cpu, saves=self.saves,
        )  # fmt: skip
        self.hangs = HangWatch()
        # per node: link samples against each link's baseline (the flow sends digests made
        # per node; raw samples given here go through the same analyzers)
        self.nodes: dict[str, NodeAnalyzer] = {}
        self.now_ns = 0  # the newest time any input showed
        self.coll_now_ns = 0  # the newest time the collective records showed
        self.durations: deque[int] = deque(maxlen=20)
        self.refused = 0  # items kept as dead letters: outside the layout, or no job record
        self.own = JobFolders()  # for instances that reach the job unfolded (see _instance)

    def __setstate__(self, state: dict[str, Any]) -> None:
        from detectors.job_compat import upgrade

        self.__dict__.update(upgrade(state))

    @property
    def recent(self) -> deque[StepReport]:
        """The job's most recent steps."""
        return self.ledger.recent

    # ------------------------------------------------------------------ inputs
    def update(self, item: Any) -> Out:
        kind = type(item)
        handle = _HANDLERS.get(kind)
        if handle is not None and self.topo is not None and not self._early:
            # the usual case: the job is known, nothing held back (thousands a step: the
            # check inline, not through _outside)
            if (
                kind in _CHECKED
                and (refused := refusals.outside(self.job, self.topo, item)) is not None
            ):
                self.refused += 1
                return [refused]
            return handle(self, item)
        if self.topo is None and not isinstance(item, JobInfo):
            if isinstance(item, RankInfo | CommInfo):
                self._pending_meta.append(item)
            elif len(self._early) < EARLY_HELD:  # records that overtook the job record
                self._early.append(item)
            else:  # bounded: beyond it, kept as dead letters, never silently dropped
                self.refused += 1
                return [refusals.no_job_record(self.job, item, EARLY_HELD)]
            return []
        out: Out = []
        if self._early and not isinstance(item, JobInfo | RankInfo | CommInfo):
            early, self._early = self._early, []  # the metadata burst is over: replay in order
            for rec in early:
                out += self.update(rec)
        handle = _HANDLERS.get(type(item))
        if handle is None:  # a record the analysis only keeps time by
            self._record_time(item)
            return out
        if self.topo is not None and (refused := self._outside(item)) is not None:
            return [*out, refused]
        return out + handle(self, item)

    def update_many(self, items: Iterable[Any]) -> Out:
        """Items in their order, as :meth:`update` takes each, and what it returns for all;
        a run of edges' throughputs in the layout (thousands a step at scale) together."""
        out: Out = []
        run: list[EdgeThroughput] = []
        world = self._world
        for item in items:
            if type(item) is EdgeThroughput and item.src_rank < world and item.dst_rank < world:
                run.append(item)
                continue
            if run:
                out += self._edges_in(run)
                run = []
            out += self.update(item)
            world = self._world  # (a job record, or the early records replayed)
        if run:
            out += self._edges_in(run)
        return out

    @property
    def _world(self) -> int:
        """The layout's ranks while items go straight to their handlers (-1: held)."""
        return -1 if self.topo is None or self._early else self.topo.job.world_size

    def _outside(self, item: Any) -> msgspec.Struct | None:
        assert self.topo is not None
        letter = refusals.outside(self.job, self.topo, item)
        if letter is not None:
            self.refused += 1
        return letter

    def _job_in(self, info: JobInfo) -> Out:
        # metadata keeps no time: it describes the job (read from a compacted topic, or
        # written by an importer ahead of the calls it inferred it from), it does not
        # say that the job's clock moved
        if self.topo is None:
            self.topo = Topology.from_job(info)
            for m in self._pending_meta:
                self.topo.add(m)
            self._pending_meta = []
            self.assembler = StepAssembler(self.topo)
        else:
            self.topo.add(info)
        return []

    def _meta_in(self, rec: RankInfo | CommInfo) -> Out:
        assert self.topo is not None
        self.topo.add(rec)
        return []

    def _structure_in(self, note: CommStructure) -> Out:
        """A communicator's step as its calls show it (stored; the job's account of where
        the layout does not hold)."""
        self.own.elsewhere.add(note.comm_hash)
        if note.clock == "learning":  # it will send parts: its steps wait for them
            if self.assembler is not None:
                self.assembler.expect(note.comm_hash)
            return []
        rows, items = self.own.noted(note)
        return [note, *rows, *self._from_folder(items)]

    def _progress_in(self, p: CommLiveness) -> Out:
        return self._progress(p.last_arrival_ns, p.last_end_ns)

    def _instance(self, inst: Instance) -> Out:
        """An instance that reached the job unfolded: partial (a hang's evidence), its
        completion, or one of a communicator whose folder had no schedule yet. A
        communicator whose folder works elsewhere (it sent parts or its structure) has
        its completions placed where that folder places them; the others' instances go
        through the job's own folder of the communicator (the same one)."""
        assert self.assembler is not None
        folder = self.own.folder(inst.comm_hash, self.topo) if self.topo is not None else None
        if not inst.complete:
            self.now_ns = max(self.now_ns, max(inst.arrival))
            self.coll_now_ns = max(self.coll_now_ns, max(inst.arrival))
            self.hangs.partial(inst)
            pos = folder.position(inst) if folder is not None else None
            return [aligned_record(self.job, self.topo, inst, pos)]
        self.hangs.completed(inst.key)
        out: Out = self._progress(max(inst.arrival), max(inst.end))
        if folder is None:  # a communicator the job has no record of
            return [aligned_record(self.job, self.topo, inst, None), *out]
        if inst.comm_hash in self.own.elsewhere:  # a partial one's completion: its step
            pos = folder.position(inst, now=True)  # is open, the newest marker's next at most
            out.insert(0, aligned_record(self.job, self.topo, inst, pos))
            for rep in self.assembler.add(inst, pos):
                out += self._step(rep)
            return out
        rows, items = folder.update(inst)
        return [*rows, *out, *self._from_folder(items)]

    def _from_folder(self, items: list[Any]) -> Out:
        out: Out = []
        for x in items:
            if isinstance(x, StepPart):
                out += self._part(x, own=True)
            elif isinstance(x, CommStructure):
                if x.clock == "learning":
                    if self.assembler is not None:
                        self.assembler.expect(x.comm_hash)
                    continue
                self.own.structure[(x.comm_hash, x.sender, x.receiver)] = x
                out.append(x)
            elif isinstance(x, Instance):
                out += self._instance(x)
        return out

    def _iteration_in(self, it: Iteration) -> Out:
        """One of the job's iteration markers: its own folders place steps by them."""
        out: Out = []
        for rows, items in self.own.mark(it):
            out += [*rows, *self._from_folder(items)]
        return out

    def _part(self, part: StepPart, own: bool = False) -> Out:
        """A communicator's folded share of a step (see :class:`~detectors.folder.StepFolder`);
        ``own``: from the job's own folder."""
        assert self.assembler is not None
        if not own:
            self.own.elsewhere.update(part.comms or (part.comm_hash,))
        out = self._progress(part.last_arrival, part.end)
        for rep in self.assembler.add_part(part):
            out += self._step(rep)
        return out

    def _progress(self, arrival_ns: int, end_ns: int) -> Out:
        """Collectives completed up to ``end_ns``: the job moves (and a hang may be over)."""
        self.now_ns = max(self.now_ns, arrival_ns, end_ns)
        self.coll_now_ns = max(self.coll_now_ns, arrival_ns, end_ns)
        return self.hangs.progress(end_ns, self.book)

    # ------------------------------------------------------------------ steps
    def _step(self, rep: StepReport) -> Out:
        """A closed step: its tables, then the step-time incidents. One that spans the job's
        restart (from a step its first start began to one its new start ended) is no
        step of either, and one the job spent saving a checkpoint (:meth:`_saved_in`) is
        its own pause: the detectors leave them out, as an incomplete step."""
        assert self.topo is not None
        if rep.start_ns < self.restart_ns <= rep.end_ns or self._saved_in(rep):
            rep.complete = False
        if rep.complete:
            self.durations.append(rep.duration_ns)
        self.recent.append(rep)
        assert self.assembler is not None
        baseline = self.ledger.shift.baseline
        tables = step_tables(self.job, self.topo, rep, self.assembler, baseline)
        out = [*tables, *self.slowdowns.step(rep, self.topo)]
        ranks, nodes = self.slowdowns.explained()
        return out + self.links.transfer_times(
            rep, self.topo, explained_ranks=ranks, explained_nodes=nodes,
            settling=self.slowdowns.pending is not None, cpu=self.cpu,
        )  # fmt: skip

    def _saved_in(self, rep: StepReport) -> bool:
        """Whether a rank saved a checkpoint through half the time step ``rep`` took over
        the usual or more, in a step at least twice the usual (a job that saves a little
        every step keeps its steps)."""
        saves = self.saves
        usual = self.expected_step_ns() if saves.spans or saves.under_way else None
        if not usual or rep.duration_ns < 2 * usual:
            return False
        return saves.most(rep.start_ns, rep.end_ns) >= (rep.duration_ns - usual) / 2

    # ------------------------------------------------------------------ hangs
    def expected_step_ns(self) -> float | None:
        if not self.durations:
            return None
        return float(np.median(self.durations))

    def tick(self, now_ns: int, final: bool = False, ended: str = "") -> Out:
        """The hang watchdog (:meth:`HangWatch.tick`): call periodically with the current
        (event) time; ``final``: the input ended."""
        self.now_ns = max(self.now_ns, now_ns)
        if self.topo is None:
            return []
        seen = self.assembler.last_seen if self.assembler is not None else lambda: None
        view = JobView(self.topo, self.book, self.expected_step_ns() or 0.0, self.coll_now_ns,
                       self._place, self.settings, seen)  # fmt: skip
        return self.hangs.tick(now_ns, view, final, ended)

    def _place(
        self,
        diag: HangDiagnosis,
        partial: Instance | None,
        op: CollOp | None,
        sender_stage: int | None,
        receiver_stage: int | None,
        at_ns: int,
    ) -> Position | None:
        """Where a hung call sits (see :meth:`JobFolders.hung_at`)."""
        assert self.topo is not None
        return self.own.hung_at(self.topo, diag, partial, op, (sender_stage, receiver_stage), at_ns)

    def finish(self) -> Out:
        """End of input: a hang it ended in (see :meth:`tick`), the steps still open
        closed, and a shift still waiting for link samples that will not come judged."""
        if self.assembler is None or self.topo is None:
            return []
        out: Out = self.tick(self.now_ns, final=True)
        for rows, items in self.own.flush():  # what the job's own folders still hold
            out += [*rows, *self._from_folder(items)]
        for rep in self.assembler.flush():
            out += self._step(rep)
        return out + self.slowdowns.finish(self.topo)


#: What the job does with each kind of item (anything else only moves its clock).
_HANDLERS: dict[type, Callable[[JobAnalyzer, Any], Out]] = {
    StepPart: JobAnalyzer._part,
    CommStructure: JobAnalyzer._structure_in,
    Iteration: JobAnalyzer._iteration_in,
    LinkSample: JobAnalyzer._link_in,
    NodeDigest: JobAnalyzer._digest,
    EdgeThroughput: JobAnalyzer._edge_throughput,
    Heartbeat: JobAnalyzer._heartbeat_in,
    CommLiveness: JobAnalyzer._progress_in,
    Instance: JobAnalyzer._instance,
    Passed: JobAnalyzer._passed,
    OpenTimes: JobAnalyzer._open_times_in,
    ProxySummary: JobAnalyzer._proxy_in,
    JobInfo: JobAnalyzer._job_in,
    RankInfo: JobAnalyzer._meta_in,
    CommInfo: JobAnalyzer._meta_in,
}
#: the kinds whose ranks are checked against the layout (the rest name none)
_CHECKED = frozenset(k for k in _HANDLERS if refusals.speaks_of_ranks(k))

__all__ = ["EARLY_HELD", "JobAnalyzer"]
