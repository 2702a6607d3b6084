"""PyTorch collector: every ``torch.distributed`` collective and point-to-point call.

One line in a training script (after ``init_process_group``)::

    from producers import torch_collector
    torch_collector.enable(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4)

or, with no code change, under torchrun::

    torchrun --nproc-per-node 8 -m producers.torch_collector train.py --args ...

(the layout then comes from ``MEGATRACE_TP``/``_PP``/``_DP``/``_EP``/``_LAYERS``/
``_MICROBATCHES`` or from Megatron's ``parallel_state`` when it is set up).

The collector wraps the ``torch.distributed`` functions (any backend: NCCL,
Gloo), so code must call them through the module (``dist.all_reduce``), as
Megatron does. Per call the hot path only takes two clock readings, bumps the
communicator's sequence number and appends a small list; a background thread
turns those into :class:`~schemas.records.Collective` records, emits a
:class:`~schemas.records.Heartbeat` per rank every ``heartbeat_s``, and hands
batches to the sink (the node agent's socket by default; it never blocks).
A call still unfinished after ``partial_after_s`` is also reported as joined
but not finished, so a hang shows who waits and who never came.

Checkpoints are seen too: ``torch.save`` and ``torch.distributed.checkpoint``'s
``save`` and ``async_save`` are wrapped (code must call them through their
modules; other checkpoint code can be marked, ``with torch_collector.saving():``),
and the heartbeats say how long the rank spent saving and since when
a save is under way (a heartbeat goes out as a save begins and as it ends). A
rank saving holds its peers up at their next collective, as a straggler or a
hang would; the detectors tell it apart by this.

Calls on CUDA tensors (NCCL) return to Python as soon as they are enqueued, so
their host times say nothing: :class:`~producers.torch_calls.GpuTimer` takes their arrival (the
stream reached the call) and end (the stream waited for NCCL) from CUDA
events, and such a call is finished only when the GPU is done with it.
With ``kernels=True`` the process's GPU kernels come too, through CUPTI.

Communicators get a stable hash from their member ranks, so every member
names a group the same way; a job torchrun started again (its restart count,
``TORCHELASTIC_RESTART_COUNT``, the same on every rank) gets new ones, as NCCL
makes new communicators: the calls of a restarted job, numbered from 0 again,
are not taken for its first start's. Point-to-point calls go on a two-rank
communicator per pair of ranks (the n-th Send from A to B meets the n-th Recv
at B from A). Roles (TP/PP/DP) follow the declared Megatron layout.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from producers.host_cpu import cgroup_throttled, process_cpu
from producers.save_clock import SaveClock
from producers.torch_calls import (
    DEND,
    DSTART,
    EV0,
    EV1,
    Comm,
    GpuTimer,
    TimedWork,
    first_tensor,
    positional_group,
    returned,
    tensor_info,
)
from schemas.enums import TORCH_OP_NAMES, CollOp, CommRole
from schemas.layout import Layout, comm_hash
from schemas.records import (
    Collective,
    CommInfo,
    CommProgress,
    Heartbeat,
    Iteration,
    JobInfo,
    RankInfo,
)

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


def _torch() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        raise CollectorError(
            "the PyTorch collector needs torch: pip install 'megatrace[torch]'"
        ) from None
    return dist


class Collector:
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
        dist = _torch()
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
        self._salt = "" if attempt in ("", "0") else f"@{attempt}"  # (see the module doc)
        self.partial_ns = int(partial_after_s * 1e9)
        self.flush_s = flush_s
        self.kernels = kernels
        self._cupti: Any = None  # a started CuptiCollector when kernels are recorded
        self._mark: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        self._gpu: GpuTimer | None = None  # built at the first call on a CUDA tensor
        self.layout: dict[tuple[int, ...], CommRole] = {}
        self.tp = self.pp = self.dp = 1
        self._layout = Layout(self.world, 1, 1, 1)  # none told: a stage a rank
        self.step: int | None = None
        self._marks: deque[Iteration] = deque()  # step markers, from step_done
        self._last_step_ns = 0
        self.calls = 0
        self._groups: dict[int, Comm] = {}  # id(process group) -> communicator
        self._pairs: dict[tuple[int, int], Comm] = {}  # (low, high) global ranks
        self._p2p_seq: dict[tuple[int, int], int] = {}  # (pair hash, sender) -> next seq
        self._p2p_done: dict[int, int] = {}
        self._pending: deque[list[Any]] = deque()  # appended by callers, drained here
        self._draining = threading.Lock()  # the collector's thread and explicit drains
        self._meta: list[msgspec.Struct] = []
        self._announced: set[int] = set()
        self._originals: dict[str, Any] = {}
        self._stop = threading.Event()
        self._tls = threading.local()
        self._thread: threading.Thread | None = None
        # checkpoints: the time spent saving; a heartbeat goes out as a save begins or ends
        self._beat_now = False
        self.save_clock = SaveClock(on_change=self._beat_soon)

    # ------------------------------------------------------------------ layout
    def declare(
        self,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        num_layers: int = 0,
        num_microbatches: int = 1,
        global_batch_size: int = 0,
        micro_batch_size: int = 0,
        gpus_per_node: int | None = None,
        distributed_optimizer: bool = False,
        ep: int = 1,
    ) -> None:
        """The job's parallel layout (Megatron order; ``ep``: expert parallelism, out of
        data parallelism); rank 0 publishes the job record."""
        dp = dp or self.world // (tp * pp)
        self.tp, self.pp, self.dp = tp, pp, dp
        self._layout = Layout(self.world, tp, pp, dp, ep=ep)
        self.layout = self._layout.groups()
        now = time.time_ns()
        if self.rank == 0:
            self._meta.append(
                JobInfo(
                    job=self.job,
                    ts_ns=now,
                    source="torch",
                    world_size=self.world,
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    num_layers=num_layers,
                    global_batch_size=global_batch_size,
                    micro_batch_size=micro_batch_size,
                    num_microbatches=num_microbatches,
                    gpus_per_node=gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 8)),
                    distributed_optimizer=distributed_optimizer,
                    ep=ep,
                )
            )
        stage, d, t = self._layout.coords(self.rank)
        self._meta.append(
            RankInfo(
                job=self.job,
                ts_ns=now,
                rank=self.rank,
                node=self.node,
                gpu=self.gpu,
                tp_rank=t,
                pp_stage=stage,
                dp_rank=d,
                ep_rank=d % ep,
            )
        )
        self._announced.clear()
        for c in [*self._groups.values(), *self._pairs.values()]:
            self._announce(c)

    def _stage(self, rank: int) -> int:
        return self._layout.coords(rank)[0]

    def _announce(self, c: Comm) -> None:
        if c.hash in self._announced:
            return
        self._announced.add(c.hash)
        pair = c in self._pairs.values()
        role = CommRole.PP if pair and self.pp > 1 else self.layout.get(c.ranks, CommRole.OTHER)
        if pair and self.pp == 1:
            role = CommRole.OTHER
        stage = min(self._stage(r) for r in c.ranks)
        self._meta.append(
            CommInfo(
                job=self.job,
                ts_ns=time.time_ns(),
                comm_hash=c.hash,
                role=role,
                ranks=list(c.ranks),
                name=f"{role.value}:{','.join(map(str, c.ranks))}",
                pp_stage=stage,
            )
        )

    def _comm(self, group: Any) -> Comm:
        """The communicator of ``group`` (None: the default one). Groups of the same ranks
        are one communicator, one sequence: ``None`` and the default group object (which
        DDP passes) are, and so are two groups made of the same ranks (every member
        issues their calls in the program's order, so the numbers agree)."""
        c = self._groups.get(id(group))
        if c is None:
            dist = self.dist
            g = group if group is not None else dist.distributed_c10d._get_default_group()
            ranks = tuple(dist.get_process_group_ranks(g))
            h = comm_hash(f"group{self._salt}", ranks)
            c = next((x for x in self._groups.values() if x.hash == h), None)
            if c is None:
                c = Comm(h, ranks, self.rank)
                self._announce(c)
            self._groups[id(group)] = c
        return c

    def _pair(self, peer: int) -> Comm:
        key = (min(self.rank, peer), max(self.rank, peer))
        c = self._pairs.get(key)
        if c is None:
            c = self._pairs[key] = Comm(comm_hash(f"p2p{self._salt}", key), key, self.rank)
            self._announce(c)
        return c

    # ------------------------------------------------------------------ hot path
    def _collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        op = TORCH_OP_NAMES[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._tls, "inside", False):  # a deprecated name calling its new one
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = positional_group(name, args)
            c = self._comm(group)
            c.issued += 1
            t = first_tensor(args, kwargs)
            entry = [c, op, c.issued, t, None, time.time_ns(), None, False, None, None, None, None]
            gpu = self._timer(t)
            if gpu is not None:
                entry[EV0] = gpu.mark()
            self._pending.append(entry)
            self.calls += 1
            self._tls.inside = True
            try:
                with self._mark():
                    work = fn(*args, **kwargs)
            finally:
                self._tls.inside = False
            if work is None or not kwargs.get("async_op", False):
                returned(entry, gpu)
                return work
            return TimedWork(work, [entry], gpu)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = name
        return wrapper

    def _p2p_entry(self, sending: bool, tensor: Any, peer: int) -> list[Any]:
        c = self._pair(peer)
        key = (c.hash, self.rank if sending else peer)
        seq = self._p2p_seq.get(key, 0)
        self._p2p_seq[key] = seq + 1
        c.issued += 1
        op = CollOp.SEND if sending else CollOp.RECV
        entry = [c, op, seq, tensor, peer, time.time_ns(), None, False, None, None, None, None]
        gpu = self._timer(tensor)
        if gpu is not None:
            entry[EV0] = gpu.mark()
        self._pending.append(entry)
        self.calls += 1
        return entry

    def _p2p(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sending = name in ("send", "isend")
        blocking = name in ("send", "recv")

        def wrapper(tensor: Any, peer: int | None = None, *args: Any, **kwargs: Any) -> Any:
            if getattr(self._tls, "batch", False):  # recorded by batch_isend_irecv
                return fn(tensor, peer, *args, **kwargs)
            if peer is None:
                peer = kwargs.get("dst" if sending else "src")
            if peer is None:
                group_peer = kwargs.get("group_dst" if sending else "group_src")
                if group_peer is not None:
                    group = kwargs.get("group") or (args[0] if args else None)
                    peer = self.dist.get_global_rank(
                        group or self.dist.distributed_c10d._get_default_group(), group_peer
                    )
            if peer is None:  # recv from any source: nothing to pair it with
                return fn(tensor, *args, **kwargs)
            entry = self._p2p_entry(sending, tensor, peer)
            with self._mark():
                work = fn(tensor, peer, *args, **kwargs)
            if blocking:
                returned(entry, self._gpu if entry[EV0] is not None else None)
                return work
            return TimedWork(work, [entry], self._gpu if entry[EV0] is not None else None)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = name
        return wrapper

    def _batch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(p2p_op_list: list[Any]) -> Any:
            entries = [
                self._p2p_entry(getattr(op.op, "__name__", "") == "isend", op.tensor, op.peer)
                for op in p2p_op_list
            ]
            self._tls.batch = True
            try:
                with self._mark():
                    works = fn(p2p_op_list)
            finally:
                self._tls.batch = False
            gpu = self._gpu if entries and entries[0][EV0] is not None else None
            if len(works) == len(entries):
                return [TimedWork(w, [e], gpu) for w, e in zip(works, entries, strict=True)]
            return [TimedWork(w, entries, gpu) for w in works]  # coalesced: one completion for all

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    # ------------------------------------------------------------------ off the hot path
    def _timer(self, t: Any) -> GpuTimer | None:
        """The device timer for a call on ``t`` (None: not a CUDA tensor)."""
        if t is None or not getattr(t, "is_cuda", False):
            return None
        if self._gpu is None:
            import torch

            self._gpu = GpuTimer(torch.cuda)
        return self._gpu

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
        out: list[msgspec.Struct] = self._meta
        self._meta = []
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
        comms = [*self._groups.values(), *self._pairs.values()]
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
                for c in {c.hash: c for c in comms}.values()
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


# --------------------------------------------------------------------------- entry points


def default_sink() -> Sink:
    """The node agent's socket (``MEGATRACE_AGENT__SOCKET``; what it cannot take at once
    waits in the client's bounded backlog), or a JSON-lines file
    (``MEGATRACE_COLLECT_FILE``) the agent tails."""
    from schemas.codec import encode

    path = os.environ.get("MEGATRACE_COLLECT_FILE")
    if path:
        lock = threading.Lock()

        def to_file(records: list[msgspec.Struct]) -> None:
            with lock, open(path, "ab") as f:
                f.write(b"".join(encode(r) + b"\n" for r in records))

        return to_file
    from producers.agent import AgentClient

    client = AgentClient(os.environ.get("MEGATRACE_AGENT__SOCKET", ".megatrace/agent.sock"))
    atexit.register(client.close)  # what still waits for the agent's socket gets a moment
    return client.send


_active: Collector | None = None


def enable(
    job: str | None = None,
    *,
    sink: Sink | None = None,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    num_layers: int | None = None,
    num_microbatches: int | None = None,
    kernels: bool | None = None,
    distributed_optimizer: bool = False,
    ep: int | None = None,
    **kwargs: Any,
) -> Collector:
    """Start collecting in this process (after ``init_process_group``); idempotent.

    ``kernels`` (default: ``MEGATRACE_KERNELS=1``) also records the process's GPU
    kernels through CUPTI (``pip install 'megatrace[cupti]'``), NCCL kernels marked.
    """
    global _active
    if _active is not None:
        return _active
    env = os.environ
    job = job or env.get("MEGATRACE_JOB") or env.get("TORCHELASTIC_RUN_ID") or "torch-job"
    if kernels is None:
        kernels = env.get("MEGATRACE_KERNELS") == "1"
    col = Collector(job=job, sink=sink or default_sink(), kernels=kernels, **kwargs)
    layout = _megatron_layout() or {}
    told = (tp, pp, dp, num_layers, num_microbatches)
    if (
        not layout
        and all(x is None for x in told)
        and not any(k in env for k in ("MEGATRACE_TP", "MEGATRACE_PP", "MEGATRACE_DP"))
    ):  # nobody said: the job record claims no layout (the analysis learns it)
        col.declare(tp=1, pp=1, dp=1)
        _active = col.install()
        return col
    col.declare(
        tp=tp or int(env.get("MEGATRACE_TP", layout.get("tp", 1))),
        pp=pp or int(env.get("MEGATRACE_PP", layout.get("pp", 1))),
        dp=dp or (int(env["MEGATRACE_DP"]) if "MEGATRACE_DP" in env else None),
        num_layers=num_layers or int(env.get("MEGATRACE_LAYERS", 0)),
        num_microbatches=num_microbatches or int(env.get("MEGATRACE_MICROBATCHES", 1)),
        distributed_optimizer=distributed_optimizer,
        ep=ep or int(env.get("MEGATRACE_EP", layout.get("ep", 1))),
    )
    _active = col.install()
    return col


def step(n: int) -> None:
    """The step hook of the active collector (a no-op when none is enabled): call it at the
    end of every training iteration with the job's own number for it."""
    if _active is not None:
        _active.step_done(n)


def saving() -> contextlib.AbstractContextManager[None]:
    """Checkpoint code the collector does not wrap, as ``with torch_collector.saving():``
    (a file synced to disk, an upload; a no-op when no collector is enabled): its time is
    the rank's saving, as ``torch.save``'s is."""
    return _active.saving() if _active is not None else contextlib.nullcontext()


def disable() -> None:
    """Stop collecting; what was recorded is flushed to the sink."""
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None


def _megatron_layout() -> dict[str, int] | None:
    try:
        from megatron.core import parallel_state as ps  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not ps.model_parallel_is_initialized():
        return None
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        # (older releases have no expert parallelism)
        "ep": getattr(ps, "get_expert_model_parallel_world_size", lambda: 1)(),
    }


def _launch(argv: list[str]) -> None:
    """``-m producers.torch_collector script.py ...``: enable once the process group is up."""
    import runpy

    dist = _torch()
    original = dist.init_process_group

    def init_then_enable(*args: Any, **kwargs: Any) -> Any:
        r = original(*args, **kwargs)
        enable()
        return r

    dist.init_process_group = init_then_enable
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m producers.torch_collector SCRIPT [ARGS...]")
    _launch(sys.argv[1:])


__all__ = ["Collector", "CollectorError", "disable", "enable", "saving", "step"]
