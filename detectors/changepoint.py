"""Validated online change points on a positive signal such as step time.

River's Page-Hinkley test watches the signal relative to its baseline
(``x / baseline``, outliers clipped) for an upward change. A change is only
believed when it is also large (at least ``min_shift`` above the baseline, and
three times the signal's own noise: the robust spread of its recent values, so a
job whose steps vary by a quarter from one to the next is judged in its own units)
and persistent (``persistence`` consecutive values, or twice as many high ones with
single normal values among them: a CPU quota that lets a step through between slow
ones is not the job's noise): jitter never alarms. An
excursion that ends sooner is a *burst* - the intermittent case - and so is a first
value that towers over the rest of an excursion (a straggler for a step, then a
smaller change that must stand as a shift on its own). The baseline
is the median of the warm-up values and afterwards follows values within
``alpha`` of it (MEGATRACE's expected-duration rule); for a signal noisier than
that, the median of its recent values.

The recent values are every one outside bursts and shifts, high and low: taking only
those within the bar would keep the noise of a job steady in its warm-up and noisy
after it as small as the warm-up's (the values that show more are the ones left out),
and its own jitter would read as slowdowns. A burst's values are left out: a CPU
quota's on/off bursts are not the job's noise, and counted as such they would hide the
slowdown they make.

A further shift on top of a shift must stand out of the shifted level's own noise too,
once it has enough values to tell it: a job that got noisier as it slowed (a shared
host busier) varies by more than its warm-up did, and its own spikes are no new change.
Fewer of them than a shift takes, well clear of that noise (twice its bar, as a lone
value over the baseline must be), are a burst on top of the shift: a rank that stalls
now and then in a job slowed by something else (its stalls would be the slowdown's own
steps otherwise); the shift goes on. Spikes under that bar are the level's own values.

>>> import numpy as np
>>> rng = np.random.default_rng(1)
>>> det = ShiftDetector()
>>> xs = list(100 + rng.normal(0, 1, 20)) + list(125 + rng.normal(0, 1, 10))
>>> xs += [375.0] + list(125 + rng.normal(0, 1, 5))  # a stall, three times the level
>>> events = [(i, e.kind, e.onset) for i, x in enumerate(xs) if (e := det.update(x, i))]
>>> events
[(22, 'shift', 20), (31, 'burst', 30)]
>>> det.shifted
True
"""

from __future__ import annotations

import importlib.util
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import river


def _page_hinkley() -> type:
    """River's ``PageHinkley``, loaded without the rest of ``river.drift``.

    The package's own import also loads KSWIN (``scipy.stats``) and its datasets
    (``scipy.io``): half a second for every command, for classes megatrace never uses.
    The module itself imports only ``river.base`` and ``river.stats``; it is registered
    under its own name, so a later ``import river.drift`` (or unpickling) finds the same
    class. Where River's layout differs, the package import is the fallback.
    """
    name = "river.drift.page_hinkley"
    loaded = sys.modules.get(name) or sys.modules.get("river.drift")
    if loaded is not None:
        return loaded.PageHinkley
    path = Path(river.__file__).parent / "drift" / "page_hinkley.py"
    spec = importlib.util.spec_from_file_location(name, path) if path.is_file() else None
    if spec is None or spec.loader is None:
        from river.drift import PageHinkley as fallback

        return fallback
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module.PageHinkley


PageHinkley = _page_hinkley()

#: the signal's noise is this many of its recent normal values' robust spread
_NOISE_WINDOW = 32
#: a change stands out of the noise by this many times its spread
_NOISE_SIGMAS = 3.0
#: the fewest values of a shifted level whose own noise is told
_LEVEL_NOISE_MIN = 6
#: an excursion's first value this many times further above the baseline than the rest
#: of it is a spike of its own (a straggler for a step) before whatever follows
SPIKE_OVER_REST = 3.0


@dataclass(frozen=True)
class ShiftEvent:
    kind: str  # "shift" | "burst" | "recovered"
    onset: int  # index where the excursion started
    ratio: float  # mean value / baseline over the excursion
    length: int  # values in the excursion
    baseline: float


class ShiftDetector:
    """Online, validated detection of a persistent upward shift (and of short bursts).

    Parameters
    ----------
    warmup
        Values used to seed the baseline (median).
    min_shift
        Minimum relative increase that counts (0.05 = 5% slower).
    persistence
        Consecutive values over ``1 + min_shift`` needed for a shift; shorter
        excursions are bursts.
    threshold, delta
        Page-Hinkley parameters on the relative signal (units: fraction of baseline).
    alpha
        Values within this fraction of the baseline update it (slow drift is not a fault).
    clip
        Relative values are clipped to ``[0, clip]`` before they reach the test.
    """

    def __init__(
        self,
        warmup: int = 5,
        min_shift: float = 0.05,
        persistence: int = 3,
        threshold: float = 0.1,
        delta: float = 0.02,
        alpha: float = 0.05,
        clip: float = 3.0,
    ) -> None:
        if warmup < 1 or persistence < 1:
            raise ValueError("warmup and persistence must be >= 1")
        if not 0 < min_shift < 10 or not 0 < alpha < 1:
            raise ValueError("min_shift must be in (0, 10) and alpha in (0, 1)")
        self.warmup = warmup
        self.min_shift = min_shift
        self.persistence = persistence
        self.threshold = threshold
        self.delta = delta
        self.alpha = alpha
        self.clip = clip
        self._reset()

    #: the values seen lately outside bursts and shifts (for one pickled before it: none)
    _normal: deque[float] | None = None
    #: the current excursion's first value over the baseline, unclipped
    _first: float = 0.0
    #: in a shift, the first value of the values over its level (unclipped), and that
    #: level and its bar when they began
    _more_first: float = 0.0
    _more_bar: tuple[float, float] = (1.0, 0.0)
    #: an excursion one normal value interrupted: (its onset, its high values); it goes
    #: on if the next value is high again (None: none)
    _gap: tuple[int, int] | None = None
    #: the high values of the excursion before the current run's, where it went on, and
    #: where that began
    _chained: int = 0
    _chain_onset: int = -1
    #: the lone high value the last update ended within the noise, (its index, its
    #: ratio to the baseline, unclipped), else None: the signal's own unless something
    #: beside it tells its cause (a CPU quota's count)
    lone: tuple[int, float] | None = None

    def _reset(self) -> None:
        self._seed: list[float] = []
        self._normal = deque(maxlen=_NOISE_WINDOW)
        self.baseline: float | None = None
        self._ph = self._new_ph()
        self._drift = False
        self._run: list[float] = []  # current excursion, relative values
        self._onset = -1
        self.shifted = False
        self._calm = 0
        self._more: list[float] = []
        self._more_onset = -1
        self._gap, self._chained, self._chain_onset = None, 0, -1

    def _new_ph(self) -> PageHinkley:
        return PageHinkley(min_instances=1, delta=self.delta, threshold=self.threshold, mode="up")

    def clone(self) -> ShiftDetector:
        return ShiftDetector(
            self.warmup,
            self.min_shift,
            self.persistence,
            self.threshold,
            self.delta,
            self.alpha,
            self.clip,
        )

    @property
    def noise(self) -> float:
        """The signal's relative spread lately (1.4826 x the median absolute deviation of
        its recent values outside bursts and shifts from their median, over that median);
        0 before any."""
        normal = self._normal
        return _spread(normal) if normal and len(normal) >= self.warmup else 0.0

    @property
    def excursion(self) -> bool:
        """The newest value is high: in a shift, or in a run that may become a burst or
        one (not a value to learn the job's usual from)."""
        return self.shifted or bool(self._run)

    @property
    def slow_now(self) -> bool:
        """In a shift, and the newest value was high (not one towards a recovery)."""
        return self.shifted and not self._calm

    @property
    def bar(self) -> float:
        """How far above the baseline (a fraction of it) a value is high: ``min_shift``, or
        three times the noise where that is more."""
        return max(self.min_shift, _NOISE_SIGMAS * self.noise)

    def update(self, x: float, index: int, explained: bool = False) -> ShiftEvent | None:
        """Feed one value (``index`` is its position, e.g. the step number). An
        ``explained`` value has a cause seen beside it (one rank made the others wait
        far longer than it used to): it is judged against ``min_shift``, not the noise,
        which is no explanation for it."""
        if self._normal is None:
            self._normal = deque(maxlen=_NOISE_WINDOW)
        self.lone = None
        if self.baseline is None:
            self._seed.append(float(x))
            self._normal.append(float(x))
            if len(self._seed) >= self.warmup:
                s = sorted(self._seed)
                self.baseline = s[len(s) // 2]
            return None
        raw = max(x / self.baseline, 0.0)
        rel = min(raw, self.clip)
        noise_bar = self.bar  # a median over the recent normal values: read once
        bar = self.min_shift if explained else noise_bar
        # the test sees deviations in units of the bar: min_shift's for a quiet signal
        seen = 1.0 + (rel - 1.0) * self.min_shift / bar
        self._ph.update(seen)
        self._drift = self._drift or self._ph.drift_detected
        high = rel >= 1.0 + bar
        if self.shifted:  # a further shift stands out of the noise; explained is not calm
            return self._while_shifted(rel, index, noise_bar, explained, raw)
        if high:
            if not self._run:
                self._onset, self._first = index, raw
                # one value after an excursion: the same one goes on (a CPU quota lets a
                # step through between slow ones), its high values counted together
                self._chain_onset, self._chained = self._gap or (index, 0)
                self._gap = None
            self._run.append(rel)
            # a broken excursion is believed on twice the high values of an unbroken one
            # (a slow spell of a few steps, one fast among them, is not yet a shift)
            whole = len(self._run) >= self.persistence
            broken = len(self._run) + self._chained >= 2 * self.persistence
            if (whole or broken) and self._drift:
                if whole and (spike := self._spike(bar)):
                    return spike
                onset = self._onset if whole else self._chain_onset
                self.shifted = True
                self._calm = 0
                self._gap, self._chained = None, 0
                return ShiftEvent("shift", onset, self._mean(), index - onset + 1, self.baseline)
            return None
        event = None
        if self._gap is not None:  # a second normal value: the excursion is over
            self._gap = None
            self._restart_test()
            self._ph.update(seen)  # the test afresh from this value, as after any
        if self._run:
            # a lone value is a burst only if it is well clear of the noise (judged as it
            # is: clipped, a noisy job's lone value could never be)
            if len(self._run) > 1 or self._first >= 1.0 + 2 * bar:
                ratio = self._mean() if len(self._run) > 1 else self._first
                event = ShiftEvent("burst", self._onset, ratio, len(self._run), self.baseline)
            else:  # a lone value within the noise: one of the signal's own
                self._normal.append(self._first * self.baseline)
                self.lone = (self._onset, self._first)
            # the test goes on: the excursion may too, at the next value
            self._gap = (self._chain_onset, len(self._run) + self._chained)
            self._run = []
        self._normal.append(float(x))
        if abs(rel - 1.0) <= self.alpha:
            self.baseline += 0.1 * (x - self.baseline)
        elif bar > self.min_shift and abs(rel - 1.0) <= bar:  # noisy: its normal values' median
            self.baseline = float(np.median(np.asarray(self._normal)))
        return event

    def _while_shifted(
        self, rel: float, index: int, bar: float, explained: bool, raw: float
    ) -> ShiftEvent | None:
        if rel < 1.0 + bar / 2 and not explained:
            self._calm += 1
            spike = self._spike_on_level()  # (where it recovers too, the recovery is told)
            if self._calm >= self.persistence:
                self.shifted = False
                ev = ShiftEvent("recovered", index - self._calm + 1, rel, self._calm, self.baseline)
                self._run = []
                self._restart_test()
                return ev
            return spike
        self._calm = 0
        recent = self._run[-4 * self.persistence :]
        level = sum(recent) / len(recent)
        # a further shift on top of this one: out of this level's noise as well
        known = len(self._run) >= _LEVEL_NOISE_MIN  # else its values are still learned
        level_bar = max(bar, _NOISE_SIGMAS * _spread(self._run)) if known else 0.0
        if known and rel >= level * (1.0 + level_bar):
            if not self._more:
                self._more_onset, self._more_first = index, raw
                self._more_bar = (level, level_bar)
            self._more.append(rel)
            if len(self._more) >= self.persistence:
                self._run, self._more = self._more, []
                return ShiftEvent(
                    "shift", self._more_onset, self._mean(), len(self._run), self.baseline
                )
        else:
            spike = self._spike_on_level()
            self._run.append(rel)
            del self._run[:-_NOISE_WINDOW]
            return spike
        return None

    def _spike_on_level(self) -> ShiftEvent | None:
        """The values high over the shifted level just ended, too few for a further shift:
        a burst where well clear of the level's noise (twice its bar, as a lone value
        over the baseline must be), told with its values over the baseline; else the
        level's own values (left out, its noise would read lower than it is)."""
        more, self._more = self._more, []
        if not more:
            return None
        level, level_bar = self._more_bar
        ratio = self._more_first if len(more) == 1 else sum(more) / len(more)
        if ratio < level * (1.0 + 2 * level_bar):
            self._run += more
            del self._run[:-_NOISE_WINDOW]
            return None
        return ShiftEvent("burst", self._more_onset, ratio, len(more), self.baseline)

    def _spike(self, bar: float) -> ShiftEvent | None:
        """A shift about to be confirmed that began with a spike: its first value far above
        both the noise and the rest of the excursion (its excess over the baseline
        ``SPIKE_OVER_REST`` times theirs) is a burst of its own, told now; the rest must
        then make a shift on its own merit (a fresh test over it)."""
        # clear of the noise as it is; over the rest as the test saw them (clipped alike)
        first, rest = self._run[0], self._run[1:]
        level = float(np.median(rest))
        if self._first < 1.0 + 2 * bar or first - 1.0 < SPIKE_OVER_REST * max(level - 1.0, 0.0):
            return None
        event = ShiftEvent("burst", self._onset, self._first, 1, self.baseline)
        self._run, self._onset = rest, self._onset + 1
        self._restart_test()
        for rel in rest:
            self._ph.update(1.0 + (rel - 1.0) * self.min_shift / bar)
            self._drift = self._drift or self._ph.drift_detected
        return event

    def _restart_test(self) -> None:
        """A fresh Page-Hinkley test that knows the baseline: one started empty takes its
        first values as normal, so a shift that begins right after a burst (a link
        degrading, then a GPU slowing) would never be confirmed."""
        self._ph = self._new_ph()
        for _ in range(self.warmup):
            self._ph.update(1.0)
        self._drift = False

    def _mean(self) -> float:
        return sum(self._run) / len(self._run)


def _spread(xs: Iterable[float]) -> float:
    """The relative robust spread of ``xs``: 1.4826 x their median absolute deviation
    from their median, over that median."""
    a = np.fromiter(xs, dtype=float)
    med = float(np.median(a))
    return 1.4826 * float(np.median(np.abs(a / med - 1.0))) if med > 0 else 0.0
