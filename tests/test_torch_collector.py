"""The PyTorch collector in one process (a one-rank Gloo group): records, sequence
numbers, completion of async work, partial reports, heartbeats, and uninstall."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from producers import torch_calls, torch_collector  # noqa: E402
from schemas.enums import CollOp, CommRole  # noqa: E402
from schemas.layout import comm_hash  # noqa: E402
from schemas.records import Collective, CommInfo, Heartbeat, JobInfo, RankInfo  # noqa: E402


@pytest.fixture
def pg() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    torch_collector.disable()
    dist.destroy_process_group()


def test_enable_before_the_process_group_is_a_clear_error() -> None:
    with pytest.raises(torch_collector.CollectorError, match="init_process_group"):
        torch_collector.Collector(job="j", sink=lambda r: None)


def test_calls_become_records_with_sequence_numbers_and_completion(pg: None) -> None:
    got: list[Any] = []
    col = torch_collector.Collector(job="j", sink=got.extend, node="n0")
    col.declare(tp=1, pp=1, num_layers=2, num_microbatches=1)
    original = dist.all_reduce
    col.install()
    try:
        t = torch.ones(16, dtype=torch.bfloat16)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        work = dist.all_reduce(t, async_op=True)
        pending = col.drain(now_ns=2**62)  # not waited on yet: reported as unfinished
        (unfinished,) = [r for r in pending if isinstance(r, Collective)][-1:]
        assert unfinished.end_ns is None and unfinished.seq == 2
        work.wait()
        col.heartbeat()
    finally:
        col.uninstall()
    assert dist.all_reduce is original  # uninstall puts torch back
    colls = [r for r in [*pending, *got] if isinstance(r, Collective)]
    finished = [c for c in colls if c.end_ns is not None]
    assert [(c.op, c.seq) for c in finished] == [
        (CollOp.ALL_REDUCE, 0),
        (CollOp.BROADCAST, 1),
        (CollOp.ALL_REDUCE, 2),
    ]
    c = finished[0]
    assert (c.count, c.size_bytes, c.dtype.value, c.comm_size, c.node) == (
        16,
        32,
        "bfloat16",
        1,
        "n0",
    )
    assert all(c.end_ns >= c.enqueue_ns for c in finished)
    meta = {type(r) for r in [*pending, *got]}
    assert {JobInfo, RankInfo, CommInfo} <= meta
    (world,) = [r for r in [*pending, *got] if isinstance(r, CommInfo)]
    assert world.ranks == [0] and world.role == CommRole.WORLD
    hb = col.heartbeat()
    assert isinstance(hb, Heartbeat) and hb.comms[0].completed_seq == 2


def test_a_drain_beside_the_collectors_thread_reports_each_call_once(pg: None) -> None:
    # the collector's own thread drains (here every 0.5 ms); a caller may drain too
    # (tests, a flush at exit): each call must be taken by exactly one of them
    got: list[Any] = []
    col = torch_collector.Collector(job="j", sink=got.extend, node="n0", flush_s=0.0005)
    col.install()
    stop = threading.Event()
    errors: list[BaseException] = []

    def drain() -> None:
        while not stop.is_set():
            try:
                got.extend(col.drain())
            except BaseException as e:  # reported by the assertion below
                errors.append(e)
                return

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as a loaded machine would
    other = threading.Thread(target=drain)
    other.start()
    try:
        t = torch.ones(4)
        for _ in range(3000):
            dist.all_reduce(t)
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(switch)
        col.uninstall()
    assert not errors
    seqs = sorted(r.seq for r in got if isinstance(r, Collective))
    assert seqs == list(range(3000))


def test_the_same_group_gets_the_same_hash_on_every_member() -> None:
    a = comm_hash("group", (0, 1, 2, 3))
    assert a == comm_hash("group", [0, 1, 2, 3])
    assert a != comm_hash("group", (0, 1, 2, 4))
    assert a != comm_hash("p2p", (0, 1, 2, 3))


def test_kernels_without_cupti_are_a_clear_error_and_wrap_nothing(pg: None) -> None:
    pytest.importorskip("producers.cupti")
    try:
        import cupti  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("cupti-python is installed here")
    from producers.cupti import CuptiUnavailable

    original = dist.all_reduce
    with pytest.raises(CuptiUnavailable, match=r"megatrace\[cupti\]"):
        torch_collector.enable("j", sink=lambda r: None, tp=1, pp=1, kernels=True)
    assert dist.all_reduce is original
    assert torch_collector.enable("j", sink=lambda r: None, tp=1, pp=1).kernels is False


class FakeCuda:
    """A stand-in for ``torch.cuda``: events on the side stream complete at once
    (an idle stream), events on the current stream when the test says the GPU
    reached them."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def Stream(self) -> object:
        return object()

    def Event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.t: float | None = None

    def record(self, stream: object | None = None) -> None:
        self.t = self.cuda.now_ms if stream is not None else None

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.t is not None and other.t is not None
        return other.t - self.t


def test_cuda_calls_take_their_times_from_the_device_not_the_host(pg: None) -> None:
    # NCCL returns to Python at once: a call is finished when the GPU finished it
    got: list[Any] = []
    col = torch_collector.Collector(job="j", sink=got.extend, node="n0", flush_s=3600)
    cuda = FakeCuda()
    timer = torch_calls.GpuTimer(cuda)
    anchor_host = timer._next[1]
    col._timer = lambda t: timer  # every call is a CUDA call on the fake device
    col._gpu = timer
    col.declare(tp=1, pp=1)
    col.install()
    try:
        t = torch.ones(16)
        dist.all_reduce(t)  # the host is back; the GPU has not reached the call
        (entry,) = [e for e in col._pending if e[1] == CollOp.ALL_REDUCE]
        before, after = entry[8], entry[9]
        assert not [r for r in col.drain() if isinstance(r, Collective)]
        (partial,) = [r for r in col.drain(now_ns=2**62) if isinstance(r, Collective)]
        assert partial.start_ns is None and partial.end_ns is None  # not even arrived
        # the GPU arrives 5 ms after the host enqueued the call (device times are on the
        # anchor's clock: milliseconds since it), however long the host took to get there
        enqueued_ms = (entry[5] - anchor_host) / 1e6
        before.t = enqueued_ms + 5.0
        (joined,) = [r for r in col.drain(now_ns=2**62) if isinstance(r, Collective)] or [None]
        assert joined is None  # reported once as unfinished, then only when it ends
        after.t = before.t + 7.5  # ... and finishes 7.5 ms later
        (done,) = [r for r in col.drain() if isinstance(r, Collective)]
    finally:
        col.uninstall()
    assert done.start_ns == anchor_host + round(before.t * 1e6)
    assert done.end_ns == anchor_host + round(after.t * 1e6)
    assert abs(done.end_ns - done.start_ns - 7_500_000) <= 1  # (float milliseconds)
    assert done.enqueue_ns < done.start_ns
    assert col.heartbeat().comms[0].completed_seq == 0


def test_a_cuda_call_the_gpu_never_finishes_stays_unfinished(pg: None) -> None:
    got: list[Any] = []
    col = torch_collector.Collector(job="j", sink=got.extend, node="n0", flush_s=3600)
    cuda = FakeCuda()
    timer = torch_calls.GpuTimer(cuda)
    col._timer = lambda t: timer
    col._gpu = timer
    col.declare(tp=1, pp=1)
    col.install()
    try:
        work = dist.all_reduce(torch.ones(4), async_op=True)
        work.wait()  # the host waited: the stream is marked, the GPU is hung
        (entry,) = [e for e in col._pending if e[1] == CollOp.ALL_REDUCE]
        entry[8].t = 1.0  # it arrived on the GPU
        (partial,) = [r for r in col.drain(now_ns=2**62) if isinstance(r, Collective)]
        for _ in range(3):
            assert not [r for r in col.drain(now_ns=2**62) if isinstance(r, Collective)]
    finally:
        col.uninstall()
    assert partial.start_ns is not None and partial.end_ns is None
    assert col.heartbeat().comms[0].completed_seq == -1


_FAILS = """
import socket, sys, time
import torch, torch.distributed as dist
from producers import torch_collector
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch_collector.enable("j", heartbeat_s=3600)
time.sleep(0.3)  # the first heartbeat goes out before any call
dist.all_reduce(torch.ones(4))
work = dist.all_reduce(torch.ones(4), async_op=True)  # its failure is the process's end
raise RuntimeError("Connection closed by peer")  # as Gloo fails a call whose peer died
"""


def test_a_process_that_fails_sends_what_it_holds_and_a_last_heartbeat(tmp_path) -> None:
    """Training that ends in an error (a peer gone) still tells how far the rank got: its
    calls and a heartbeat, sent as the process exits. The call it fails in goes out as
    joined and unfinished, however young: left unsaid, the rank would read as one that
    never joined it, the way a killed rank does."""
    import os
    import subprocess

    from schemas.codec import read_jsonl

    out = tmp_path / "records.jsonl"
    env = {**os.environ, "MEGATRACE_COLLECT_FILE": str(out)}
    p = subprocess.run([sys.executable, "-c", _FAILS], env=env, capture_output=True, timeout=120)
    assert p.returncode == 1 and b"Connection closed by peer" in p.stderr
    records = list(read_jsonl(out))
    call, failed = [r for r in records if isinstance(r, Collective)]
    assert (call.seq, failed.seq) == (0, 1) and failed.end_ns is None
    beats = [r for r in records if isinstance(r, Heartbeat)]
    assert len(beats) == 2 and not beats[0].comms  # before the call, then at exit
    assert beats[-1].comms[0].completed_seq == 0 and beats[-1].ts_ns >= call.end_ns


class _FinishedWork:
    """A finished torch ``Work`` whose future holds a result or an error."""

    def __init__(self, error: Exception | None) -> None:
        self.fut = torch.futures.Future()
        if error is None:
            self.fut.set_result([torch.ones(1)])
        else:
            self.fut.set_exception(error)

    def get_future(self) -> Any:
        return self.fut

    def is_completed(self) -> bool:
        return True


class _FuturelessWork(_FinishedWork):
    """A finished ``Work`` of a backend without futures, or whose future is not set yet."""

    def __init__(self, unset: bool) -> None:
        self.unset = unset
        self.fut = torch.futures.Future()

    def get_future(self) -> Any:
        if self.unset:
            return self.fut
        raise RuntimeError("this backend has no futures")


@pytest.mark.parametrize("unset", [True, False], ids=["future-not-set-yet", "no-futures"])
def test_a_completed_call_whose_future_says_nothing_is_completed(unset: bool) -> None:
    entry: list[Any] = [None] * 12
    assert torch_calls.TimedWork(_FuturelessWork(unset), [entry]).is_completed()
    assert entry[6] is not None


@pytest.mark.parametrize("how", ["future", "is_completed"])
def test_a_call_that_failed_is_not_completed(how: str) -> None:
    """Gloo fails a call at once when its peer dies: the call stays unfinished (the rank
    waits in it, as its peers do), where one that succeeded is stamped done."""
    entries = {ok: [None] * 12 for ok in (True, False)}
    for ok, entry in entries.items():
        work = torch_calls.TimedWork(_FinishedWork(None if ok else RuntimeError("peer gone")),
                                     [entry])  # fmt: skip
        if how == "future":
            work.get_future()
        else:
            assert work.is_completed()
    assert entries[True][6] is not None and entries[False][6] is None


def test_checkpoint_saves_are_timed_once_and_told_in_heartbeats(pg: None, tmp_path) -> None:
    """A save under way is told with its start; a finished one adds its time once, also
    where DCP's ``save`` calls ``torch.save`` inside (and on its own threads); uninstall
    puts both back."""
    import torch.distributed.checkpoint as dcp

    got: list[Any] = []
    col = torch_collector.Collector(job="j", sink=got.extend, node="n0")
    original_save, original_dcp = torch.save, dcp.save
    seen: list[Heartbeat] = []

    class Slow:  # a file object whose writes take their time, beating as they go
        def __init__(self, f: Any) -> None:
            self.f = f

        def write(self, b: Any) -> int:
            seen.append(col.heartbeat())
            return self.f.write(b)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    col.install()
    try:
        assert col.heartbeat().save_ns == 0 and col.heartbeat().saving_since_ns is None
        with open(tmp_path / "a.pt", "wb") as f:
            torch.save({"w": torch.zeros(1 << 16)}, Slow(f))
        after_one = col.heartbeat()
        t0 = time.time_ns()
        dcp.save({"w": torch.ones(1 << 16)}, checkpoint_id=str(tmp_path / "dcp"))
        wall = time.time_ns() - t0
        after_two = col.heartbeat()
        with col.saving():  # checkpoint code it does not wrap, with a save inside
            time.sleep(0.05)
            torch.save({"w": torch.zeros(4)}, tmp_path / "b.pt")
        after_three = col.heartbeat()
    finally:
        col.uninstall()
    assert torch.save is original_save and dcp.save is original_dcp
    during = [hb for hb in seen if hb.saving_since_ns is not None]
    assert during and all(hb.save_ns > 0 for hb in during)
    assert after_one.saving_since_ns is None
    assert after_one.save_ns >= max(hb.save_ns for hb in during)
    assert 0 < after_two.save_ns - after_one.save_ns <= wall  # the DCP save's, once
    assert 0.05e9 <= after_three.save_ns - after_two.save_ns < 5e9


def test_the_default_group_passed_or_not_is_one_communicator_with_one_sequence(pg: None) -> None:
    """DDP passes the default group object to its all-reduces; a barrier after a save
    passes none. One communicator, numbered in the order called (two sequences of one
    hash would pair a barrier with a gradient all-reduce of the same number)."""
    got: list[Any] = []
    col = torch_collector.Collector(job="j", sink=got.extend, node="n0")
    col.install()
    try:
        t = torch.ones(4)
        default = dist.distributed_c10d._get_default_group()
        dist.all_reduce(t, group=default)
        dist.barrier()
        dist.all_reduce(t, group=dist.new_group([0]))  # another group of the same ranks
        got += col.drain(now_ns=2**62)
    finally:
        col.uninstall()
    colls = sorted((c.seq, c.op, c.comm_hash) for c in got if isinstance(c, Collective))
    first = colls[0][0]
    assert [(s - first, op) for s, op, _ in colls] == [
        (0, CollOp.ALL_REDUCE), (1, CollOp.BARRIER), (2, CollOp.ALL_REDUCE)
    ]  # fmt: skip
    assert len({h for _, _, h in colls}) == 1
