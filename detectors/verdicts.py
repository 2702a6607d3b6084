"""One verdict per incident: stable ids, updates and resolution.

An incident is identified by (job, kind, culprit, onset step): re-processing
the same input after a restart gives the same ``verdict_id``, so the
ReplacingMergeTree keeps one row. Each material change (severity moved by
more than ``min_change``, more bursts, resolution) raises ``revision``.

>>> book = VerdictBook("job-1")
>>> v = book.report(VerdictKind.SLOWDOWN, Cause.COMPUTE, "rank:5", onset_step=12,
...                 onset_ns=1, detected_ns=2, severity=0.3, confidence=0.9, rank=5)
>>> v.revision, v.status.value
(0, 'open')
>>> book.report(VerdictKind.SLOWDOWN, Cause.COMPUTE, "rank:5", onset_step=12,
...             onset_ns=1, detected_ns=3, severity=0.31, confidence=0.9, rank=5) is None
True
>>> book.resolve("slowdown", "rank:5", 9).status.value
'resolved'

A lasting incident (a slowdown, a degraded link) whose culprit is reported again within
``reopen_ns`` of its resolution is the same incident reopened, not a new one: a quota
or a busy host lets a few steps through at the old speed now and then, and one fault
that flaps is one incident on the pager and in the table (the same ``verdict_id``, its
first onset kept).

>>> w = book.report(VerdictKind.SLOWDOWN, Cause.HOST_CPU, "rank:5", onset_step=20,
...                 onset_ns=19, detected_ns=20, severity=0.3, confidence=0.9, rank=5)
>>> (w.verdict_id == v.verdict_id, w.status.value, w.revision, w.onset_step, w.cause.value)
(True, 'update', 2, 12, 'host_cpu')
"""

from __future__ import annotations

import hashlib

import msgspec

from schemas.enums import Cause, VerdictKind, VerdictStatus
from schemas.results import Verdict


def verdict_id(job: str, kind: str, culprit: str, onset: int | None) -> str:
    """Stable across re-processing: the onset step, or the onset time when the step is unknown."""
    raw = f"{job}|{kind}|{culprit}|{onset}".encode()
    return hashlib.sha1(raw, usedforsecurity=False).hexdigest()[:16]


#: the fields that say who is to blame (cleared when an incident is blamed on another)
_CULPRIT_FIELDS = ("rank", "node", "gpu", "link", "src_rank", "dst_rank", "pp_stage")


class VerdictBook:
    """Open incidents of one job."""

    #: the kinds of lasting incidents, reopened rather than told anew (see the module
    #: docstring); a hang or a straggler's burst that comes again is another
    REOPENS = frozenset({VerdictKind.SLOWDOWN.value, VerdictKind.LINK_DEGRADATION.value})

    def __init__(self, job: str, min_change: float = 0.05, reopen_ns: int = 60_000_000_000) -> None:
        self.job = job
        self.min_change = min_change
        self.reopen_ns = reopen_ns
        self._open: dict[tuple[str, str], Verdict] = {}
        self._closed: dict[tuple[str, str], Verdict] = {}  # lately resolved, reopenable

    def __setstate__(self, state: dict[str, object]) -> None:
        state.pop("history", None)  # every revision, kept by a version that grew it forever
        self.__dict__.update({"reopen_ns": 60_000_000_000, "_closed": {}, **state})

    def report(
        self,
        kind: VerdictKind,
        cause: Cause,
        culprit: str,
        *,
        onset_step: int | None,
        onset_ns: int,
        detected_ns: int,
        severity: float,
        confidence: float,
        **fields: object,
    ) -> Verdict | None:
        """Open an incident, or update it if it changed materially; None if nothing new."""
        key = (kind.value, culprit)
        severity = min(max(severity, 0.0), 1.0)
        current = self._open.get(key)
        reopened = False
        closed = self._closed.pop(key, None) if current is None else None
        if closed is not None and detected_ns - (closed.resolved_ns or 0) <= self.reopen_ns:
            current, reopened = msgspec.structs.replace(closed, resolved_ns=None), True
        if current is None:
            v = Verdict(
                job=self.job,
                verdict_id=self._new_id(
                    kind.value, culprit, onset_step if onset_step is not None else onset_ns
                ),
                kind=kind,
                cause=cause,
                onset_step=onset_step,
                onset_ns=onset_ns,
                detected_ns=detected_ns,
                severity=severity,
                confidence=confidence,
                **fields,
            )  # type: ignore[arg-type]
        else:
            changed = (
                reopened
                or abs(severity - current.severity) > self.min_change
                or cause != current.cause
                or any(
                    getattr(current, k) != v
                    for k, v in fields.items()
                    if k != "evidence" and k != "summary"
                )
            )
            if not changed:
                return None
            v = msgspec.structs.replace(
                current,
                revision=current.revision + 1,
                status=VerdictStatus.UPDATE,
                cause=cause,
                severity=severity,
                confidence=confidence,
                **fields,
            )
        self._open[key] = v
        return v

    def _new_id(self, kind: str, culprit: str, onset: int) -> str:
        """A new incident's :func:`verdict_id`; where an incident still open (or
        reopenable) has it, one blamed on ``culprit`` at first and on another since, the
        next of the same culprit's and onset's (as stable on re-processing).

        >>> book = VerdictBook("job-1")
        >>> v = book.report(VerdictKind.SLOWDOWN, Cause.COMPUTE, "rank:0", onset_step=7,
        ...                 onset_ns=1, detected_ns=2, severity=0.3, confidence=0.9, rank=0)
        >>> book.rename("slowdown", "rank:0", "rank:1")
        >>> w = book.report(VerdictKind.SLOWDOWN, Cause.COMPUTE, "rank:0", onset_step=7,
        ...                 onset_ns=1, detected_ns=3, severity=0.1, confidence=0.9, rank=0)
        >>> w.verdict_id != v.verdict_id, w.status.value
        (True, 'open')
        """
        taken = {v.verdict_id for v in (*self._open.values(), *self._closed.values())}
        vid, n = verdict_id(self.job, kind, culprit, onset), 1
        while vid in taken:
            n += 1
            vid = verdict_id(self.job, kind, f"{culprit}#{n}", onset)
        return vid

    def resolve(self, kind: str, culprit: str, ts_ns: int) -> Verdict | None:
        current = self._open.pop((kind, culprit), None)
        if current is None:
            return None
        v = msgspec.structs.replace(
            current, revision=current.revision + 1, status=VerdictStatus.RESOLVED, resolved_ns=ts_ns
        )
        if kind in self.REOPENS:
            self._closed = {k: c for k, c in self._closed.items()
                            if ts_ns - (c.resolved_ns or 0) <= self.reopen_ns}  # fmt: skip
            self._closed[(kind, culprit)] = v
        return v

    def retell(
        self, kind: str, culprit: str, as_kind: VerdictKind, ts_ns: int, **changes: object
    ) -> Verdict | None:
        """Open incident ``culprit`` turned out, once over, to be of kind ``as_kind``: it is
        resolved as that, with ``changes`` (the same ``verdict_id``: one alert, whose
        record says what it was).

        >>> book = VerdictBook("job-1")
        >>> v = book.report(VerdictKind.SLOWDOWN, Cause.COMPUTE, "rank:5", onset_step=12,
        ...                 onset_ns=1, detected_ns=2, severity=0.3, confidence=0.9, rank=5)
        >>> w = book.retell("slowdown", "rank:5", VerdictKind.TRANSIENT_STRAGGLER, 9)
        >>> (w.verdict_id == v.verdict_id, w.kind.value, w.status.value, w.revision)
        (True, 'transient_straggler', 'resolved', 1)
        """
        current = self._open.pop((kind, culprit), None)
        if current is None:
            return None
        return msgspec.structs.replace(
            current, kind=as_kind, revision=current.revision + 1,
            status=VerdictStatus.RESOLVED, resolved_ns=ts_ns, **changes,
        )  # fmt: skip

    def rename(self, kind: str, culprit: str, to: str) -> None:
        """The open incident ``culprit`` is blamed on ``to`` from now on: the next
        :meth:`report` for ``to`` revises it (same ``verdict_id``, one alert) with the
        new culprit's fields; the old culprit's are cleared.

        >>> book = VerdictBook("job-1")
        >>> v = book.report(VerdictKind.HANG, Cause.COMPUTE, "rank:5", onset_step=3,
        ...                 onset_ns=1, detected_ns=2, severity=1.0, confidence=0.9, rank=5)
        >>> book.rename("hang", "rank:5", "link:1->5")
        >>> w = book.report(VerdictKind.HANG, Cause.NETWORK_LINK, "link:1->5", onset_step=3,
        ...                 onset_ns=1, detected_ns=4, severity=1.0, confidence=0.9,
        ...                 link="node-0->node-1", src_rank=1, dst_rank=5)
        >>> (w.verdict_id == v.verdict_id, w.revision, w.status.value, w.rank, w.link)
        (True, 1, 'update', None, 'node-0->node-1')
        """
        if culprit == to or (kind, culprit) not in self._open:
            return
        current = self._open.pop((kind, culprit))
        cleared = {name: None for name in _CULPRIT_FIELDS}
        self._open[(kind, to)] = msgspec.structs.replace(current, culprit_ranks=[], **cleared)

    def current(self, kind: str, culprit: str) -> Verdict | None:
        """The latest revision of an open incident (None if none is open)."""
        return self._open.get((kind, culprit))

    def open_incidents(self) -> list[Verdict]:
        return list(self._open.values())
