"""The PyTorch collector's recorder: :class:`Collector`, one process's calls turned into
records off the hot path (see :mod:`producers.torch_collector` for how a job enables it).

The wrappers (:class:`~producers.torch_hooks.Hooks`) append an entry per call; the
collector's thread drains them every ``flush_s``: a finished call becomes a
:class:`~schemas.records.Collective` (a CUDA call once its events say the GPU is done), a
call open longer than ``partial_after_s`` goes out as joined but unfinished, and every
``heartbeat_s`` (and as a checkpoint save begins or ends) a
:class:`~schemas.records.Heartbeat` says how far each communicator got. The communicators
and the layout are :class:`~producers.torch_comms.CommBook`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from producers.host_cpu import cgroup_throttled, process_cpu
from producers.save_clock import SaveClock
from producers.torch_calls import DEND, DSTART, EV0, EV1, GpuTimer, tensor_info
from producers.torch_comms import CommBook
from producers.torch_hooks import Hooks
from schemas.records import Collective, CommProgress, Heartbeat, Iteration

Sink = Callable[[list[msgspec.Struct]], None]

_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "barrier",
)
_P2P = ("send", "recv", "isend", "irecv")


class CollectorError(RuntimeError):
    """The collector cannot run (torch missing, or enabled before the process group)."""


def torch_distributed() -> Any:
    """``torch.distributed``, or :class:`CollectorError` saying how to install torch."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise CollectorError(
            "the PyTorch collector needs torch: pip install 'megatrace[torch]'"
        ) from None
    return dist


class Collector(Hooks):
    """Records one process's ``torch.distributed`` calls (see the module docstring)."""

    def __init__(
        self,
        *,
        job: str,
        sink: Sink,
        node: str | None = None,
        gpu: int | None = None,
        heartbeat_s: float = 0.5,
        partial_after_s: float = 0.2,
        flush_s: float = 0.05,
        kernels: bool = False,
    ) -> None:
        dist = torch_distributed()
        if not dist.is_initialized():
            raise CollectorError("enable the collector after torch.distributed.init_process_group")
        self.dist = dist
        self.job = job
        self.sink = sink
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.node = node or socket.gethostname()
        self.gpu = gpu if gpu is not None else int(os.environ.get("LOCAL_RANK", self.rank))
        self.heartbeat_s = heartbeat_s
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.comms = CommBook(
            dist,
            job=job,
            rank=self.rank,
            world=self.world,
            node=self.node,
            gpu=self.gpu,
            salt="" if attempt in ("", "0") else f"@{attempt}",  # a restart's: new names
        )
        self.partial_ns = int(partial_after_s * 1e9)
        self.flush_s = flush_s
        self.kernels = kernels
        self._cupti: Any = None  # a started CuptiCollector when kernels are recorded
        self._mark: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        self._gpu: GpuTimer | None = None  # built at the first call on a CUDA tensor
        self.step: int | None = None
        self._marks: deque[Iteration] = deque()  # step markers, from step_done
        self._last_step_ns = 0
        self.calls = 0
        self._p2p_seq: dict[tuple[int, int], int] = {}  # (pair hash, sender) -> next seq
        self._pending: deque[list[Any]] = deque()  # appended by callers, drained here
        self._draining = threading.Lock()  # the collector's thread and explicit drains
        self._originals: dict[str, Any] = {}
        self._stop = threading.Event()
        self._tls = threading.local()
        self._thread: threading.Thread | None = None
        # checkpoints: the time spent saving; a heartbeat goes out as a save begins or ends
        self._beat_now = False
        self.save_clock = SaveClock(on_change=self._beat_soon)

    def declare(self, **layout: Any) -> None:
        """The job's parallel layout: ``tp``, ``pp``, ``dp``, ``ep``, ``num_layers``... as
        :meth:`~producers.torch_comms.CommBook.declare` takes them; rank 0 publishes the job
        record."""
        self.comms.declare(**layout)

    # ------------------------------------------------------------------ off the hot path
    def _device_done(self, e: list[Any]) -> bool:
        """Fill a CUDA call's device times as its events complete; True once it ended."""
        gpu = self._gpu
        if gpu is None:
            return False
        if e[DSTART] is None:
            e[DSTART] = gpu.time_ns(e[EV0])
        if e[EV1] is not None and e[DEND] is None:
            e[DEND] = gpu.time_ns(e[EV1])
        return e[DSTART] is not None and e[DEND] is not None

    def _record(self, e: list[Any]) -> Collective:
        c, op, seq, t, peer, enq, end = e[:7]
        start = None
        if e[EV0] is not None:  # device times, never before the host enqueued the call
            start = None if e[DSTART] is None else max(enq, e[DSTART])
            end = None if e[DEND] is None else max(start or enq, e[DEND])
        count, nbytes, dtype = tensor_info(t)
        return Collective(
            job=self.job,
            node=self.node,
            rank=self.rank,
            comm_hash=c.hash,
            comm_size=c.size,
            rank_in_comm=c.rank_in_comm,
            op=op,
            seq=seq,
            count=count,
            size_bytes=nbytes,
            dtype=dtype,
            enqueue_ns=enq,
            start_ns=start,
            end_ns=end,
            peer=peer,
        )

    def drain(
        self, now_ns: int | None = None, overdue_ns: int | None = None
    ) -> list[msgspec.Struct]:
        """Records due now: metadata, finished calls, and calls open longer than
        ``overdue_ns`` (as unfinished; by default the collector's partial timeout).

        Safe beside the collector's own thread: one drain at a time, so each call is
        taken (and reported) by exactly one of them."""
        overdue = self.partial_ns if overdue_ns is None else overdue_ns
        with self._draining:
            return self._drain(now_ns or time.time_ns(), overdue)

    def _drain(self, now: int, overdue_ns: int) -> list[msgspec.Struct]:
        out = self.comms.take()
        while self._marks:  # appended by the training loop: taken one by one
            out.append(self._marks.popleft())
        keep = []
        pending = self._pending
        for _ in range(len(pending)):  # callers may append meanwhile: take only these
            e = pending.popleft()
            ended = e[6] is not None if e[EV0] is None else self._device_done(e)
            if ended:
                out.append(self._record(e))
                c = e[0]
                c.completed = c.completed + 1 if e[1].is_p2p else max(c.completed, e[2])
                if e[EV0] is not None and self._gpu is not None:
                    self._gpu.release(e[EV0], e[EV1])
            else:
                if not e[7] and now - e[5] > overdue_ns:
                    out.append(self._record(e))
                    e[7] = True
                keep.append(e)
        pending.extendleft(reversed(keep))
        return out

    def step_done(self, step: int, now_ns: int | None = None) -> None:
        """A step hook: iteration ``step`` (the job's own number) just ended. Rank 0's become
        :class:`~schemas.records.Iteration` markers, the job's iteration clock; every
        rank's heartbeats say the step it is in."""
        now = now_ns or time.time_ns()
        last = self._last_step_ns
        self._last_step_ns = now
        self.step = step
        if self.rank == 0:
            self._marks.append(
                Iteration(job=self.job, step=step, end_ns=now, rank=self.rank,
                          duration_ns=now - last if last else None, source="torch-collector")
            )  # fmt: skip

    def saving(self) -> contextlib.AbstractContextManager[None]:
        """Checkpoint code, timed as the rank's saving (:class:`SaveClock`)."""
        return self.save_clock.saving()

    def _beat_soon(self) -> None:
        self._beat_now = True

    def heartbeat(self, now_ns: int | None = None, exiting: bool = False) -> Heartbeat:
        cpu = process_cpu()
        now = now_ns or time.time_ns()
        saved, since = self.save_clock.saves(now)
        return Heartbeat(
            job=self.job,
            node=self.node,
            rank=self.rank,
            ts_ns=now,
            pid=os.getpid(),
            step=self.step,
            comms=[
                CommProgress(comm_hash=c.hash, issued_seq=c.issued, completed_seq=c.completed)
                for c in self.comms.distinct()
            ],
            cpu_ns=cpu[0] if cpu else None,
            cpu_wait_ns=cpu[1] if cpu else None,
            cpu_throttled_ns=cgroup_throttled(),
            save_ns=saved,
            saving_since_ns=since,
            exiting=exiting,
        )

    def _loop(self) -> None:
        next_hb = 0.0
        while not self._stop.wait(self.flush_s):
            out = self.drain()
            if time.monotonic() >= next_hb or self._beat_now:
                self._beat_now = False
                out.append(self.heartbeat())
                next_hb = time.monotonic() + self.heartbeat_s
            if out:
                self.sink(out)
        # the last word, also when the process exits: a rank whose call failed because a
        # peer died is seen to have got as far as the others (a killed rank says nothing).
        # Every call still open goes out as joined but unfinished, however young: the
        # process ends in it, and a call left unsaid reads as one it never joined
        self.sink([*self.drain(overdue_ns=0), self.heartbeat(exiting=True)])

    # ------------------------------------------------------------------ control
    def install(self) -> Collector:
        """Wrap the functions in ``torch.distributed`` and in its ``distributed_c10d``
        module (``P2POp`` and ``batch_isend_irecv`` look them up there)."""
        if self.kernels:  # first: without CUPTI nothing is wrapped
            self._start_kernels()
        dist = self.dist
        c10d = dist.distributed_c10d
        for name in (*_OPS, *_P2P, "batch_isend_irecv"):
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is None or name in self._originals:
                continue
            self._originals[name] = fn
            if name == "batch_isend_irecv":
                wrap = self._batch(fn)
            elif name in _P2P:
                wrap = self._p2p(name, fn)
            else:
                wrap = self._collective(name, fn)
            for module in (dist, c10d):
                if hasattr(module, name):
                    setattr(module, name, wrap)
        self.save_clock.install()
        self._thread = threading.Thread(target=self._loop, name="megatrace-collector", daemon=True)
        self._thread.start()
        # after the sink's own exit handler (they run last first): ours still has its sink
        atexit.register(self._stop_thread)
        return self

    def _start_kernels(self) -> None:
        """Record this process's kernels through CUPTI; kernels launched inside a wrapped
        call are marked as NCCL kernels (by correlation, not by name)."""
        from producers.cupti import CuptiCollector

        self._cupti = CuptiCollector(
            job=self.job, node=self.node, rank=self.rank, sink=self.sink
        ).start()
        self._mark = self._cupti.nccl_call

    def uninstall(self) -> None:
        self.save_clock.uninstall()
        for name, fn in self._originals.items():
            for module in (self.dist, self.dist.distributed_c10d):
                if hasattr(module, name):
                    setattr(module, name, fn)
        self._originals.clear()
        if self._cupti is not None:
            self._cupti.stop()
            self._cupti, self._mark = None, contextlib.nullcontext
        atexit.unregister(self._stop_thread)
        self._stop_thread()

    def _stop_thread(self) -> None:
        """The collector's thread ends with what it still holds and a last heartbeat (at
        uninstall, and when the process exits: training over, or failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


__all__ = ["Collector", "CollectorError", "Sink", "torch_distributed"]
