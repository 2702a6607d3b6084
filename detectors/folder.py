"""Fold one communicator's complete instances into per-step parts, its steps found from
the job itself.

At 4,096 ranks a step has about 120,000 collective instances; folding each one into
the job's step account in the job's single worker costs seconds per step.
:class:`StepFolder` does that folding per communicator instead, where the
communicator's records already are (one flow worker per communicator), and hands the
job one :class:`~detectors.parts.StepPart` per (communicator, step): the job merges
about one part per communicator per step. It also builds the stored row of each
instance it folds.

Which step an instance is in comes from the job (:mod:`detectors.step_clock`): its
iteration markers, else the recurring pattern of its calls, the layout's count a hint
that the calls must allow; where they agree with it, the layout's schedule also says
each instance's phase and micro-batch (the critical path needs them). Instances wait
(at most ``max_held``) until their step is known, and until the communicator's schedule
comes (beyond either bound they go to the job unchanged: folding and merging commute).
A partial instance goes to the job as it is, a hang's evidence; its completion is folded
here like any other (the job's steps count it once), and the job is told it is over.

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

from collections.abc import Iterable
from typing import Any

from detectors.align import Instance, Key, OpenTimes, Passed
from detectors.aligned_rows import instance_row
from detectors.folder_compat import restore
from detectors.parts import StepPart
from detectors.sealing import PartSealing
from detectors.step_clock import StepClock, by_role, layout_hint, learning_note, place
from detectors.topology import Position, Topology
from schemas.enums import CommRole, Phase
from schemas.results import AlignedCollective, CommStructure

Extent = tuple[int, int, int]  # an instance's first arrival, last arrival, last end
_UNKNOWN = Phase.UNKNOWN.value
#: a communicator's first calls, left out of how long its calls stay open (the ranks join
#: them at the pace they start at)
_START_CALLS = 2


class StepFolder(PartSealing):
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
    keep_rows
        Make each folded instance's stored row (False: an offline analysis that reads
        only the verdicts and steps).
    """

    #: how long instances may be held waiting for a step to be learned (event time)
    patience_ns = 30_000_000_000
    #: a marked step this long (event time) past its end, with no call of the
    #: communicator's since, is one it was idle in
    idle_ns = 1_000_000_000
    _clock_ns = 0  # the communicator's event time (set by expire)

    keep_rows = True  # (for one pickled before it could be told otherwise)

    def __init__(
        self, give_up_steps: int = 2, max_open_steps: int = 8, max_held: int = 8192,
        keep_rows: bool = True,
    ) -> None:  # fmt: skip
        if give_up_steps < 1 or max_open_steps < 1 or max_held < 1:
            raise ValueError("give_up_steps, max_open_steps and max_held must be at least 1")
        self.keep_rows = keep_rows
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
        self.clock = StepClock()  # how steps are found (see the module docstring)
        self._held: list[tuple[Instance, Extent]] = []
        self._early = []
        self._sealed_upto = -1  # marks: parts up to this step were sent
        self._last_call_ns = 0  # the newest first arrival of an instance folded or held
        self._sent: set[int] = set()  # marks: steps whose part was sent whole
        self._announced = False  # the job was told the communicator will send parts

    _announced = True  # (one resumed from a version that placed by the layout sent parts)
    #: complete instances folded, and the longest any stayed open (see OpenTimes)
    _opens = (0, 0)

    def __getstate__(self) -> dict[str, Any]:
        # the caches rebuild themselves: a snapshot keeps what was learned, not them
        return {k: v for k, v in self.__dict__.items() if k != "_where"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore(self, state)

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
        if self.topo is None or not self.clock.adopt(note):
            return [], []
        return self._release()

    def position(self, inst: Instance, now: bool = False) -> Position | None:
        """Where a (partial) instance sits, as far as this folder knows; ``now``: without
        waiting for a marker (one after the newest is in the step after it)."""
        if self.topo is None:
            return None
        first = min(inst.arrival)
        known = self.clock.knows((inst.sender, inst.receiver))
        step = self.clock.step_of(inst, first, force=now) if known else None
        if step is None:
            return None
        return self._place(inst, step)

    def position_at(self, ts_ns: int) -> Position | None:
        """Where a call that began at ``ts_ns`` sits by the job's iteration markers alone
        (its phase by the communicator's role); None without markers."""
        step = self.clock.step_at(ts_ns)
        if step is None or self.topo is None:
            return None
        return by_role(self.topo, self.comm_hash, self.role, step)

    def mark(
        self, step: int, end_ns: int, rank: int = -1
    ) -> tuple[list[AlignedCollective], list[Any]]:
        """One of the job's iteration markers: step ``step`` ended at ``end_ns`` on
        ``rank`` (-1: not told)."""
        if not self.clock.mark(step, end_ns, rank) or self.topo is None:
            return [], []  # known already, or kept until the schedule comes
        return self._release()

    def update(self, inst: Instance) -> tuple[list[AlignedCollective], list[Any]]:
        """A complete instance: (stored rows, items for the job)."""
        return self.update_many((inst,))

    def update_many(self, insts: Iterable[Instance]) -> tuple[list[AlignedCollective], list[Any]]:
        """Complete instances, in their order: (stored rows, items for the job). The parts
        they finish are sent once, after the last (a poll's batch, not each instance)."""
        rows: list[AlignedCollective] = []
        out: list[Any] = []
        unsealed = False
        for inst in insts:
            if self._partial and inst.key in self._partial:  # the job saw it partial: it
                self._partial.discard(inst.key)  # is over (folded here as any other)
                out.append(Passed(inst.job, inst.key))
            how = self._update(inst, rows, out)
            if how != "held":  # "sent": releasing held ones sent the parts done so far
                unsealed = how == "folded"
        if unsealed:
            out += self._done()
        return rows, out

    def _update(self, inst: Instance, rows: list[AlignedCollective], out: list[Any]) -> str:
        """Place ``inst`` or hold it; its row and what it released go to ``rows`` and
        ``out``: "folded" (the parts done not sent yet), "sent" (it released held ones,
        and the parts done were sent) or "held"."""
        if self.comm_hash < 0:
            self._name(inst)
        arrival = inst.arrival
        ext = (min(arrival), max(arrival), max(inst.end))
        if ext[1] > self._last_arrival:
            self._last_arrival = ext[1]
        if ext[2] > self._last_end:
            self._last_end = ext[2]
        n, longest = self._opens
        if n >= _START_CALLS and ext[2] - ext[0] > longest:
            longest = ext[2] - ext[0]
        self._opens = (n + 1, longest)
        if self.topo is None:
            out += self._before_schedule(inst)
            return "held"
        seq_key = (inst.sender, inst.receiver)
        if ext[0] > self._last_call_ns:
            self._last_call_ns = ext[0]
        hint = (
            0
            if seq_key in self.clock.cycles
            else layout_hint(self.topo, self.comm_hash, self.role, inst)
        )
        learned = self.clock.see(seq_key, inst.seq, (inst.op, inst.size_bytes), ext[0], hint)
        if not self._announced:  # told once, at its first instance: it will send parts
            self._announced = True
            out.append(learning_note(self.job, self.comm_hash, self.role, self._last_call_ns))
        if not self._held:
            step = self.clock.step_of(inst, ext[0], force=False)
            if step is not None:
                self._fold(inst, ext, step, rows)
                return "folded"
        self._held.append((inst, ext))  # after those held before it
        ends = self.clock.mark_ends
        if learned or len(self._held) > self.max_held:
            released = self._release(force=not learned)
        elif ends and ext[0] <= ends[-1]:  # late: its mark came
            released = self._release()
        else:
            return "held"
        rows += released[0]
        out += released[1]
        return "sent"

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
        if moved and self.clock.mark_ends and self._newest >= 0:
            return [], self._done()
        return [], []

    def partial(self, inst: Instance) -> list[Any]:
        """A partial instance goes to the job as it is (a hang's evidence); its completion
        is folded here, and the job told that it is over."""
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
        if self._opens[1]:
            out.append(OpenTimes(self.job, self.comm_hash, self._opens[1]))
        return rows, out

    def saw_time(self, ts_ns: int) -> None:
        """Another record of the communicator's (event time moves on)."""
        self._last_arrival = max(self._last_arrival, ts_ns)

    # ------------------------------------------------------------------ placing
    def _release(
        self, force: bool = False, final: bool = False
    ) -> tuple[list[AlignedCollective], list[Any]]:
        """Place the held instances whose steps are known now (all of them: ``force``);
        send the parts that are done."""
        rows: list[AlignedCollective] = []
        keep: list[tuple[Instance, Extent]] = []
        for inst, ext in self._held:
            step = self.clock.step_of(inst, ext[0], force)
            if step is None:
                keep.append((inst, ext))
            else:
                self._fold(inst, ext, step, rows)
        self._held = keep
        return rows, self._done(final)

    def _place(self, inst: Instance, step: int) -> Position:
        """:func:`~detectors.step_clock.place`, from what it said of the same place in an
        earlier step: a step's hundreds of instances sit where the step before's did."""
        assert self.topo is not None
        sender, receiver = inst.sender, inst.receiver
        agrees = self.clock.agree.get((sender, receiver), False)
        where = self._where
        if where is None or where[0] is not self.topo:  # (re)built with the topology
            placer = self.topo.placer(self.comm_hash)
            where = self._where = (self.topo, placer.period if placer else 1, {})
        key = (sender, receiver, inst.seq % where[1] if agrees else -1)
        got = where[2].get(key)
        if got is None:
            got = where[2][key] = place(self.topo, self.comm_hash, self.role, agrees, inst, 0)
        return Position(step, got[1], got[2], got[3], got[4])

    #: where the folder's instances sit in a step, by place (see :meth:`_place`): (the
    #: topology it holds for, the placer's period, place -> position)
    _where: tuple[Topology, int, dict[tuple[int, int, int], Position]] | None = None

    def _fold(self, inst: Instance, ext: Extent, step: int, rows: list[AlignedCollective]) -> None:
        topo = self.topo
        assert topo is not None
        pos = self._place(inst, step)
        part = self._parts.get(step)
        if part is None:
            part = self._parts[step] = StepPart(step, inst.comm_hash, inst.job)
        part.fold(inst, pos.phase, pos.microbatch, self.role, topo, ext)
        if step > self._newest:
            self._newest = step
        if self.keep_rows:
            rows.append(instance_row(inst.job, topo.comms.get(inst.comm_hash), inst, pos, *ext))

    def _name(self, inst: Instance) -> None:
        if self.comm_hash < 0:  # no schedule yet: the first instance says whose folder this is
            self.comm_hash, self.job = inst.comm_hash, inst.job

    @property
    def told_partial(self) -> set[Key]:
        """Instances the job was given as partial, whose completion has not come."""
        return self._partial

    @property
    def n_held(self) -> int:
        return len(self._held)

    @property
    def last_arrival_ns(self) -> int:
        """The newest arrival (or proxy activity) the communicator showed."""
        return self._last_arrival


__all__ = ["StepFolder"]
