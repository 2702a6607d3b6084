"""Detectors resume from recovery snapshots: a pickled analysis, communicator, folder or job
(some written by earlier versions) goes on to the same verdicts as an uninterrupted run."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec

from detectors.replay import Replay
from producers.sim.scenarios import build
from schemas.config import DetectSettings
from schemas.enums import Phase, VerdictKind
from schemas.results import StepSummary, Verdict


def test_pickled_mid_stream_analysis_resumes_with_identical_verdicts() -> None:
    run = build("missing-recv", scale="tiny", seed=5, steps=16)
    recs = list(run.records())
    straight = [v for v in Replay().run(recs) if isinstance(v, Verdict)]
    half = len(recs) // 2
    first = Replay()
    out = [v for r in recs[:half] for v in first.update(r)]
    resumed = pickle.loads(pickle.dumps(first))
    out += [v for r in recs[half:] for v in resumed.update(r)] + resumed.finish()
    assert [v for v in out if isinstance(v, Verdict)] == straight
    assert straight


def test_a_communicator_pickled_before_its_counts_existed_resumes_counting() -> None:
    """A flow resumed across an upgrade unpickles communicators saved without the
    counters behind AlignStats: they start counting from there instead of failing."""
    from detectors.comm import CommAnalyzer
    from schemas.records import Collective

    recs = list(build("healthy", scale="tiny", seed=0, steps=3).records())
    mine = [r for r in recs if isinstance(r, Collective)]
    comm = CommAnalyzer()
    comm.update(mine[:100])
    for name in ("_records", "_partials", "_told", "_told_ns"):
        del comm.__dict__[name]  # as an older version pickled it
    old = pickle.loads(pickle.dumps(comm))
    old.update(mine[100:150] + mine[:3])  # three of them again: late
    (s,) = old.stats()
    assert (s.records, s.late_records) == (53, 3)


def test_a_folders_snapshot_keeps_what_it_learned_not_its_placement_cache() -> None:
    """A communicator's folder remembers where a step's instances sit (a step has hundreds,
    in the same places each step); a flow's snapshot leaves that out, and the resumed
    folder places the next steps' instances exactly as the one that went on."""
    from detectors.comm import CommAnalyzer
    from detectors.schedule import ScheduleBook
    from schemas.codec import encode
    from schemas.enums import CommRole
    from schemas.records import Collective, CommInfo, JobInfo

    recs = list(build("healthy", scale="tiny", seed=0, steps=8).records())
    book = ScheduleBook()
    schedules = [s for r in recs if isinstance(r, JobInfo | CommInfo) for s in book.update(r)]
    sched = next(s for s in schedules if s.comm.role is CommRole.TP)
    mine = [r for r in recs if isinstance(r, Collective) and r.comm_hash == sched.comm.comm_hash]
    half = len(mine) // 2
    comm = CommAnalyzer()
    comm.update([sched, *mine[:half]])
    assert comm.folder._where is not None and comm.folder._where[2]  # places remembered
    raw = pickle.dumps(comm)
    assert b"_where" not in raw and b"_coords" not in raw
    resumed = pickle.loads(raw)
    went_on, after = comm.update(mine[half:]), resumed.update(mine[half:])
    assert [encode(r) for r in after[0]] == [encode(r) for r in went_on[0]]
    assert {r.phase for r in after[0]} >= {Phase.FORWARD, Phase.BACKWARD}


def test_a_folder_pickled_by_a_version_that_placed_by_the_layout_goes_on_so() -> None:
    """A communicator saved (a flow's snapshot) by a version whose step folder placed every
    instance by the layout, under its old module's name, resumes placing by the layout:
    the steps it had open stay numbered as they were."""
    from detectors.comm import CommAnalyzer
    from detectors.folder import StepFolder
    from detectors.schedule import ScheduleBook
    from schemas.enums import CommRole
    from schemas.records import Collective, CommInfo, JobInfo

    recs = list(build("healthy", scale="tiny", seed=0, steps=6).records())
    book = ScheduleBook()
    schedules = [s for r in recs if isinstance(r, JobInfo | CommInfo) for s in book.update(r)]
    sched = next(s for s in schedules if s.comm.role is CommRole.TP)
    mine = [r for r in recs if isinstance(r, Collective) and r.comm_hash == sched.comm.comm_hash]
    old = CommAnalyzer()
    old.update([sched])
    state = {  # what the old folder's __dict__ held
        "topo": old.folder.topo, "comm_hash": sched.comm.comm_hash, "job": sched.comm.job,
        "role": CommRole.TP, "per_step": old.folder.topo.instances_per_step(sched.comm.comm_hash),
        "_parts": {}, "_newest": -1, "_partial": set(), "_last_arrival": 0, "_last_end": 0,
        "_reported": (0, 0), "_placer": None, "give_up_steps": 2, "max_open_steps": 8,
    }  # fmt: skip
    folder = StepFolder.__new__(StepFolder)
    folder.give_up_steps, folder.max_open_steps, folder.max_held = 2, 8, 8192
    folder.__setstate__(state)
    StepFolder.__module__ = "detectors.parts"  # the name the old snapshot has it by
    try:
        raw = pickle.dumps(folder)
    finally:
        StepFolder.__module__ = "detectors.folder"
    assert b"detectors.parts" in raw and b"detectors.folder" not in raw
    old.folder = pickle.loads(raw)
    rows, forward = old.update(mine)
    per_step = state["per_step"]
    assert [r.step for r in rows] == [r.seq // per_step for r in rows]  # at once, by the layout
    assert [p.step for p in forward if type(p).__name__ == "StepPart"] == list(range(6))


def test_a_job_pickled_with_its_hang_state_inside_resumes_with_the_same_verdicts() -> None:
    """A flow's snapshot taken before the watchdog had a class of its own keeps the hang
    state in the job's own attributes: resumed from it, the job concludes the same."""
    from detectors.job_compat import OLD_HANG_STATE

    run = build("missing-recv", scale="tiny", seed=2, steps=30)
    records = list(run.records(emit_kernels=False))
    fresh, resumed = Replay(), Replay()
    expected = [*(v for r in records for v in fresh.update(r)), *fresh.finish()]
    cut = len(records) * 3 // 4
    got = [v for r in records[:cut] for v in resumed.update(r)]
    for job in resumed.jobs.values():  # as the older version pickled it, then resumed
        state = pickle.loads(pickle.dumps(job.__dict__))
        hangs = state.pop("hangs")
        state.update({old: getattr(hangs, new) for old, new in OLD_HANG_STATE.items()})
        job.__dict__.clear()
        job.__setstate__(state)
    got += [*(v for r in records[cut:] for v in resumed.update(r)), *resumed.finish()]

    def verdicts(out: list) -> list:
        return [(v.kind, v.rank, v.seq, v.revision) for v in out if isinstance(v, Verdict)]

    assert verdicts(got) == verdicts(expected)
    assert any(kind is VerdictKind.HANG for kind, *_ in verdicts(got))


def test_a_snapshot_from_before_the_incident_trackers_resumes_with_the_same_verdicts() -> None:
    """A recovery snapshot written by the version that kept the step-time incidents in
    parallel dicts keyed by culprit strings (here with a slowdown and a degraded link open,
    pickled mid-run by that version) resumes in this one and concludes exactly what an
    uninterrupted run does."""
    import gzip

    cut = 62_000  # the snapshot was taken after this record of the scenario
    records = list(build("mixed", scale="tiny", seed=1, steps=40).records())
    # that version reported a shift as soon as it settled, with no least time (settle_s):
    # the verdicts it told before the cut are those of a run without one
    fresh = Replay(DetectSettings(settle_s=0.0))
    for r in records[: cut + 1]:
        fresh.update(r)
    expected = [*(v for r in records[cut + 1 :] for v in fresh.update(r)), *fresh.finish()]
    blob = Path(__file__).parent / "data" / "replay_mixed_tiny_seed1_at62000.pickle.gz"
    resumed = pickle.loads(gzip.decompress(blob.read_bytes()))
    (job,) = resumed.jobs.values()
    assert job.slowdowns.open and job.links.edges  # the old incidents, in their trackers
    job.slowdowns.settle_s = 0.0
    got = [*(v for r in records[cut + 1 :] for v in resumed.update(r)), *resumed.finish()]

    def said(out: list) -> list:  # the rows and verdicts, as they would be stored
        return [msgspec.json.encode(x) for x in out if isinstance(x, msgspec.Struct)]

    assert said(got) == said(expected)
    assert any(isinstance(x, StepSummary) and x.throughput_ratio for x in got)
