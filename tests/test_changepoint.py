"""The change-point detector on step times (:class:`~detectors.changepoint.ShiftDetector`):
jitter never alarms, a short excursion is a burst, a shift must stand out of the job's own
noise (learnt as it goes) unless a cause explains it, and River's Page-Hinkley underneath."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from detectors.changepoint import ShiftDetector


def test_jitter_and_persistent_offsets_never_alarm() -> None:
    rng = np.random.default_rng(0)
    det = ShiftDetector()
    base = 100.0 + 3.0  # a persistent offset is just a different baseline
    events = [det.update(base * (1 + rng.normal(0, 0.02)), i) for i in range(10_000)]
    assert [e for e in events if e is not None] == []


def test_a_short_excursion_is_a_burst_not_a_shift() -> None:
    det = ShiftDetector()
    xs = [100.0] * 10 + [180.0, 180.0] + [100.0] * 5
    kinds = [e.kind for i, x in enumerate(xs) if (e := det.update(x, i))]
    assert kinds == ["burst"]


def test_the_change_detector_is_rivers_page_hinkley_without_scipy_and_pickles_as_it() -> None:
    """River's drift package also loads KSWIN (scipy.stats) and its datasets: half a second
    of every command. The change detector loads Page-Hinkley alone, as the class that a
    later ``import river.drift`` and unpickling find."""
    import subprocess
    import sys

    code = (
        "import pickle, sys\n"
        "from detectors.changepoint import ShiftDetector\n"
        "assert 'scipy.stats' not in sys.modules and 'river.drift' not in sys.modules\n"
        "det = ShiftDetector()\n"
        "for i in range(30): det.update(100.0 + i % 3, i)\n"
        "blob = pickle.dumps(det)\n"
        "import river.drift\n"
        "assert type(det._ph) is river.drift.PageHinkley\n"
        "again = pickle.loads(blob)\n"
        "assert [again.update(150.0, 30 + i) for i in range(6)] == "
        "[det.update(150.0, 30 + i) for i in range(6)]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_shift_inside_the_noise_is_confirmed_only_where_a_cause_explains_it() -> None:
    """Steps varying by a quarter hide a shift of 200 to 300 from the noise bar (three
    times their spread); steps that a cause explains (one rank holding the others up)
    are judged against the least shift, and the shift holds as long as the cause does."""
    rng = np.random.default_rng(2)
    xs = [*200 * rng.lognormal(0, 0.25, 12), *300 * rng.lognormal(0, 0.05, 20), *[200.0] * 5]
    plain, told = ShiftDetector(), ShiftDetector()
    assert [e for i, x in enumerate(xs) if (e := plain.update(x, i))] == []
    events = [(i, e.kind, e.onset) for i, x in enumerate(xs)
              if (e := told.update(x, i, explained=12 <= i < 32))]  # fmt: skip
    assert events == [(14, "shift", 12), (34, "recovered", 32)]


def test_a_job_noisier_than_its_warm_up_learns_its_noise_and_quota_bursts_stay_a_slowdown() -> None:
    """A job steady in its warm-up whose steps then vary by 15% on their own (a shared
    host): its noise is learned from its own values, low and high, not only from those
    within the warm-up's narrow bar, so from step 60 it is no longer taken for a slowdown
    (the narrow bar's values alone made 33 of these 50 jobs slow). A CPU quota's bursts
    (slow, slow, fast, ...) are not the job's noise: they still make a slowdown."""

    def shifts(xs: list[float], after: int = 0) -> list[int]:
        det = ShiftDetector()
        found = [(e.kind, e.onset) for i, x in enumerate(xs) if (e := det.update(x, i))]
        return [onset for kind, onset in found if kind == "shift" and onset >= after]

    noisy, missed = 0, 0
    for seed in range(50):
        rng = np.random.default_rng(seed)
        healthy = [*(100 + rng.normal(0, 1, 10)), *(100 * np.exp(rng.normal(0, 0.15, 150)))]
        noisy += bool(shifts(healthy, after=60))
        quota = [300.0, 300.0, 100.0] * 7 + [300.0] * 10
        slowed = [
            *(100 * np.exp(rng.normal(0, 0.1, 20))),
            *(q * np.exp(rng.normal(0, 0.1)) for q in quota),
        ]
        missed += not shifts(slowed)
    assert noisy <= 3, f"{noisy} of 50 healthy jobs taken for slow"
    assert missed == 0, f"{missed} of 50 quotas not found"


def slowed_jobs(
    level: float, spread: float
) -> Iterator[tuple[np.ndarray, np.ndarray, np.random.Generator]]:
    """50 seeded jobs steady at 100 in their warm-up (10 steps), then slowed to ``level``
    with steps varying by ``spread`` (60 steps): each (warm-up, slowed steps, its rng)."""
    for seed in range(50):
        rng = np.random.default_rng(seed)
        yield 100 + rng.normal(0, 1, 10), level * np.exp(rng.normal(0, spread, 60)), rng


def test_a_slowed_job_noisier_than_its_warm_up_has_no_further_shift_from_its_own_spikes() -> None:
    """A job steady in its warm-up slows by a quarter and its steps then vary by 15% (a
    shared host busier): one shift. Its own spikes on top of that level are not a further
    shift unless they stand out of the level's noise too (the warm-up's bar alone made a
    second slowdown in every one of these jobs); a second fault doubling the step on top of
    the first still is one."""

    def further(xs: list[float]) -> int:
        """Shifts confirmed while shifted already (none recovered between)."""
        det, n = ShiftDetector(), 0
        for i, x in enumerate(xs):
            shifted = det.shifted
            n += shifted and (e := det.update(x, i)) is not None and e.kind == "shift"
            if not shifted:
                det.update(x, i)
        return n

    extra, missed = 0, 0
    for quiet, noisy, rng in slowed_jobs(125.0, 0.15):
        extra += further([*quiet, *noisy]) > 0
        doubled = 250 * np.exp(rng.normal(0, 0.05, 10))
        missed += further([*quiet, *noisy[:30], *doubled]) == 0
    assert extra <= 2, f"{extra} of 50 slowed jobs given a further shift by their own noise"
    assert missed == 0, f"{missed} of 50 second faults not found"


def test_a_shift_right_after_a_lone_high_step_is_still_a_shift() -> None:
    """A link degrades (one step 8% slow), then a GPU slows the job by 39%: the lone
    step restarts the change-point test, and a restarted test must still know the
    baseline, or it takes the shift as the new normal and never reports it."""
    det = ShiftDetector(warmup=5)
    values = [100.0] * 10 + [108.0, 103.0] + [139.0] * 10
    events = [(e.kind, e.onset) for i, x in enumerate(values) if (e := det.update(x, i))]
    assert events == [("shift", 12)]


def test_a_stall_on_top_of_a_slowdown_is_a_burst_and_the_slowdown_goes_on() -> None:
    """A job slowed by half, its steps then varying by 10%, has a rank stall for one step
    (the step three times the slowed level): that step is a burst of its own, told with
    its ratio over the baseline, and the slowdown stays open. The level's own spikes are
    no burst (they are not clear of its noise)."""

    def bursts(xs: list[float]) -> list[tuple[range, float]]:
        """The bursts told: the steps each covers, and its ratio over the baseline."""
        det = ShiftDetector()
        out = []
        for i, x in enumerate(xs):
            e = det.update(x, i)
            if e is not None and e.kind == "burst":
                out.append((range(e.onset, e.onset + e.length), e.ratio))
            assert e is None or e.kind != "recovered", f"recovered at {i}"
        return out

    own, missed = 0, 0
    for quiet, noisy, _ in slowed_jobs(150.0, 0.1):
        own += len(bursts([*quiet, *noisy]))
        stalled = noisy.copy()
        stalled[30] = 450.0
        # the stall, alone 4.5 times the baseline of 100 (or with a high step beside it)
        found = [r for steps, r in bursts([*quiet, *stalled]) if 40 in steps]
        missed += not found or not 2.0 <= found[0] <= 4.6
    assert own <= 2, f"{own} bursts from 50 slowed jobs' own noise"
    assert missed == 0, f"{missed} of 50 stalls on top of a slowdown not told"
