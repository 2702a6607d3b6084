"""Run the detectors over a stream of records, offline or in tests.

:class:`Replay` is :class:`~detectors.route.Route`: what the dataflow does, in one
process: one :class:`~detectors.comm.CommAnalyzer` per (job, communicator) fed the
communicator's records and schedule, its step parts merged per shard, one
:class:`~detectors.node.NodeAnalyzer` per (job, node), one
:class:`~detectors.job.JobAnalyzer` per job, and the hang watchdog driven by event
time (the newest timestamp seen) every ``tick_ns``.

>>> from producers.sim.scenarios import build
>>> run = build("missing-recv", scale="tiny", seed=0, steps=20)
>>> verdicts = [v for v in Replay().run(run.records()) if type(v).__name__ == "Verdict"]
>>> (verdicts[0].kind.value, verdicts[0].rank, verdicts[0].phase.value, verdicts[0].microbatch)
('hang', 7, 'forward', 3)
>>> run.faults[0].rank
7
"""

from __future__ import annotations

from detectors.route import Route

Replay = Route

__all__ = ["Replay"]
