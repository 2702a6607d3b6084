"""Fold one communicator's complete instances into per-step parts, its steps found from
the job itself.

At 4,096 ranks a step has about 120,000 collective instances; folding each one into
the job's step account in the job's single worker costs seconds per step.
:class:`StepFolder` does that folding per communicator instead, where the
communicator's records already are (one flow worker per communicator), and hands the
job one :class:`~detectors.parts.StepPart` per (communicator, step): the job merges
about one part per communicator per step. It also builds the stored row of each
instance it folds.

Which step an instance is in comes from the job, in this order of trust:

1. **the job's iteration markers** (:class:`~detectors.schedule.StepMark`, from the
   training log, the profiler's step or the collector's step hook): an instance is in
   the first marked step that ended at or after its first member came;
2. **its calls** (:class:`~detectors.cycle.CallCycle`, one per sequence: the
   communicator's collectives, or one sender's transfers to one receiver): the
   recurring pattern of one step, with the layout's count (:class:`Topology`) as a
   hint that the calls must allow.

Where the calls agree with the layout (its count, and its steps beginning at the
first call), the layout's schedule also says each instance's phase and micro-batch
(the critical path needs them); otherwise they are unknown, and the disagreement is
told once, as a :class:`~schemas.records.CommStructure` for the job. Instances wait
(at most ``max_held``) until their step is known; until the communicator's schedule
is, and for instances the job already saw as partial, they go to the job unchanged
(folding and merging commute).

>>> from detectors.align import Instance
>>> from schemas.records import CommInfo, JobInfo
>>> from schemas.enums import CollOp, CommRole
>>> from detectors.schedule import CommSchedule
>>> job = JobInfo(job="j", ts_ns=0, world_size=4, tp=2, pp=1, dp=2, num_layers=1,
...               num_microbatches=1)
>>> folder = StepFolder()
>>> folder.learn(CommSchedule(job, CommInfo(job="j", ts_ns=0, comm_hash=7,
...     role=CommRole.DP, ranks=[0, 2], pp_stage=0)))  # no instance came before it
([], [])
>>> def inst(seq):  # one all-reduce a step, every 100 ms
...     t = 100_000_000 * seq
...     return Instance("j", 7, seq, CollOp.ALL_REDUCE, -1, 2, 8, (0, 2), (t, t + 2),
...                     (t, t + 2), (t + 9, t + 9))
>>> out = [folder.update(inst(s)) for s in range(4)]
>>> [x.note for x in out[0][1]], out[0][0], out[1]  # held until the calls show a step
(['its step is being learned from its calls'], [], ([], []))
>>> rows, items = out[2]  # three steps seen: one instance each, as the layout says
>>> [(type(x).__name__, getattr(x, "step", None)) for x in items]
[('CommStructure', None), ('StepPart', 0), ('StepPart', 1), ('StepPart', 2)]
>>> items[0].note, [r.step for r in rows]
('1 instance a step, as the layout says', [0, 1, 2])
>>> [p.step for p in out[3][1]]
[3]
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from detectors.align import Instance, Key, instance_row
from detectors.cycle import CallCycle, Cycle
from detectors.parts import StepPart
from detectors.topology import Position, Topology
from schemas.enums import CollOp, CommRole, Phase
from schemas.records import AlignedCollective, CommStructure

Extent = tuple[int, int, int]  # an instance's first arrival, last arrival, last end
_UNKNOWN = Phase.UNKNOWN.value
#: marks kept (a communicator needs the few around its open steps)
_MARKS_KEPT = 256


class StepFolder:
    """Per-communicator pre-aggregation (see the module docstring).

    Parameters
    ----------
    give_up_steps
        A step's part is sent incomplete once an instance this many steps later
        arrives (the job's assembler gives up on a step two steps later too).
    max_open_steps
        Hard bound on the steps held open; the oldest is sent beyond it.
    max_held
        The most instances held while their steps are not known yet; beyond it the
        calls so far decide.
    """

    #: how long instances may be held waiting for a step to be learned (event time)
    patience_ns = 30_000_000_000
    #: a marked step this long (event time) past its end, with no call of the
    #: communicator's since, is one it was idle in
    idle_ns = 1_000_000_000
    _clock_ns = 0  # the communicator's event time (set by expire)

    def __init__(self, give_up_steps: int = 2, max_open_steps: int = 8, max_held: int = 8192):
        if give_up_steps < 1 or max_open_steps < 1 or max_held < 1:
            raise ValueError("give_up_steps, max_open_steps and max_held must be at least 1")
        self.give_up_steps = give_up_steps
        self.max_open_steps = max_open_steps
        self.max_held = max_held
        self._reset()

    def _reset(self) -> None:
        self.topo: Topology | None = None
        self.comm_hash = -1
        self.job = ""
        self.role = CommRole.OTHER
        self._parts: dict[int, StepPart] = {}
        self._newest = -1
        self._partial: set[Key] = set()
        self._last_arrival = 0
        self._last_end = 0
        self._reported = (0, 0)
        # how steps are found (see the module docstring)
        self.cycles: dict[tuple[int, int], CallCycle] = {}  # (sender, receiver) -> learner
        self._agree: dict[tuple[int, int], bool] = {}  # its cycle agrees with the layout
        self._told: set[tuple[int, int]] = set()  # sequences whose structure was told
        self._mark_ends: list[int] = []  # the job's iteration markers, by end
        self._mark_step: dict[int, int] = {}  # end -> step
        self._held: list[tuple[Instance, Extent]] = []
        self._early = []
        self._sealed_upto = -1  # marks: parts up to this step were sent
        self._last_call_ns = 0  # the newest first arrival of an instance folded or held
        self._marker_rank = -1  # the rank whose markers the marks are
        # marks and cycles: a sequence's offset from its cycle's steps to the marks' once
        # its instances agree on one, the votes so far, and those that never agreed
        self._offset: dict[tuple[int, int], int] = {}
        self._votes: dict[tuple[int, int], dict[int, int]] = {}
        self._distrust: set[tuple[int, int]] = set()
        self._sent: set[int] = set()  # marks: steps whose part was sent whole
        self._announced = False  # the job was told the communicator will send parts

    #: place by the layout without learning: a folder resumed from a version that did
    _trust_layout = False
    _announced = True  # (one resumed from such a version sent parts already)

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "cycles" in state:
            self.__dict__.update(state)
            return
        # pickled by a version that placed every instance by the layout: it goes on so
        self._reset()
        self._trust_layout = True
        kept = ("topo", "comm_hash", "job", "role", "_parts", "_newest", "_partial",
                "_last_arrival", "_last_end", "_reported")  # fmt: skip
        for name in kept:
            if name in state:
                setattr(self, name, state[name])

    # ------------------------------------------------------------------ inputs
    def learn(self, schedule: Any) -> tuple[list[AlignedCollective], list[Any]]:
        """The communicator's schedule (again, when the job record changes); the instances
        that came before it, folded now: (stored rows, items for the job)."""
        topo = Topology.from_job(schedule.job)
        topo.add(schedule.comm)
        self.topo, self.role = topo, schedule.comm.role
        self.comm_hash, self.job = schedule.comm.comm_hash, schedule.comm.job
        early, self._early = self._early, []
        rows: list[AlignedCollective] = []
        out: list[Any] = []
        for inst in early:
            r, o = self.update(inst)
            rows += r
            out += o
        return rows, out

    #: complete instances that came before the communicator's schedule (none, for one
    #: pickled by a version that sent them to the job)
    _early: list[Instance] = []  # noqa: RUF012 - never changed in place (see below)

    def _before_schedule(self, inst: Instance) -> list[Any]:
        """A complete instance before the schedule: held, so that one folder places all of
        the communicator's instances (its schedule crosses from another partition, and may
        come after its first records); the job gets them as they are only when too many
        wait, or too long (:meth:`expire`): a communicator with no record of its own."""
        if "_early" not in self.__dict__:  # resumed from a version without it
            self._early = []
        self._early.append(inst)
        if len(self._early) > self.max_held:
            return self._give_early()
        return []

    def _give_early(self) -> list[Any]:
        early, self._early = self._early, []
        return list(early)

    def adopt(self, note: CommStructure) -> tuple[list[AlignedCollective], list[Any]]:
        """A sequence's step as another folder of this communicator learned it (the job's
        own folder, for the instances that reached it unfolded)."""
        seq_key = (note.sender, note.receiver)
        if note.per_step < 1 or self.topo is None:
            return [], []
        how = note.clock if note.clock != "marks" else "calls"
        cycle = Cycle(note.per_step, note.anchor, how)
        self.cycles[seq_key] = CallCycle.known(cycle, note.layout_per_step)
        self._agree[seq_key] = note.agrees
        self._told.add(seq_key)  # told already, by the folder that learned it
        return self._release()

    def position(self, inst: Instance, now: bool = False) -> Position | None:
        """Where a (partial) instance sits, as far as this folder knows; ``now``: without
        waiting for a marker (one after the newest is in the step after it)."""
        if self.topo is None:
            return None
        first = min(inst.arrival)
        step = self._step_of(inst, first, force=now) if (
            self._mark_ends or (inst.sender, inst.receiver) in self.cycles
        ) else None  # fmt: skip
        if step is None:
            return None
        return self._position(inst, step)

    def mark(
        self, step: int, end_ns: int, rank: int = -1
    ) -> tuple[list[AlignedCollective], list[Any]]:
        """One of the job's iteration markers: step ``step`` ended at ``end_ns`` on
        ``rank`` (-1: not told)."""
        if end_ns in self._mark_step or self.topo is None:
            return [], []
        self._marker_rank = rank
        insort(self._mark_ends, end_ns)
        self._mark_step[end_ns] = step
        if len(self._mark_ends) > _MARKS_KEPT:
            del self._mark_step[self._mark_ends.pop(0)]
        return self._release()

    def update(self, inst: Instance) -> tuple[list[AlignedCollective], list[Any]]:
        """A complete instance: (stored rows, items for the job)."""
        self._name(inst)
        arrival = inst.arrival
        ext = (min(arrival), max(arrival), max(inst.end))
        if ext[1] > self._last_arrival:
            self._last_arrival = ext[1]
        if ext[2] > self._last_end:
            self._last_end = ext[2]
        if self._partial and inst.key in self._partial:  # the job saw it partial
            self._partial.discard(inst.key)
            return [], [inst]
        if self.topo is None:
            return [], self._before_schedule(inst)
        seq_key = (inst.sender, inst.receiver)
        self._last_call_ns = max(self._last_call_ns, ext[0])
        cycle = self.cycles.get(seq_key)
        if cycle is None:
            hint = self._hint(inst)
            if self._trust_layout and hint:  # resumed from a folder that placed by it
                cycle = CallCycle.known(Cycle(hint, 0, "layout"), hint)
                self._agree[seq_key] = True
                self._told.add(seq_key)
            else:
                cycle = CallCycle(hint=hint)
            self.cycles[seq_key] = cycle
        learned = cycle.add(inst.seq, (inst.op, inst.size_bytes), ext[0])
        hello = [] if self._announced else self._hello()
        if not self._held:
            step = self._step_of(inst, ext[0], force=False)
            if step is not None:
                return [self._fold(inst, ext, step)], [*hello, *self._done()]
        self._held.append((inst, ext))  # after those held before it
        if learned or len(self._held) > self.max_held:
            rows, out = self._release(force=not learned)
            return rows, [*hello, *out]
        if self._mark_ends and ext[0] <= self._mark_ends[-1]:  # late: its mark came
            rows, out = self._release()
            return rows, [*hello, *out]
        return [], hello

    def _hello(self) -> list[CommStructure]:
        """Told once, at the communicator's first instance: it will send parts (the job
        waits for a communicator whose step is being learned; one never used, never)."""
        self._announced = True
        return [
            CommStructure(
                job=self.job,
                comm_hash=self.comm_hash,
                ts_ns=self._last_call_ns,
                role=self.role,
                clock="learning",
                note="its step is being learned from its calls",
            )
        ]

    def expire(self, now_ns: int) -> tuple[list[AlignedCollective], list[Any]]:
        """Event time moved on to ``now_ns``: instances held longer than ``patience_ns``
        while no step could be learned from them (a communicator with a few calls at
        start-up and none since) are placed by what there is, so that the job does not
        wait for their communicator; marked steps the communicator's clock went past by
        ``idle_ns`` are done (it was idle in them)."""
        moved = now_ns > self._clock_ns
        if moved:
            self._clock_ns = now_ns
        if self._early and now_ns - min(self._early[0].arrival) >= self.patience_ns:
            return [], self._give_early()
        if self._held and now_ns - self._held[0][1][0] >= self.patience_ns:
            return self._release(force=True)
        if moved and self._mark_ends and self._newest >= 0:
            return [], self._done()
        return [], []

    def partial(self, inst: Instance) -> list[Any]:
        """A partial instance goes to the job as it is; so will its completion."""
        self._name(inst)
        self._last_arrival = max(self._last_arrival, max(inst.arrival))
        self._partial.add(inst.key)
        if len(self._partial) > 4096:
            self._partial.pop()
        return [inst]

    def progress(self) -> list[Any]:
        """The communicator's liveness, when it moved since the last call."""
        from detectors.merge import CommLiveness

        now = (self._last_arrival, self._last_end)
        if now == self._reported:
            return []
        self._reported = now
        return [CommLiveness(self.job, self.comm_hash, *now)]

    def flush(self) -> tuple[list[AlignedCollective], list[Any]]:
        """Every held instance placed as best it can be, and every open part, oldest first
        (end of a bounded input): (stored rows, items for the job)."""
        rows, out = self._release(force=True, final=True)
        out = [*self._give_early(), *out, *(self._parts[s].seal() for s in sorted(self._parts))]
        self._parts = {}
        return rows, out

    def saw_time(self, ts_ns: int) -> None:
        """Another record of the communicator's (event time moves on)."""
        self._last_arrival = max(self._last_arrival, ts_ns)

    # ------------------------------------------------------------------ placing
    def _hint(self, inst: Instance) -> int:
        """Instances of ``inst``'s sequence a step by the layout (0: it says nothing)."""
        topo = self.topo
        assert topo is not None
        if inst.sender < 0:
            return topo.instances_per_step(self.comm_hash)
        if self.role is CommRole.PP:  # one micro-batch's transfer each way
            return topo.job.num_microbatches
        return 0

    def _release(
        self, force: bool = False, final: bool = False
    ) -> tuple[list[AlignedCollective], list[Any]]:
        """Place the held instances whose steps are known now (all of them: ``force``);
        send the parts that are done."""
        rows: list[AlignedCollective] = []
        keep: list[tuple[Instance, Extent]] = []
        for inst, ext in self._held:
            step = self._step_of(inst, ext[0], force)
            if step is None:
                keep.append((inst, ext))
            else:
                rows.append(self._fold(inst, ext, step))
        self._held = keep
        return rows, self._done(final)

    def _done(self, final: bool = False) -> list[Any]:
        out: list[Any] = self._structure(final)
        if self._mark_ends:
            return out + self._sealed_by_marks(final)
        return out + self._sealed_by_counts()

    def _step_of(self, inst: Instance, first: int, force: bool) -> int | None:
        seq_key = (inst.sender, inst.receiver)
        cycle = self.cycles.get(seq_key)
        c = None if cycle is None else cycle.cycle if not force else cycle.finish()
        ends = self._mark_ends
        if not ends:
            return None if c is None else c.step_of(inst.seq)
        offset = self._offset.get(seq_key)
        if offset is not None and c is not None:  # its cycle, numbered as the marks
            return c.step_of(inst.seq) + offset
        i = bisect_left(ends, self._mark_time(inst))
        if i < len(ends):
            step = self._mark_step[ends[i]]
            if c is not None:
                self._vote(seq_key, c, inst.seq, step)
            return step
        if not force:
            return None  # its step's marker has not come yet
        return self._mark_step[ends[-1]] + 1

    def _mark_time(self, inst: Instance) -> int:
        """When ``inst`` was called as the marks' clock sees it: by the rank that marks the
        steps where it is a member (the others may be a step ahead of it), else by the
        middle of its members' arrivals."""
        ranks = inst.ranks
        if self._marker_rank in ranks:
            return inst.arrival[ranks.index(self._marker_rank)]
        return sorted(inst.arrival)[len(ranks) // 2]

    def _vote(self, seq_key: tuple[int, int], c: Cycle, seq: int, step: int) -> None:
        """Whether a sequence's learned cycle steps with the marks: once two cycles' worth
        of its instances were placed by the marks, an offset that nearly all of them
        share numbers its cycle as the marks (placed at once, whole steps, from then on);
        none after six, and the marks place it, instance by instance."""
        if seq_key in self._distrust:
            return
        votes = self._votes.setdefault(seq_key, {})
        d = step - c.step_of(seq)
        votes[d] = votes.get(d, 0) + 1
        total = sum(votes.values())
        if total < max(4, 2 * c.period):
            return
        best = max(votes, key=votes.__getitem__)
        if votes[best] >= 0.8 * total:
            self._offset[seq_key] = best
            del self._votes[seq_key]
        elif total >= 6 * c.period:
            self._distrust.add(seq_key)
            del self._votes[seq_key]

    def _position(self, inst: Instance, step: int) -> Position:
        topo = self.topo
        assert topo is not None
        if self._agree.get((inst.sender, inst.receiver)):
            pos = topo.place(inst.comm_hash, inst.seq, inst.op, inst.sender, inst.receiver)
            if pos is not None:
                return Position(step, pos.phase, pos.microbatch, pos.pp_stage, pos.layer)
        return Position(step, _phase(self.role, inst.op), None, self._stage())

    def _fold(self, inst: Instance, ext: Extent, step: int) -> AlignedCollective:
        topo = self.topo
        assert topo is not None
        pos = self._position(inst, step)
        part = self._parts.get(step)
        if part is None:
            part = self._parts[step] = StepPart(step, inst.comm_hash, inst.job)
        part.fold(inst, pos.phase, pos.microbatch, self.role, topo, ext)
        if step > self._newest:
            self._newest = step
        return instance_row(inst.job, topo.comms.get(inst.comm_hash), inst, pos, *ext)

    def _stage(self) -> int | None:
        info = self.topo.comms.get(self.comm_hash) if self.topo else None
        return info.pp_stage if info else None

    def _per_step(self) -> int:
        """Instances a step holds on this communicator, by its cycles (0: not known)."""
        total = 0
        for cycle in self.cycles.values():
            if cycle.cycle is None:
                return 0
            total += cycle.cycle.period
        return total

    def _sealed_by_counts(self) -> list[StepPart]:
        """Cycles: a part is done when it holds a step's instances, or given up on once
        an instance ``give_up_steps`` later came."""
        per_step = self._per_step()
        done = {s for s, p in self._parts.items() if per_step and p.n >= per_step}
        done.update(s for s in self._parts if s <= self._newest - self.give_up_steps)
        if len(self._parts) - len(done) > self.max_open_steps:
            done.add(min(s for s in self._parts if s not in done))
        # in step order: the job takes a communicator's later step for a sign that it is
        # done with the earlier ones
        return [self._parts.pop(s).seal() for s in sorted(done)]

    def _sealed_by_marks(self, final: bool) -> list[StepPart]:
        """Marks: a marked step's part is done once the communicator's calls went past its
        end, or its clock did by ``idle_ns`` (it was idle); never because later steps'
        markers came (they come on another topic, read at its own pace: steps ahead of a
        communicator read late). A step it had nothing in since it first took part is
        sent empty, so that the job need not wait for it; a part of a step already sent
        (an instance completed late) goes at once."""
        if self._newest < 0:
            return []  # it took part in no step yet
        ends = self._mark_ends
        passed = max(self._last_arrival, self._clock_ns - self.idle_ns)
        i = len(ends) if final else bisect_left(ends, passed)
        done_upto = self._mark_step[ends[i - 1]] if i else -1  # -1: none ended before
        # every sequence numbered by its cycle: a step is done when it holds a step's
        # instances; the marks only give up on it a step later
        whole = len(self._offset) == len(self.cycles) and not final
        per_step = self._per_step() if whole else 0
        if per_step:
            done_upto -= 1
        full = [s for s, p in self._parts.items() if per_step and p.n >= per_step]
        out = [self._parts.pop(s).seal() for s in sorted(self._parts)
               if s <= self._sealed_upto or s in full]  # fmt: skip
        self._sent.update(p.step for p in out if p.step > self._sealed_upto)
        if self._sealed_upto < 0 and (self._parts or out):
            self._sealed_upto = min([*self._parts, *(p.step for p in out)]) - 1
        for s in range(self._sealed_upto + 1, done_upto + 1):
            part = self._parts.pop(s, None)
            if part is not None or s not in self._sent:
                out.append((part or StepPart(s, self.comm_hash, self.job)).seal())
            self._sent.discard(s)
        self._sealed_upto = max(self._sealed_upto, done_upto)
        if len(self._parts) > self.max_open_steps:  # bounded, whatever the marks say
            out.append(self._parts.pop(min(self._parts)).seal())
        return out

    # ------------------------------------------------------------------ structure
    def _structure(self, final: bool) -> list[CommStructure]:
        """Each sequence's step, once learned, told once; whether the layout holds."""
        out = []
        for seq_key, cycle in self.cycles.items():
            if seq_key in self._told:
                continue
            c = cycle.cycle or (cycle.finish() if final else None)
            if c is None:
                continue
            self._told.add(seq_key)
            agrees = bool(cycle.hint) and c.period == cycle.hint and c.anchor == 0
            self._agree[seq_key] = agrees
            out.append(self._note(seq_key, c, cycle.hint, agrees))
        return out

    def _note(self, seq_key: tuple[int, int], c: Cycle, hint: int, agrees: bool) -> CommStructure:
        marks = bool(self._mark_ends)
        what = f"{c.period} instance{'s' if c.period != 1 else ''} a step"
        if agrees:
            note = f"{what}, as the layout says"
        elif hint:
            begins = f", beginning at its call {c.anchor + 1}" if c.anchor else ""
            note = f"its calls repeat every {what}{begins}; the layout says {hint}"
        else:
            note = f"its calls repeat every {what} (the layout says nothing)"
        if marks:
            note += "; the job's iteration markers place its steps"
        return CommStructure(
            job=self.job,
            comm_hash=self.comm_hash,
            ts_ns=self._last_call_ns,
            role=self.role,
            sender=seq_key[0],
            receiver=seq_key[1],
            clock="marks" if marks else c.how,
            per_step=c.period,
            anchor=c.anchor,
            layout_per_step=hint,
            agrees=agrees,
            note=note,
        )

    def _name(self, inst: Instance) -> None:
        if self.comm_hash < 0:  # no schedule yet: the first instance says whose folder this is
            self.comm_hash, self.job = inst.comm_hash, inst.job

    @property
    def told_partial(self) -> set[Key]:
        """Instances the job was given as partial, whose completion has not come."""
        return self._partial

    @property
    def per_step(self) -> int:
        """Instances a step holds on this communicator, as its calls show (0: not known)."""
        return self._per_step()

    @property
    def n_open(self) -> int:
        return len(self._parts)

    @property
    def n_held(self) -> int:
        return len(self._held)

    @property
    def last_arrival_ns(self) -> int:
        """The newest arrival (or proxy activity) the communicator showed."""
        return self._last_arrival


def _phase(role: CommRole, op: CollOp) -> str:
    """The phase a communicator's instance is in where the schedule is not known."""
    if role is CommRole.DP:
        return Phase.DP_SYNC.value
    return _UNKNOWN


__all__ = ["StepFolder"]
