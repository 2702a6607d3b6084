"""The kept lab recordings (``tests/data/lab_*.jsonl.gz``, and the lab runs kept under
``tests/corpus/lab``) and how the tests replay them: each file is the records as a
`megatrace lab` flow read them."""

from __future__ import annotations

from pathlib import Path

from detectors.replay import Replay
from schemas.codec import read_jsonl
from schemas.records import CommInfo, Heartbeat, Iteration, JobInfo, RankInfo
from schemas.results import Verdict

DATA = Path(__file__).parent / "data"
#: the kept lab runs (one folder per case), which `megatrace eval --corpus` scores
CORPUS = Path(__file__).parent / "corpus" / "lab"
#: the whole catalogue's kept live runs (``run1`` to ``run4``, one folder per case)
LAB41 = Path(__file__).parent / "corpus" / "lab41"

#: how the records reach the detectors: in the order they were read; as the flow
#: batches a poll (each communicator's share of it at once); and with the job's
#: metadata and iteration markers first, as a flow reads those topics ahead of the
#: calls' (the meta topic is small and compacted, the markers few)
ORDERS = ["as-read", "polled", "markers-first"]


def read_records(name: str) -> list:
    """Recording ``name``'s records, in the order they were read."""
    return list(read_jsonl(DATA / name))


def case_records(run: str, case: str) -> list:
    """The records of case ``case`` of kept live run ``run`` (:data:`LAB41`)."""
    return list(read_jsonl(LAB41 / run / case / "records.jsonl.gz"))


def last_verdicts(name: str, order: str = "as-read") -> list[Verdict]:
    """Recording ``name``'s :func:`replayed`."""
    return replayed(read_records(name), order)


def replayed(records: list, order: str = "as-read") -> list[Verdict]:
    """Each incident's last revision, in the order they opened, with ``records`` in
    ``order`` (one of :data:`ORDERS`, or ``no-calls``: the job's own topics alone)."""
    if order == "markers-first":
        ahead = (JobInfo, RankInfo, CommInfo, Iteration)
        records = [r for r in records if isinstance(r, ahead)] + [
            r for r in records if not isinstance(r, ahead)
        ]
    if order == "no-calls":  # the job's own topics alone: heartbeats, markers, metadata
        own = (JobInfo, RankInfo, CommInfo, Iteration, Heartbeat)
        records = [r for r in records if isinstance(r, own)]
    replay = Replay(poll=300 if order == "polled" else None)
    last = {v.verdict_id: v for v in replay.run(records) if isinstance(v, Verdict)}
    return list(last.values())
