"""The conformance suite every stateful detector passes (style.md, after River's checks).

Each detector in ``REGISTRY`` is fed a simulated stream through its own
``update``; the suite checks that pickling it mid-stream and resuming gives
exactly the same outputs, that a fresh instance starts from nothing, that
``update`` leaves its input untouched, and that its state stays bounded on a
long healthy stream.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from detectors.alerting import AlertGate
from detectors.align import CollectiveAligner
from detectors.changepoint import ShiftDetector
from detectors.comm import CommAnalyzer
from detectors.edges import EdgeThroughput
from detectors.gpu_wait import GpuWaitBaseline
from detectors.job import JobAnalyzer
from detectors.links import LinkMonitor
from detectors.merge import PartMerger
from detectors.node import NodeAnalyzer
from detectors.parts import StepPart
from detectors.replay import Replay
from detectors.schedule import ScheduleBook
from producers.sim.scenarios import build
from schemas.config import AlertSettings
from schemas.records import Collective, LinkSample, ProxySummary
from schemas.results import StepSummary, Verdict


@dataclass(frozen=True)
class Case:
    make: Callable[[], Any]
    feed: Callable[[Any, Any], list[Any]]  # (detector, item) -> outputs
    stream: Callable[[int], list[Any]]  # steps -> items


@cache
def _records(name: str, steps: int) -> tuple[Any, ...]:
    return tuple(build(name, scale="tiny", seed=5, steps=steps, kernels=False).records())


def _one_comm(steps: int) -> list[Any]:
    """The records of the busiest communicator, with its schedule first."""
    recs = _records("slow-gpu", steps)
    book, scheds = ScheduleBook(), []
    for r in recs:
        scheds += book.update(r)
    comm = max(
        {r.comm_hash for r in recs if isinstance(r, Collective)},
        key=lambda h: sum(isinstance(r, Collective) and r.comm_hash == h for r in recs),
    )
    return [s for s in scheds if s.comm.comm_hash == comm] + [
        r for r in recs if isinstance(r, Collective | ProxySummary) and r.comm_hash == comm
    ]


def _step_times(steps: int) -> list[float]:
    return [float(s.duration_ns) for s in _steps("slow-gpu", steps)]


@cache
def _steps(name: str, steps: int) -> tuple[StepSummary, ...]:
    return tuple(r for r in Replay().run(_records(name, steps)) if isinstance(r, StepSummary))


def _verdicts(steps: int) -> list[Verdict]:
    return [r for r in Replay().run(_records("story", steps)) if isinstance(r, Verdict)]


def _job_items(steps: int) -> list[Any]:
    """What a job's analyzer receives: the communicators' output and the other records."""
    out: list[Any] = []
    comms: dict[int, CommAnalyzer] = {}
    book = ScheduleBook()
    for r in _records("story", steps):
        if isinstance(r, Collective | ProxySummary):
            out += comms.setdefault(r.comm_hash, CommAnalyzer()).update([r])[1]
            continue
        out.append(r)
        for s in book.update(r):
            out += comms.setdefault(s.comm.comm_hash, CommAnalyzer()).update([s])[1]
    return out


def _parts(steps: int) -> list[Any]:
    """The step parts the communicators send (what a merger of all of them receives)."""
    return [x for x in _job_items(steps) if isinstance(x, StepPart)]


def _node_records(steps: int) -> list[Any]:
    """One node's link samples (the slow link starts there)."""
    return [
        r for r in _records("slow-link", steps) if isinstance(r, LinkSample) and r.node == "node-0"
    ]


def _listed(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


REGISTRY: dict[str, Case] = {
    "CollectiveAligner": Case(
        lambda: CollectiveAligner(max_open=64),
        lambda d, r: d.update(r) if isinstance(r, Collective) else [],
        _one_comm,
    ),
    "CommAnalyzer": Case(
        lambda: CommAnalyzer(max_open=64), lambda d, r: _listed(d.update([r])), _one_comm
    ),
    "ShiftDetector": Case(
        ShiftDetector,
        lambda d, x: _listed(d.update(x[1], x[0])),
        lambda n: list(enumerate(_step_times(n))),
    ),
    "LinkMonitor": Case(
        LinkMonitor,
        lambda d, r: _listed(d.update(r)),
        lambda n: [r for r in _records("slow-link", n) if isinstance(r, LinkSample)],
    ),
    "NodeAnalyzer": Case(NodeAnalyzer, lambda d, r: _listed(d.update([r])), _node_records),
    "PartMerger": Case(PartMerger, lambda d, p: d.update(p), _parts),
    "GpuWaitBaseline": Case(
        GpuWaitBaseline,
        lambda d, e: [d.update(e.src_rank, float(e.gpu_wait_ns)), d.evidence(e.src_rank)][1:],
        lambda n: [x for x in _job_items(n) if isinstance(x, EdgeThroughput)],
    ),
    "AlertGate": Case(lambda: AlertGate(AlertSettings()), lambda d, v: d.update(v), _verdicts),
    "JobAnalyzer": Case(
        lambda: JobAnalyzer(_records("story", 4)[0].job),
        lambda d, x: d.update(x) + d.tick(d.now_ns),
        _job_items,
    ),
}


def _run(case: Case, det: Any, items: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        out += case.feed(det, item)
    return out


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_pickled_mid_stream_resumes_with_identical_output(name: str) -> None:
    case = REGISTRY[name]
    items = case.stream(40)
    whole = _run(case, case.make(), items)
    det = case.make()
    half = len(items) // 2
    first = _run(case, det, items[:half])
    resumed = pickle.loads(pickle.dumps(det))
    assert first + _run(case, resumed, items[half:]) == whole
    assert whole, f"{name} produced nothing on its stream: the check would be empty"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_fresh_instance_starts_from_nothing_and_input_is_untouched(name: str) -> None:
    case = REGISTRY[name]
    items = case.stream(40)
    before = copy.deepcopy(items)
    used = case.make()
    _run(case, used, items)
    assert items == before
    assert pickle.dumps(case.make()) != pickle.dumps(used)
    assert _run(case, case.make(), items) == _run(case, case.make(), items)


@pytest.mark.parametrize(
    "name",
    [
        "CollectiveAligner",
        "CommAnalyzer",
        "JobAnalyzer",
        "LinkMonitor",
        "NodeAnalyzer",
        "PartMerger",
    ],
)
def test_state_stays_bounded_on_a_long_stream(name: str) -> None:
    case = REGISTRY[name]
    sizes = []
    for steps in (40, 80):
        det = case.make()
        _run(case, det, case.stream(steps))
        sizes.append(len(pickle.dumps(det)))
    assert sizes[1] < 1.3 * sizes[0], sizes
