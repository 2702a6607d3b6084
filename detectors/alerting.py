"""Which verdicts become alerts: one message per incident, its updates, its resolution.

The detectors already fuse evidence into one verdict per incident (a hang that
makes hundreds of ranks wait is one verdict naming one culprit), and a verdict
is re-issued with a higher ``revision`` as it changes. :class:`AlertGate` turns
that stream into what a person wants on a pager:

- an ``open`` alert the first time an incident is seen;
- an ``update`` only when its level changes, or its severity moved by at least
  ``severity_step`` and ``update_interval_s`` of job time passed since the last
  message about it;
- a ``resolved`` alert when it resolves (only for incidents that were announced);
- at most ``max_incidents_per_hour`` new incidents announced per job per hour
  of job time; the rest are counted and the count rides on the next alert.

Time comes from the verdicts (``detected_ns``), never the wall clock, so a
replay gives the same alerts; the gate pickles with the flow's state, so a
resumed flow does not announce again what it already announced.

Parameters
----------
settings
    :class:`~schemas.config.AlertSettings` (levels, step, interval, cap).

>>> from schemas.records import Verdict
>>> from schemas.enums import VerdictKind, Cause, VerdictStatus
>>> def v(rev, sev, t, status=VerdictStatus.UPDATE):
...     return Verdict(job="j", verdict_id="abc", revision=rev, status=status,
...                    kind=VerdictKind.SLOWDOWN, cause=Cause.COMPUTE, rank=3,
...                    onset_ns=0, detected_ns=t, severity=sev)
>>> gate = AlertGate()
>>> [(a.event.value, a.level.value) for a in gate.update(v(0, 0.12, 0, VerdictStatus.OPEN))]
[('open', 'warning')]
>>> gate.update(v(1, 0.13, 10**9))  # a small change: no message
[]
>>> [(a.event.value, a.level.value) for a in gate.update(v(2, 0.31, 2 * 10**9))]
[('update', 'critical')]
>>> [a.event.value for a in gate.update(v(3, 0.0, 3 * 10**9, VerdictStatus.RESOLVED))]
['resolved']
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.config import AlertSettings
from schemas.enums import AlertLevel, VerdictKind, VerdictStatus
from schemas.results import Alert, Verdict

_HOUR_NS = 3_600_000_000_000


@dataclass
class _Sent:
    level: AlertLevel
    severity: float
    at_ns: int


def level_of(v: Verdict, settings: AlertSettings) -> AlertLevel:
    """Hangs are critical; a transient straggler is information (it was over when it
    was told: its severity is the share of its few steps it cost, and a pager woken
    for a step's hiccup learns nothing to act on; its return is an intermittent
    slowdown, levelled by what it costs over time); otherwise by the throughput the
    incident costs.

    >>> from schemas.enums import Cause
    >>> def v(kind, sev):
    ...     return Verdict(job="j", verdict_id="x", revision=0, kind=kind, cause=Cause.COMPUTE,
    ...                    rank=3, onset_ns=0, detected_ns=0, severity=sev)
    >>> [level_of(v(k, 0.4), AlertSettings()).value for k in
    ...  (VerdictKind.SLOWDOWN, VerdictKind.TRANSIENT_STRAGGLER, VerdictKind.INTERMITTENT_SLOWDOWN)]
    ['critical', 'info', 'critical']
    """
    if v.kind == VerdictKind.TRANSIENT_STRAGGLER:
        return AlertLevel.INFO
    if v.kind == VerdictKind.HANG or v.severity >= settings.critical:
        return AlertLevel.CRITICAL
    if v.severity >= settings.warning:
        return AlertLevel.WARNING
    return AlertLevel.INFO


class AlertGate:
    def __init__(self, settings: AlertSettings | None = None) -> None:
        self.settings = settings or AlertSettings()
        s = self.settings
        if not 0 <= s.warning <= s.critical <= 1:
            raise ValueError(
                f"alert levels need 0 <= warning <= critical <= 1, got {s.warning}, {s.critical}"
            )
        if s.severity_step <= 0 or s.max_incidents_per_hour < 1:
            raise ValueError("severity_step must be > 0 and max_incidents_per_hour >= 1")
        self._reset()

    def _reset(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._window: dict[str, list[int]] = {}  # job -> times incidents were announced
        self._suppressed: dict[str, int] = {}
        self._ignored: set[str] = set()  # incidents over the cap: never announced

    def level(self, v: Verdict) -> AlertLevel:
        return level_of(v, self.settings)

    def update(self, v: Verdict) -> list[Alert]:
        """The alerts this verdict revision calls for (none, or one)."""
        s = self.settings
        level = self.level(v)
        sent = self._sent.get(v.verdict_id)
        if v.status == VerdictStatus.RESOLVED:
            self._ignored.discard(v.verdict_id)
            if sent is None:
                return []
            del self._sent[v.verdict_id]
            return [self._alert(v, VerdictStatus.RESOLVED, level)]
        if sent is None:
            if v.verdict_id in self._ignored or not self._admit(v):
                return []
            self._sent[v.verdict_id] = _Sent(level, v.severity, v.detected_ns)
            return [self._alert(v, VerdictStatus.OPEN, level)]
        moved = abs(v.severity - sent.severity) >= s.severity_step
        waited = v.detected_ns - sent.at_ns >= s.update_interval_s * 1e9
        if level != sent.level or (moved and waited):
            self._sent[v.verdict_id] = _Sent(level, v.severity, v.detected_ns)
            return [self._alert(v, VerdictStatus.UPDATE, level)]
        return []

    def _admit(self, v: Verdict) -> bool:
        recent = [t for t in self._window.get(v.job, []) if v.detected_ns - t < _HOUR_NS]
        if len(recent) >= self.settings.max_incidents_per_hour and v.kind != VerdictKind.HANG:
            self._window[v.job] = recent
            self._suppressed[v.job] = self._suppressed.get(v.job, 0) + 1
            self._ignored.add(v.verdict_id)
            return False
        self._window[v.job] = [*recent, v.detected_ns]
        return True

    def _alert(self, v: Verdict, event: VerdictStatus, level: AlertLevel) -> Alert:
        return Alert(
            job=v.job,
            alert_id=f"{v.verdict_id}:{event.value}:{v.revision}",
            event=event,
            level=level,
            verdict=v,
            suppressed=self._suppressed.pop(v.job, 0),
        )


__all__ = ["AlertGate", "level_of"]
