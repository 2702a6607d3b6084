"""A job started again after a failure (torchrun restarts every rank from the last
checkpoint): its processes are new and number their calls from 0 again."""

from __future__ import annotations

import socket

import msgspec
import pytest

from detectors.job import JobAnalyzer
from detectors.topology import Topology
from detectors.verdicts import VerdictBook
from detectors.watchdog import HangWatch, JobView
from schemas.config import DetectSettings
from schemas.enums import CommRole
from schemas.records import CommInfo, CommProgress, Heartbeat, JobInfo
from tests.recordings import ORDERS, read_records, replayed

S = 10**9
WORLD = 30


def beat(rank: int, t: float, issued: int, done: int, pid: int) -> Heartbeat:
    return Heartbeat(job="j", node=f"n{rank}", rank=rank, ts_ns=int(t * S), pid=pid,
                     comms=[CommProgress(comm_hash=WORLD, issued_seq=issued,
                                         completed_seq=done)])  # fmt: skip


def test_a_hang_is_over_when_the_job_restarted_runs_though_its_calls_count_from_0() -> None:
    """Rank 2 dies in call 1001 of a long job; the others wait. The job is started again
    (new processes) and runs: the hang is over at its first call done, not once its
    calls number past the first start's."""
    topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=3, dp=3))
    topo.add(CommInfo(job="j", ts_ns=0, comm_hash=WORLD, role=CommRole.DP, ranks=[0, 1, 2]))
    view = JobView(topo, VerdictBook("j"), expected_ns=0.1 * S, coll_now_ns=0,
                   place=lambda *_: None)  # fmt: skip
    watch, told, t = HangWatch(), [], 0.0
    for k in range(10):  # healthy: a call every 0.1 s, up to call 1000
        t = round(t + 0.1, 3)
        for r in range(3):
            told += watch.heartbeat(beat(r, t, 991 + k, 991 + k, 100 + r), view.book)
        told += watch.tick(int(t * S), view)
    for _ in range(20):  # rank 2 gone; the others wait in call 1001
        t = round(t + 0.1, 3)
        for r in range(2):
            told += watch.heartbeat(beat(r, t, 1001, 1000, 100 + r), view.book)
        told += watch.tick(int(t * S), view)
    for k in range(30):  # started again: new processes, calls from 0
        t = round(t + 0.1, 3)
        for r in range(3):
            told += watch.heartbeat(beat(r, t, k, k, 200 + r), view.book)
        told += watch.tick(int(t * S), view)
    (opened,) = [v for v in told if v.status.value == "open"]
    assert opened.kind.value == "hang" and opened.rank == 2
    (over,) = [v for v in told if v.status.value == "resolved"]
    assert over.resolved_ns / S == pytest.approx(3.1)  # the restart's first beat


def test_a_job_stopped_whole_mid_step_and_started_again_is_no_hang() -> None:
    """Every rank killed at once (a preemption: no last words), ranks 0 and 1 just into
    call 1001 and rank 2 not yet; the job started again, its ranks' new processes beating
    one after the other before any call. Nothing hung: no verdict."""
    job = JobAnalyzer("j")
    told = job.update(JobInfo(job="j", ts_ns=0, world_size=3, dp=3))
    told += job.update(CommInfo(job="j", ts_ns=0, comm_hash=WORLD, role=CommRole.DP,
                                ranks=[0, 1, 2]))  # fmt: skip
    job.durations.extend([int(0.1 * S)] * 10)  # its steps took 0.1 s
    t = 0.0
    for k in range(10):
        t = round(t + 0.1, 3)
        for r in range(3):
            told += job.update(beat(r, t, 991 + k, 991 + k, 100 + r))
        told += job.tick(int(t * S))
    for r in (0, 1):
        told += job.update(beat(r, t + 0.05, 1001, 1000, 100 + r))
    for k, r in enumerate((0, 1, 2)):  # started again 4 s later, no call yet
        told += job.update(Heartbeat(job="j", node=f"n{r}", rank=r, pid=200 + r,
                                     ts_ns=int((t + 4 + 0.2 * k) * S)))  # fmt: skip
        told += job.tick(int((t + 4 + 0.2 * k) * S))
    assert [v for v in told if type(v).__name__ == "Verdict"] == []


def test_a_job_whose_processes_all_ended_in_a_call_is_told_hung_when_the_last_says_so() -> None:
    """Rank 2 killed outright in call 1001 (it says nothing more); its peers fail and
    exit, each with a last heartbeat that says so. No record will come again, so no
    silence would grow: the job's end is judged at the last of those, naming rank 2. A
    job that ends its training normally is no hang."""
    topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=3, dp=3))
    topo.add(CommInfo(job="j", ts_ns=0, comm_hash=WORLD, role=CommRole.DP, ranks=[0, 1, 2]))
    for killed in (True, False):
        view = JobView(topo, VerdictBook("j"), expected_ns=0.1 * S, coll_now_ns=0,
                       place=lambda *_: None)  # fmt: skip
        watch, told, t = HangWatch(), [], 0.0
        for k in range(10):
            t = round(t + 0.1, 3)
            for r in range(3):
                told += watch.heartbeat(beat(r, t, 991 + k, 991 + k, 100 + r), view.book)
            told += watch.tick(int(t * S), view)
        for r in (0, 1):  # their last words: in call 1001 (failed), or done
            last = beat(r, t + 0.3 * (r + 1), 1001 if killed else 1000, 1000, 100 + r)
            told += watch.heartbeat(msgspec.structs.replace(last, exiting=True), view.book)
            told += watch.tick(last.ts_ns, view)
        if not killed:
            last = beat(2, t + 0.9, 1000, 1000, 102)
            told += watch.heartbeat(msgspec.structs.replace(last, exiting=True), view.book)
            told += watch.tick(last.ts_ns, view)
            assert told == []
            continue
        (hang,) = told
        assert (hang.kind.value, hang.rank) == ("hang", 2)
        assert hang.detected_ns == int((t + 0.6) * S)
        assert "the job's processes ended there" in hang.summary


def test_a_start_waits_for_its_slowest_rank_up_to_the_start_limit_first_or_again() -> None:
    """Rank 2 is in its first call 3 s before ranks 0 and 1 come to it (they load the
    model slower), in the job's first start and in a start after rank 2 failed: a start,
    no hang (the limit after steps of 0.1 s is 0.5 s). A rank that never comes is a hang
    once the start took ``start_hang_s``, named."""
    topo = Topology.from_job(JobInfo(job="j", ts_ns=0, world_size=3, dp=3))
    topo.add(CommInfo(job="j", ts_ns=0, comm_hash=WORLD, role=CommRole.DP, ranks=[0, 1, 2]))
    for again, late in ((False, 3.0), (True, 3.0), (False, None), (True, None)):
        view = JobView(topo, VerdictBook("j"), expected_ns=0.1 * S, coll_now_ns=0,
                       place=lambda *_: None,
                       settings=DetectSettings(start_hang_s=10.0))  # fmt: skip
        watch, told, t, pid = HangWatch(), [], 0.0, 100
        if again:  # a first start that ran, then rank 2 failed and all were started again
            for k in range(10):
                t = round(t + 0.1, 3)
                for r in range(3):
                    told += watch.heartbeat(beat(r, t, k, k, pid + r), view.book)
                told += watch.tick(int(t * S), view)
            for r in (0, 1):
                last = beat(r, t + 0.3 * (r + 1), 10, 9, pid + r)
                told += watch.heartbeat(msgspec.structs.replace(last, exiting=True), view.book)
                told += watch.tick(last.ts_ns, view)
            t, pid = t + 2.0, 200
            assert [v.rank for v in told] == [2]  # the first start's end
            told = []
        start = t
        while t < start + 20 and not (late is not None and t > start + late + 1):
            t = round(t + 0.1, 3)
            came = late is not None and t >= start + late
            for r in range(3):
                if r == 2 or came:  # in call 0; done once the last came a beat before
                    done = 0 if came and t >= start + late + 0.1 else -1
                    told += watch.heartbeat(beat(r, t, 0, done, pid + r), view.book)
                else:  # alive, loading: no communicator yet
                    told += watch.heartbeat(Heartbeat(job="j", node=f"n{r}", rank=r, pid=pid + r,
                                                      ts_ns=int(t * S)), view.book)  # fmt: skip
            told += watch.tick(int(t * S), view)
        told = [v for v in told if v.status.value == "open"]  # (not the first start's end)
        if late is not None:
            assert told == [], (again, [v.summary for v in told])
            continue
        (hang,) = told
        assert hang.kind.value == "hang" and sorted(hang.culprit_ranks) == [0, 1]
        assert hang.detected_ns / S == pytest.approx(start + 10.1, abs=0.15)


def test_a_restarted_job_names_its_communicators_anew(monkeypatch) -> None:
    """As NCCL makes new communicators: the restart count torchrun gives every rank
    changes the hashes (the first start's are the ranks' alone)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from producers import torch_collector

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        hashes = []
        for attempt in ("0", "1", "2"):
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
            col = torch_collector.Collector(job="j", sink=lambda r: None)
            hashes.append(col.comms.of(None).hash)
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
        first = torch_collector.Collector(job="j", sink=lambda r: None).comms.of(None).hash
        assert len(set(hashes)) == 3 and hashes[0] == first
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("order", ORDERS)
def test_a_real_job_restarted_after_a_rank_was_killed_has_one_hang_and_nothing_else(
    order: str,
) -> None:
    """Case ddp-restart from `megatrace lab`: rank 3 of a DDP job killed at step 12, its
    peers failed; four seconds later every rank started again (torchrun's restart count
    1) from the checkpoint of step 10, and the job ran to step 89, saving every 10 steps.
    One incident: rank 3's hang, over when the job started again. (The recording is the
    job's stored records: the markers of steps 10-12 of its first start were replaced by
    its second's.)"""
    records = read_records("lab_ddp_restart.jsonl.gz")
    pids = {(r.rank, r.pid) for r in records if isinstance(r, Heartbeat)}
    assert len(pids) == 8  # two processes a rank
    world = {r.comm_hash for r in records if isinstance(r, CommInfo) and len(r.ranks) == 4}
    assert len(world) == 2  # the second start's communicator is a new one, as NCCL's are
    (hang,) = replayed(records, order)
    assert (hang.kind.value, hang.rank, hang.status.value) == ("hang", 3, "resolved")
