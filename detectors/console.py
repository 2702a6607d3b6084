"""What a person reads on a console about a stream of verdict revisions.

The detectors revise an open incident whenever its figures move (its cost, its
evidence, the step it reached); ClickHouse and ``--json`` keep every revision.
A console shows a line when an incident opens, when its culprit, cause or alert
level changes or its cost moves by more than ``cost_step``, and when it
resolves; :meth:`IncidentLog.summary` ends a run with one table of incidents.

Parameters
----------
settings
    :class:`~schemas.config.AlertSettings`: the alert levels (info, warning,
    critical) a cost falls in, the same as the webhooks'.
cost_step
    How far an incident's cost (fraction of throughput) must move from the last
    line about it to be told again.
show_job
    Start each line with the job's id (a flow may watch several jobs).

>>> from schemas.records import Verdict
>>> from schemas.enums import Cause, VerdictKind, VerdictStatus
>>> def v(rev, sev, status=VerdictStatus.UPDATE, rank=15):
...     return Verdict(job="j", verdict_id="a1", revision=rev, status=status,
...                    kind=VerdictKind.SLOWDOWN, cause=Cause.COMPUTE, rank=rank, gpu=3,
...                    node="node-3", onset_step=18, onset_ns=0, detected_ns=rev,
...                    severity=sev, summary=f"slowdown: rank {rank} ({sev:.0%})")
>>> log = IncidentLog()
>>> log.update(v(0, 0.15, VerdictStatus.OPEN))
'[open    ] slowdown: rank 15 (15%)'
>>> log.update(v(1, 0.16)) is None  # its cost hardly moved: nothing to tell
True
>>> log.update(v(2, 0.24))
'[update  ] slowdown of rank 15 (GPU 3) on node-3: cost 15% -> 24% (level warning -> critical)'
>>> log.update(v(3, 0.24, rank=14))
'[update  ] slowdown of rank 14 (GPU 3) on node-3: culprit was rank 15 (GPU 3) on node-3'
>>> log.update(v(4, 0.24, VerdictStatus.RESOLVED, rank=14))
'[resolved] slowdown of rank 14 (GPU 3) on node-3 (since step 18, cost 24%)'
>>> print("\\n".join(log.summary()))
1 incident:
kind      culprit                    cause    from step  cost  status
slowdown  rank 14 (GPU 3) on node-3  compute         18   24%  resolved
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from detectors import texts
from detectors.alerting import level_of
from schemas.config import AlertSettings
from schemas.enums import AlertLevel, VerdictStatus
from schemas.results import Verdict


@dataclass
class _Told:
    culprit: str
    cause: str
    level: AlertLevel
    severity: float


class IncidentLog:
    """Console lines from verdict revisions (see the module docstring)."""

    def __init__(
        self,
        settings: AlertSettings | None = None,
        cost_step: float = 0.05,
        show_job: bool = False,
        max_incidents: int = 10_000,
    ) -> None:
        if not 0 < cost_step <= 1:
            raise ValueError(f"cost_step is a fraction of throughput in (0, 1], not {cost_step}")
        if max_incidents < 1:
            raise ValueError(f"max_incidents must be at least 1, not {max_incidents}")
        self.settings = settings or AlertSettings()
        self.cost_step = cost_step
        self.show_job = show_job
        self.max_incidents = max_incidents
        self._reset()

    def _reset(self) -> None:
        self._told: dict[str, _Told] = {}  # open incidents: what their last line said
        self._latest: dict[str, Verdict] = {}  # every incident's newest revision, oldest first

    def update(self, v: Verdict) -> str | None:
        """The line this revision calls for, or None."""
        self._latest.pop(v.verdict_id, None)
        self._latest[v.verdict_id] = v
        if len(self._latest) > self.max_incidents:  # bounded: the oldest incident goes
            self._latest.pop(next(iter(self._latest)))
        told = self._told.get(v.verdict_id)
        now = _Told(texts.culprit(v), texts.cause(v), level_of(v, self.settings), v.severity)
        if v.status is VerdictStatus.RESOLVED:
            self._told.pop(v.verdict_id, None)
            extra = [f"since step {_from_step(v)}" if _from_step(v) else ""]
            extra.append(f"cost {texts.cost(v)}" if texts.cost(v) else "")
            said = ", ".join(x for x in extra if x)
            return self._line("resolved", f"{_name(v)}" + (f" ({said})" if said else ""), v)
        self._told[v.verdict_id] = now
        if told is None:
            return self._line("open", v.summary or _name(v), v)
        changes = []
        if now.culprit != told.culprit:
            changes.append(f"culprit was {told.culprit}")
        if now.cause != told.cause:
            changes.append(f"cause {told.cause or 'unknown'} -> {now.cause or 'unknown'}")
        if abs(now.severity - told.severity) > self.cost_step:
            changes.append(f"cost {texts.percent(told.severity)} -> {texts.percent(v.severity)}")
        if now.level != told.level:
            level = f"level {told.level.value} -> {now.level.value}"
            if changes and changes[-1].startswith("cost"):
                changes[-1] += f" ({level})"
            else:
                changes.append(level)
        if not changes:
            self._told[v.verdict_id] = told  # compare the next revision with what was said
            return None
        return self._line("update", f"{_name(v)}: {'; '.join(changes)}", v)

    def updates(self, verdicts: Iterable[Verdict]) -> list[str]:
        """The lines for several revisions in order."""
        return [line for v in verdicts if (line := self.update(v)) is not None]

    def summary(
        self, judged: bool = True, steps: int | None = None, least_steps: int = 0
    ) -> list[str]:
        """One table of every incident seen, with its newest figures. Where there were
        none, says why that is no clean bill of health if it is not: nothing was
        ``judged`` (no collective call or link sample among the records), or the job's
        ``steps`` were fewer than the ``least_steps`` a slowdown takes to be told.

        >>> IncidentLog().summary(steps=4, least_steps=9)
        ['no incidents over 4 steps: too few to tell a slowdown (it takes 9)']
        """
        if not self._latest:
            if not judged:
                return [NOTHING_JUDGED]
            if steps is not None and steps < least_steps:
                return [
                    f"no incidents over {texts.plural(steps, 'step')}: too few to tell a "
                    f"slowdown (it takes {least_steps})"
                ]
        return summary_table(list(self._latest.values()))

    def _line(self, event: str, text: str, v: Verdict) -> str:
        job = f"{v.job}: " if self.show_job else ""
        return f"[{event:<8}] {job}{text}"


def _name(v: Verdict) -> str:
    return f"{texts.kind(v)} of {texts.culprit(v)}"


def _from_step(v: Verdict) -> str:
    step = v.onset_step if v.onset_step is not None else v.step
    return "" if step is None else str(step)


#: what the summary says where the records held no collective call and no link sample:
#: kernels alone (a profiler trace, CUPTI's activity) say nothing of who waited for whom
NOTHING_JUDGED = (
    "nothing judged: the records hold no collective call and no link sample (kernels "
    "are stored, not judged); read the job's calls: its MEGATRACE logs, Flight Recorder "
    "dumps, NCCL Inspector output, or the collector"
)


def summary_table(verdicts: list[Verdict]) -> list[str]:
    """A table of incidents (each verdict the newest revision of one), oldest first.

    >>> summary_table([])
    ['no incidents: the job looks healthy']
    """
    if not verdicts:
        return ["no incidents: the job looks healthy"]
    head = ("kind", "culprit", "cause", "from step", "cost", "status")
    rows = [
        (
            texts.kind(v),
            texts.culprit(v),
            texts.cause(v),
            _from_step(v),
            texts.cost(v),
            "resolved" if v.status is VerdictStatus.RESOLVED else "open",
        )
        for v in sorted(verdicts, key=lambda v: (v.onset_ns, v.verdict_id))
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    right = {3, 4}  # numbers

    def fmt(row: tuple[str, ...]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [f"{texts.plural(len(rows), 'incident')}:", fmt(head), *map(fmt, rows)]


__all__ = ["IncidentLog", "summary_table"]
