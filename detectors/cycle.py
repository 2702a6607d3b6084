"""A communicator's step, learned from its own calls.

A training program issues the same calls every iteration: on each communicator the
same collectives (or transfers) in the same order, of the same sizes. What one
iteration holds is not told by any record, and a job's layout (the Megatron
arguments) only hints at it: buckets, fused layers, metrics, the first iteration
and the framework's own calls all change it. :class:`CallCycle` learns it from the
stream of one communicator's instances (one per sequence number):

* **calls**: the smallest period of the longest stretch at the end of what was seen
  that repeats at least ``repeats`` times (prefix function of the reversed
  signatures, one pass); what comes before it (the first iteration, set-up calls)
  is a step of its own;
* **pauses**: calls alike can hide the iteration (five equal all-reduces a step,
  or the same all-reduce in every layer): a step is the stretch, a whole number of
  the calls' periods, between the longest pauses that recur at one place of it (the
  forward pass, the optimizer, the data loader: the k longest gaps, k doubling
  until they are evenly spaced), where the gap before one position of the cycle
  is, even at its shortest (a low quantile), well over the others';
* **a hint** (the number the layout gives) is taken when the calls allow it and no
  pause contradicts it; a step then begins at the communicator's first call, as
  the layout's schedule has it.

The cycle is what one step holds from the call after its pause; each instance's
step is then arithmetic on its sequence number (instances may come in any
order). Nothing is decided from too little: learning waits for ``repeats`` of the
layout's steps where the calls allow it, else for ``patience_ns`` of event time
(its longest recurring pause then makes the step).

>>> c = CallCycle()
>>> t = 0
>>> for seq in range(80):  # five equal all-reduces a step, a pause before each step
...     t += 250_000_000 if seq % 5 == 0 else 2_000_000
...     learned = c.add(seq, ("AllReduce", 1 << 20), t)
>>> c.cycle.period, c.cycle.anchor, c.cycle.how
(5, 0, 'pauses')
>>> [c.cycle.step_of(s) for s in (0, 4, 5, 39)]
[0, 0, 1, 7]
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

#: a pause: the gap before one position of the cycle, at its shortest, over the usual gap
PAUSE_RATIO = 2.0
#: the low quantile a position's gaps are taken at (a pause that recurs, not one outlier)
_LOW_Q = 0.2


@dataclass(frozen=True)
class Cycle:
    """One step's calls: ``period`` instances from sequence number ``anchor`` on (and
    every ``period`` before and after it), the first step numbered ``first_step``.
    ``how`` says what showed it: "calls", "pauses" or "layout"."""

    period: int
    anchor: int
    how: str
    template: tuple[int, ...] = ()

    def step_of(self, seq: int) -> int:
        """The step of instance ``seq``; what comes before the first whole cycle is step 0."""
        lead = 1 if self.anchor > 0 else 0
        return max(0, (seq - self.anchor) // self.period + lead)

    def position(self, seq: int) -> int:
        """Where ``seq`` is in its step (0: the call after the pause)."""
        return (seq - self.anchor) % self.period


class CallCycle:
    """Learns a communicator's :class:`Cycle` from its instances (see the module docstring).

    Parameters
    ----------
    hint
        Instances a step by the job's layout (0: none).
    repeats
        Cycles seen before one is believed.
    patience_ns
        Event time seen before a cycle the layout does not give is believed (a step
        of many calls shows pauses within it before the one that ends it).
    max_calls
        The most calls kept while learning (a program with no cycle within them is
        taken as its calls' period, or one call a step).
    """

    def __init__(
        self,
        hint: int = 0,
        repeats: int = 3,
        patience_ns: int = 3_000_000_000,
        max_calls: int = 8192,
    ) -> None:
        self.hint = hint
        self.repeats = repeats
        self.patience_ns = patience_ns
        self.max_calls = max_calls
        self.cycle: Cycle | None = None
        self._sig: dict[int, int] = {}  # seq -> signature id
        self._t: dict[int, int] = {}  # seq -> first arrival (ns)
        self._ids: dict[Hashable, int] = {}
        self._next_try = repeats * hint if hint else 8  # the first try that can succeed
        #: instances whose call differs from the cycle's at their place (after learning)
        self.mismatched = 0
        self.matched = 0

    @classmethod
    def known(cls, cycle: Cycle, hint: int = 0) -> CallCycle:
        """A learner that knows its cycle already (learned elsewhere: another worker)."""
        out = cls(hint=hint)
        out.cycle = cycle
        return out

    def add(self, seq: int, signature: Hashable, t_ns: int) -> bool:
        """One instance: its sequence number, what it was (op, size...), when its first
        member came. True when this instance made the cycle known."""
        sid = self._ids.setdefault(signature, len(self._ids))
        if self.cycle is not None:
            c = self.cycle
            if c.template:
                if c.template[(seq - c.anchor) % c.period] == sid:
                    self.matched += 1
                else:
                    self.mismatched += 1
            return False
        self._sig[seq] = sid
        self._t[seq] = t_ns
        n = len(self._sig)
        if n < self._next_try and n < self.max_calls:
            return False
        self._next_try = max(n + 8, int(n * 1.25))
        self.cycle = self._learn(final=n >= self.max_calls)
        if self.cycle is not None:
            self._sig, self._t = {}, {}
        return self.cycle is not None

    def finish(self) -> Cycle | None:
        """End of input: the best cycle the calls so far give, if any."""
        if self.cycle is None and self._sig:
            self.cycle = self._learn(final=True)
        return self.cycle

    # ------------------------------------------------------------------ learning
    def _run(self) -> tuple[int, list[int], list[int]]:
        """The contiguous sequence numbers from the lowest seen: (first seq, ids, times)."""
        first = min(self._sig)
        ids, times = [], []
        seq = first
        while seq in self._sig:
            ids.append(self._sig[seq])
            times.append(self._t[seq])
            seq += 1
        return first, ids, times

    def _learn(self, final: bool) -> Cycle | None:
        first, ids, times = self._run()
        n = len(ids)
        found = periodic_suffix(ids, self.repeats)
        if found is None:
            if not final:
                return None
            p, start = max(1, n), 0  # no repeat at all: the whole run is one step
        else:
            p, start = found
        gaps = np.diff(np.asarray(times, dtype=np.int64))  # gaps[i]: before call i + 1
        span = n - start
        pause = _pause_period(gaps, start, span, p, self.repeats)
        waited = final or n >= self.max_calls or times[-1] - times[0] >= self.patience_ns
        last = final or n >= self.max_calls
        if self.hint and self.hint % p == 0:  # the calls allow the layout's step
            if not (last or span >= self.repeats * self.hint):
                return None
            if pause is None or self.hint % pause == 0:  # pauses within its step agree
                period, how = self.hint, "layout"
            else:
                period, how = pause, "pauses"
        elif pause is not None and waited:  # a longer step may still show its pause
            period, how = pause, "pauses"
        elif last or n >= self.max_calls // 4:
            period, how = p, "calls"
        else:
            return None
        if span < self.repeats * period and not last:
            return None  # fewer cycles than believed: the calls' stretch is too short
        # the layout's steps begin at the communicator's first call (a pipeline stage's
        # longest pause can be within its step: its bubble); learned ones after a pause
        anchor_at = None if how == "layout" else _pause_position(gaps, start, span, period)
        if how == "layout":
            anchor = 0
        elif anchor_at is None:
            anchor = first % period
        else:
            anchor = (first + start + anchor_at) % period
        lo = start + ((anchor - first - start) % period)
        template = tuple(ids[lo : lo + period]) if lo + period <= n else ()
        return Cycle(period, anchor, how, template)


def periodic_suffix(ids: list[int], repeats: int) -> tuple[int, int] | None:
    """(period, start) of the longest suffix of ``ids`` that holds ``repeats`` whole
    periods or more, its period the smallest; None when none does.

    >>> periodic_suffix([9, 1, 2, 1, 2, 1, 2, 1, 2], 3)
    (2, 1)
    >>> periodic_suffix([1, 2, 3], 3) is None
    True
    """
    rev = ids[::-1]
    n = len(rev)
    pi = [0] * n
    k = 0
    for i in range(1, n):  # the prefix function of the reversed calls
        while k and rev[i] != rev[k]:
            k = pi[k - 1]
        if rev[i] == rev[k]:
            k += 1
        pi[i] = k
    for length in range(n, 0, -1):
        p = length - pi[length - 1]
        if length >= repeats * p:
            return p, n - length
    return None


def _profile(gaps: np.ndarray, start: int, span: int, period: int) -> np.ndarray | None:
    """Per position of the cycle (0 = the call at ``start``), its gaps' low quantile over
    the whole cycles seen; None with fewer than two."""
    cycles = (span - 1) // period
    if cycles < 2 or period < 2:
        return None
    # gaps[start + j - 1] is the gap before call start + j; position 0's first has none
    lo = start + 1
    g = gaps[lo - 1 : lo - 1 + cycles * period]
    if len(g) < cycles * period:
        return None
    return np.quantile(g.reshape(cycles, period), _LOW_Q, axis=0)


def _pause_position(gaps: np.ndarray, start: int, span: int, period: int) -> int | None:
    """Where the cycle's recurring pause is (the position after it, from ``start + 1``),
    or None when no position's gaps stand out."""
    prof = _profile(gaps, start, span, period)
    if prof is None:
        return None
    j = int(np.argmax(prof))
    usual = float(np.median(np.delete(prof, j)))  # the other positions' gaps
    if prof[j] < PAUSE_RATIO * max(usual, 1.0):
        return None
    return (j + 1) % period


def _pause_period(gaps: np.ndarray, start: int, span: int, p: int, repeats: int) -> int | None:
    """The longest stretch, a multiple of ``p``, between pauses that recur at one place of
    it (see the module docstring), or None."""
    g = gaps[start:] if start < len(gaps) else gaps[:0]
    if len(g) < 2 * repeats:
        return None
    ordered = np.sort(g)[::-1]
    k = repeats + 1
    while k <= len(g) // 2:  # the k longest gaps, k doubling: the longest pauses first
        big = np.flatnonzero(g >= ordered[k - 1])
        k *= 2
        dist = np.diff(big)
        values, counts = np.unique(dist, return_counts=True)
        d = int(values[np.argmax(counts)])
        if d % p or counts.max() < 0.75 * len(dist) or span < repeats * d:
            continue
        if _pause_position(gaps, start, span, d) is not None:
            return d
    return None


__all__ = ["CallCycle", "Cycle", "periodic_suffix"]
