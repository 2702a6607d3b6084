"""Detection quality: megatrace and its peers' rules scored on labelled cases.

A case is a job's records and its labels (:class:`~schemas.results.FaultLabel`, none
for a healthy job). Cases come from the simulator's catalogue
(:func:`simulated`), or from a folder of recordings (:func:`corpus`): one folder
per case holding ``records.jsonl`` (or ``records.jsonl.gz``) and ``labels.jsonl`` (an
empty or missing labels file: a healthy job), as ``megatrace lab`` leaves its runs and
as any real recording can be kept. Every case runs through the same offline
:class:`~detectors.replay.Replay` as ``megatrace analyze``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detectors.scoring import Score


@dataclass
class Case:
    """One labelled job: its records and labels, and how many steps it has (the
    simulator says; a recording's are counted as the analysis closes them)."""

    name: str
    records: list[Any]
    labels: list[Any]
    steps: int | None = None


@dataclass
class Results:
    """Per method, its score and the seconds its analysis took."""

    scores: dict[str, Score] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    cases: int = 0

    def add(self, other: Results) -> None:
        """Another set of cases' results, added to these (the same methods)."""
        for m, score in other.scores.items():
            self.scores.setdefault(m, Score()).add(score)
            self.seconds[m] = self.seconds.get(m, 0.0) + other.seconds[m]
        self.cases += other.cases

    def tables(self) -> list[str]:
        out = []
        for m, score in self.scores.items():
            out.append(f"\n== {m} ({self.seconds[m]:.1f}s of analysis over {self.cases} runs)")
            out += score.table()
        return out


def simulated(
    scales: Iterable[str], names: Iterable[str], seeds: int, shape: dict[str, Any], kernels: bool
) -> tuple[list[tuple[str, str, int]], Callable[[tuple[str, str, int]], Case]]:
    """The simulator's catalogue: the (scenario, scale, seed) runs to make, and how to make
    one (a scenario that does not apply to a shape is left out, and said)."""
    from producers.sim.draws import NotApplicable
    from producers.sim.scenarios import SCENARIOS, build

    todo: list[tuple[str, str, int]] = []
    skipped: list[str] = []
    for sc in scales:
        for n in list(names) or list(SCENARIOS):
            if n == "story":
                continue
            try:
                build(n, scale=sc, seed=100, **shape)
            except NotApplicable as e:
                skipped.append(f"skipping {n} at {sc}: {e}")
                continue
            todo += [(n, sc, seed) for seed in range(seeds)]

    def make(item: tuple[str, str, int]) -> Case:
        n, sc, seed = item
        run = build(n, scale=sc, seed=seed + 100, **shape)
        return Case(f"{n} {sc} seed {seed}", list(run.records(emit_kernels=kernels)),
                    list(run.labels), run.steps)  # fmt: skip

    for line in skipped:
        print(line)
    return todo, make


def corpus(root: Path) -> Iterator[Case]:
    """Every case folder under ``root`` (itself one, or its sub-folders, in name order)."""
    from schemas.codec import read_jsonl, records_file

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no corpus folder {root}")
    dirs = [root] if records_file(root) else sorted(root.iterdir())
    cases = [(d, rec) for d in dirs if (rec := records_file(d)) is not None]
    if not cases:
        raise FileNotFoundError(
            f"{root} holds no case (a folder with a records.jsonl or records.jsonl.gz)"
        )
    for d, rec in cases:
        labels_file = d / "labels.jsonl"
        labels = list(read_jsonl(labels_file)) if labels_file.exists() else []
        yield Case(d.name, list(read_jsonl(rec)), labels)


def score(cases: Iterable[Case], baselines: bool, progress: Callable[[str], None]) -> Results:
    """Every case through megatrace (and the peers' rules, with ``baselines``)."""
    from detectors.baselines import BASELINES
    from detectors.replay import Replay
    from detectors.route import POLL
    from schemas.results import StepSummary, Verdict

    methods = ["megatrace", *(BASELINES if baselines else [])]
    res = Results({m: Score() for m in methods}, dict.fromkeys(methods, 0.0))
    for case in cases:
        res.cases += 1
        replay = Replay(poll=POLL, rows=False)  # batched as the flow batches its polls
        t0 = time.perf_counter()
        out = list(replay.run(case.records))
        res.seconds["megatrace"] += time.perf_counter() - t0
        found = [v for v in out if isinstance(v, Verdict)]
        steps = case.steps
        if steps is None:
            steps = len({(s.job, s.step) for s in out if isinstance(s, StepSummary)})
        jobs = list(replay.jobs.values())
        step_ns = (jobs[0].expected_step_ns() or 0.0) if jobs else 0.0
        res.scores["megatrace"].add_run(case.labels, found, steps, step_ns)
        for m in methods[1:]:
            t0 = time.perf_counter()
            theirs = BASELINES[m]().run(case.records)
            res.seconds[m] += time.perf_counter() - t0
            res.scores[m].add_run(case.labels, theirs, steps, step_ns)
        progress(case.name)
    return res


__all__ = ["Case", "Results", "corpus", "score", "simulated"]
