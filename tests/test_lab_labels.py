"""The lab's labels: what each fault it injected cost the job, from the job's own step
markers (:mod:`megatrace.lab_labels`)."""

from __future__ import annotations

import pytest

from megatrace.lab import Injected
from megatrace.lab_cases import Fault
from megatrace.lab_labels import _cost, labels_of
from schemas.records import Iteration


def _marks(durations_ms: list[float]) -> list[Iteration]:
    out, t = [], 0
    for step, ms in enumerate(durations_ms):
        d = int(ms * 1e6)
        t += d
        out.append(Iteration(job="j", step=step, end_ns=t, duration_ns=d, rank=0))
    return out


def test_a_quota_another_fault_left_nothing_to_hold_back_is_labelled_at_what_it_held() -> None:
    """The lab labels a fault with the throughput it cost. A rank's CPU quota during a
    slow link: every step 17x as long, but the kernel held the rank back 4% of the time,
    so the quota cost at most that (the link's label carries the loss); a quota alone that
    held its rank back most of the time is labelled at the step time it added."""

    def marks(before_ms: float, during_ms: float) -> list[Iteration]:
        return _marks([before_ms if step < 20 else during_ms for step in range(40)])

    slow = marks(24, 410)
    onset = slow[19].end_ns + 1
    masked = Injected(
        Fault("slow_rank", 3, 20), onset, throttled=(int(0.04 * 8.2e9), onset + int(8.2e9))
    )
    assert _cost(slow, masked) == pytest.approx(0.04)
    alone = marks(24, 96)
    onset = alone[19].end_ns + 1
    binding = Injected(
        Fault("slow_rank", 1, 20), onset, throttled=(int(1.6e9), onset + int(1.92e9))
    )
    assert _cost(alone, binding) == pytest.approx(0.75)


def test_a_quota_for_a_step_is_labelled_at_the_steps_it_lasted() -> None:
    """A transient quota's label: the step time it added while it lasted (steps 20-21 at
    2x), not diluted by the normal steps after it."""
    out = _marks([50 if step in (20, 21) else 25 for step in range(60)])
    onset, ended = out[19].end_ns + 1, out[21].end_ns - 1
    assert _cost(out, Injected(Fault("transient", 1, 20), onset, ended_ns=ended)) == 0.5


def test_a_rank_stalled_now_and_then_is_labelled_intermittent_at_the_time_its_stalls_added(
) -> None:  # fmt: skip
    """Four stalls of rank 1, every 10 steps of 20 ms, each making its step 100 ms: an
    intermittent slowdown of rank 1 from the first stall, priced by the time the stalls
    added over the steps from the first to the last (their median step is as usual)."""
    from types import SimpleNamespace

    from megatrace.lab_cases import CASES
    from schemas.enums import VerdictKind

    stalled = {12, 22, 32, 42}
    marks = _marks([100 if s in stalled else 20 for s in range(60)])
    fault = Fault("stall", 1, 12, times=4, every=10)
    inj = Injected(fault, marks[11].end_ns + 1, ended_ns=marks[42].end_ns - 1)
    # 31 steps from the first stall to the last: 4 of them 80 ms longer
    assert _cost(marks, inj) == pytest.approx(1 - 20 / ((31 * 20 + 4 * 80) / 31))
    run = SimpleNamespace(marks=marks, injected=[inj], job="j", case=CASES["ddp-intermittent"])
    nodes = [SimpleNamespace(name="lab-n0"), SimpleNamespace(name="lab-n1")]
    (label,) = labels_of(run, nodes)
    assert (label.kind, label.rank, label.node) == (VerdictKind.INTERMITTENT_SLOWDOWN, 1, "lab-n0")
    assert label.onset_step == 12 and label.throughput_cost > 0.05  # a cost that must be found


def test_stalls_after_slower_steps_are_priced_against_the_job_s_usual_step() -> None:
    """The ten steps before the first stall ran 24 ms (a warm-up, or the machine's own
    load) and the job's usual step is 20 ms: four stalls adding 80 ms each over 31 steps
    cost what they added to the usual step, not what is left after the slower start."""
    stalled = {12, 22, 32, 42}
    marks = _marks([24 if s < 12 else 100 if s in stalled else 20 for s in range(60)])
    inj = Injected(Fault("stall", 1, 12, times=4, every=10), marks[11].end_ns + 1,
                   ended_ns=marks[42].end_ns - 1)  # fmt: skip
    assert _cost(marks, inj) == pytest.approx(1 - 20 / ((31 * 20 + 4 * 80) / 31))


def test_a_quota_for_a_step_beside_faster_ones_is_labelled_at_the_time_it_added() -> None:
    """A transient quota that made one step twice as long while the two it also spanned ran
    a little faster than usual (the job catching up): it cost the time it added over those
    three steps, not nothing (their median step is shorter than usual)."""
    out = _marks([20 if step in (20, 22) else 50 if step == 21 else 25 for step in range(60)])
    onset, ended = out[19].end_ns + 1, out[22].end_ns - 1
    cost = _cost(out, Injected(Fault("transient", 1, 20), onset, ended_ns=ended))
    assert cost == pytest.approx(1 - 25 / 30)
