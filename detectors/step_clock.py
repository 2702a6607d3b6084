"""Which step a communicator's instance is in, learned from the job itself.

In this order of trust (see :mod:`detectors.folder`, whose folder keeps one):

1. **the job's iteration markers** (:class:`~detectors.schedule.StepMark`): an instance
   is in the first marked step that ended at or after it was called (by the rank that
   marks the steps, where it is a member);
2. **its calls** (:class:`~detectors.cycle.CallCycle`, one per sequence: the
   communicator's collectives, or one sender's transfers to one receiver): the
   recurring pattern of one step, with the layout's count as a hint that the calls must
   allow. Once two cycles' worth of a sequence's instances were placed by the markers,
   an offset nearly all of them share numbers its cycle as the markers do.

Each sequence's step is told once, as a :class:`~schemas.results.CommStructure`
(:func:`structure_note`), saying whether the layout holds.

>>> from schemas.enums import CollOp
>>> clock = StepClock()
>>> def call(seq):  # an all-reduce and two all-gathers a step
...     op = CollOp.ALL_REDUCE if seq % 3 == 0 else CollOp.ALL_GATHER
...     return clock.see((-1, -1), seq, (op, 8), 100 * seq, hint=3)
>>> [seq for seq in range(12) if call(seq)]  # learned at its third step
[8]
>>> c = clock.cycles[(-1, -1)].cycle
>>> c.period, c.step_of(10), clock.per_step()
(3, 3, 3)
>>> [(key, c.period, hint, agrees) for key, c, hint, agrees in clock.told_now(final=False)]
[((-1, -1), 3, 3, True)]
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from detectors.align import Instance
from detectors.cycle import CallCycle, Cycle
from detectors.topology import Position, Topology
from schemas.enums import CommRole, Phase
from schemas.results import CommStructure

SeqKey = tuple[int, int]  # (sender, receiver); (-1, -1) for a communicator's collectives
#: marks kept (a communicator needs the few around its open steps)
MARKS_KEPT = 256
#: marked steps a sequence's votes must span before its cycle is numbered as the marks
VOTE_STEPS = 3


class StepClock:
    """One communicator's steps: its sequences' cycles and the job's markers."""

    def __init__(self, trust_layout: bool = False) -> None:
        self.trust_layout = trust_layout  # place by the layout without learning
        self._reset()

    def _reset(self) -> None:
        self.cycles: dict[SeqKey, CallCycle] = {}  # sequence -> its learner
        self.agree: dict[SeqKey, bool] = {}  # its cycle agrees with the layout
        self.told: set[SeqKey] = set()  # sequences whose structure was told
        self.mark_ends: list[int] = []  # the job's iteration markers, by end
        self.mark_step: dict[int, int] = {}  # end -> step
        self.marker_rank = -1  # the rank whose markers the marks are
        # a sequence's offset from its cycle's steps to the marks' once its instances
        # agree on one, the votes so far, and those that never agreed
        self.offset: dict[SeqKey, int] = {}
        self.votes: dict[SeqKey, dict[int, int]] = {}
        self.voted_steps: dict[SeqKey, set[int]] = {}  # the marked steps the votes span
        self.distrust: set[SeqKey] = set()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"voted_steps": {}, **state})  # one pickled before it existed

    # ------------------------------------------------------------------ learning
    def see(self, key: SeqKey, seq: int, shape: Any, first_ns: int, hint: int) -> bool:
        """An instance of sequence ``key`` (its ``seq``, ``shape`` and first arrival);
        ``hint``: its instances a step by the layout (0: it says nothing). True when its
        cycle was learned with this one."""
        cycle = self.cycles.get(key)
        if cycle is None:
            if self.trust_layout and hint:  # resumed from a folder that placed by it
                cycle = CallCycle.known(Cycle(hint, 0, "layout"), hint)
                self.agree[key] = True
                self.told.add(key)
            else:
                cycle = CallCycle(hint=hint)
            self.cycles[key] = cycle
        return cycle.add(seq, shape, first_ns)

    def adopt(self, note: CommStructure) -> bool:
        """A sequence's step as another folder of the communicator learned it."""
        if note.per_step < 1:
            return False
        key = (note.sender, note.receiver)
        how = note.clock if note.clock != "marks" else "calls"
        self.cycles[key] = CallCycle.known(Cycle(note.per_step, note.anchor, how),
                                           note.layout_per_step)  # fmt: skip
        self.agree[key] = note.agrees
        self.told.add(key)  # told already, by the folder that learned it
        return True

    def mark(self, step: int, end_ns: int, rank: int = -1) -> bool:
        """One of the job's iteration markers (False: known already)."""
        if end_ns in self.mark_step:
            return False
        self.marker_rank = rank
        insort(self.mark_ends, end_ns)
        self.mark_step[end_ns] = step
        if len(self.mark_ends) > MARKS_KEPT:
            del self.mark_step[self.mark_ends.pop(0)]
        return True

    def told_now(self, final: bool) -> list[tuple[SeqKey, Cycle, int, bool]]:
        """Each sequence whose step was learned since (all of them: ``final``), once:
        (its key, cycle, layout hint, whether the layout holds)."""
        out = []
        for key, cycle in self.cycles.items():
            if key in self.told:
                continue
            c = cycle.cycle or (cycle.finish() if final else None)
            if c is None:
                continue
            self.told.add(key)
            agrees = bool(cycle.hint) and c.period == cycle.hint and c.anchor == 0
            self.agree[key] = agrees
            out.append((key, c, cycle.hint, agrees))
        return out

    # ------------------------------------------------------------------ placing
    def knows(self, key: SeqKey) -> bool:
        """Anything can place sequence ``key``: markers, or its cycle."""
        return bool(self.mark_ends) or key in self.cycles

    def step_of(self, inst: Instance, first: int, force: bool) -> int | None:
        """``inst``'s step (``first``: its first arrival); None while not known, unless
        ``force``: the best guess now."""
        key = (inst.sender, inst.receiver)
        cycle = self.cycles.get(key)
        c = None if cycle is None else cycle.cycle if not force else cycle.finish()
        ends = self.mark_ends
        if not ends:
            return None if c is None else c.step_of(inst.seq)
        offset = self.offset.get(key)
        if offset is not None and c is not None:  # its cycle, numbered as the marks
            return c.step_of(inst.seq) + offset
        i = bisect_left(ends, self._mark_time(inst))
        if i < len(ends):
            step = self.mark_step[ends[i]]
            if c is not None:
                self._vote(key, c, inst.seq, step)
            return step
        if not force:
            return None  # its step's marker has not come yet
        return self.mark_step[ends[-1]] + 1

    def step_at(self, ts_ns: int) -> int | None:
        """The marked step a call made at ``ts_ns`` is in: the first that ended at or after
        it, else the one after the newest; None without markers."""
        ends = self.mark_ends
        if not ends:
            return None
        i = bisect_left(ends, ts_ns)
        return self.mark_step[ends[i]] if i < len(ends) else self.mark_step[ends[-1]] + 1

    def marked_upto(self, ts_ns: int, final: bool) -> int:
        """The newest marked step that ended before ``ts_ns`` (every one: ``final``);
        -1 for none."""
        ends = self.mark_ends
        i = len(ends) if final else bisect_left(ends, ts_ns)
        return self.mark_step[ends[i - 1]] if i else -1

    def numbered(self) -> bool:
        """Every sequence's cycle is numbered as the marks."""
        return len(self.offset) == len(self.cycles)

    def per_step(self) -> int:
        """Instances a step holds on the communicator, by its cycles (0: not known)."""
        total = 0
        for cycle in self.cycles.values():
            if cycle.cycle is None:
                return 0
            total += cycle.cycle.period
        return total

    def _mark_time(self, inst: Instance) -> int:
        """When ``inst`` was called as the marks' clock sees it: by the rank that marks the
        steps where it is a member (the others may be a step ahead of it), else by the
        middle of its members' arrivals."""
        ranks = inst.ranks
        if self.marker_rank in ranks:
            return inst.arrival[ranks.index(self.marker_rank)]
        return sorted(inst.arrival)[len(ranks) // 2]

    def _vote(self, key: SeqKey, c: Cycle, seq: int, step: int) -> None:
        """Whether a sequence's learned cycle steps with the marks: once two cycles' worth
        of its instances, spread over three marked steps, were placed by the marks, an
        offset that nearly all of them share numbers its cycle as the marks (placed at
        once, whole steps, from then on); none after six cycles' worth, and the marks place
        it, instance by instance. The three steps matter: a cycle shorter than the step (a
        pattern that recurs within it) can agree with the marks by chance over two of its
        cycles that straddle one step's end, never over two ends."""
        if key in self.distrust:
            return
        votes = self.votes.setdefault(key, {})
        d = step - c.step_of(seq)
        votes[d] = votes.get(d, 0) + 1
        spanned = self.voted_steps.setdefault(key, set())
        spanned.add(step)
        total = sum(votes.values())
        if total < max(4, 2 * c.period):
            return
        best = max(votes, key=votes.__getitem__)
        if votes[best] >= 0.8 * total and len(spanned) >= VOTE_STEPS:
            self.offset[key] = best
        elif total >= 6 * c.period and len(spanned) >= VOTE_STEPS:
            self.distrust.add(key)
        else:
            return
        del self.votes[key], self.voted_steps[key]


def layout_hint(topo: Topology, comm_hash: int, role: CommRole, inst: Instance) -> int:
    """Instances of ``inst``'s sequence a step by the layout (0: it says nothing)."""
    if inst.sender < 0:
        return topo.instances_per_step(comm_hash)
    if role is CommRole.PP:  # one micro-batch's transfer each way
        return topo.job.num_microbatches
    return 0


def place(
    topo: Topology, comm_hash: int, role: CommRole, agrees: bool, inst: Instance, step: int
) -> Position:
    """Where ``inst`` sits in step ``step``: where the layout's schedule puts it if its
    sequence's calls agree with the layout (``agrees``), else by its communicator's role
    alone (a data-parallel one's is gradient sync)."""
    if agrees:
        pos = topo.place(inst.comm_hash, inst.seq, inst.op, inst.sender, inst.receiver)
        if pos is not None:
            return Position(step, pos.phase, pos.microbatch, pos.pp_stage, pos.layer)
    return by_role(topo, comm_hash, role, step)


def by_role(topo: Topology, comm_hash: int, role: CommRole, step: int) -> Position:
    """A call of a communicator in step ``step``, where no schedule places it: its phase by
    the communicator's role alone (a data-parallel one's is gradient sync)."""
    info = topo.comms.get(comm_hash)
    phase = Phase.DP_SYNC.value if role is CommRole.DP else Phase.UNKNOWN.value
    return Position(step, phase, None, info.pp_stage if info else None)


def learning_note(job: str, comm_hash: int, role: CommRole, ts_ns: int) -> CommStructure:
    """A communicator's step is being learned from its calls: it will send parts (the job
    waits for such a communicator's parts; for one never used, never)."""
    note = "its step is being learned from its calls"
    return CommStructure(job=job, comm_hash=comm_hash, ts_ns=ts_ns, role=role,
                         clock="learning", note=note)  # fmt: skip


def structure_note(
    job: str, comm_hash: int, role: CommRole, ts_ns: int, key: SeqKey, c: Cycle, hint: int,
    agrees: bool, marks: bool,
) -> CommStructure:  # fmt: skip
    """A sequence's step as its calls show it, for the job (``marks``: the job's iteration
    markers place its steps)."""
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
        job=job,
        comm_hash=comm_hash,
        ts_ns=ts_ns,
        role=role,
        sender=key[0],
        receiver=key[1],
        clock="marks" if marks else c.how,
        per_step=c.period,
        anchor=c.anchor,
        layout_per_step=hint,
        agrees=agrees,
        note=note,
    )


__all__ = [
    "MARKS_KEPT",
    "StepClock",
    "by_role",
    "layout_hint",
    "learning_note",
    "place",
    "structure_note",
]
