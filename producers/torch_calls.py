"""What one ``torch.distributed`` call gives the PyTorch collector
(:mod:`producers.torch_collector`): a call in flight (a small list, see ``EV0``), the
communicator it counts on (:class:`Comm`), its device-side times for CUDA tensors
(:class:`GpuTimer`), the ``Work`` of an asynchronous call that stamps its completion
when it is waited on (:class:`TimedWork`), and its tensors' sizes (:func:`tensor_info`).

>>> tensor_info(None)
(0, 0, <DType.UINT8: 'uint8'>)
>>> positional_group("broadcast", ("t", 0, "group"))
'group'
"""

from __future__ import annotations

import time
from typing import Any

from schemas.enums import DType

# A call in flight is a list: [comm, op, seq, tensor, peer, enqueue_ns, host_end_ns,
# reported, ev_before, ev_after, device_start_ns, device_end_ns] (events: CUDA calls only).
EV0, EV1, DSTART, DEND = 8, 9, 10, 11


class Comm:
    """A communicator as one rank counts its calls: its hash, members and this rank's
    place in them, the newest sequence number it issued and completed."""

    __slots__ = ("completed", "hash", "issued", "rank_in_comm", "ranks", "size")

    def __init__(self, h: int, ranks: tuple[int, ...], me: int) -> None:
        self.hash = h
        self.ranks = ranks
        self.size = len(ranks)
        self.rank_in_comm = ranks.index(me) if me in ranks else 0
        self.issued = -1
        self.completed = -1


class GpuTimer:
    """Device-side times of calls on CUDA tensors, on the host clock, from CUDA events.

    A NCCL call returns to Python as soon as it is enqueued, so host clocks say
    nothing about when the GPU reached it or finished it. :meth:`mark` records an
    event on the current stream: one before the call (it completes when the GPU
    arrives at the call) and one after it returns, or after ``wait()`` for async
    work (it completes when the stream has waited for NCCL). :meth:`time_ns`
    gives a completed event's time on the host clock, from its distance to an
    anchor event recorded on an idle side stream at a known host time (renewed
    every ``anchor_s``); ``None`` while the GPU has not reached it. ``cuda`` is
    ``torch.cuda`` (a stand-in in tests).
    """

    def __init__(self, cuda: Any, anchor_s: float = 30.0) -> None:
        self.cuda = cuda
        self.anchor_ns = int(anchor_s * 1e9)
        self._side = cuda.Stream()
        self._free: list[Any] = []
        self._anchor: tuple[Any, int] | None = None
        self._next: tuple[Any, int] | None = None
        self._renew()

    def _event(self) -> Any:
        try:  # the caller's thread and the collector's both take events
            return self._free.pop()
        except IndexError:
            return self.cuda.Event(enable_timing=True)

    def _renew(self) -> None:
        ev = self._event()
        ev.record(self._side)
        self._next = (ev, time.time_ns())

    def mark(self) -> Any:
        """An event recorded now on the current stream."""
        ev = self._event()
        ev.record()
        return ev

    def time_ns(self, ev: Any) -> int | None:
        """Host-clock time of a recorded event, or None if the GPU has not reached it."""
        if self._next is not None and self._next[0].query():
            if self._anchor is not None:
                self._free.append(self._anchor[0])
            self._anchor, self._next = self._next, None
        if self._anchor is None or not ev.query():
            return None
        anchor, host = self._anchor
        if self._next is None and time.time_ns() - host > self.anchor_ns:
            self._renew()
        return host + round(anchor.elapsed_time(ev) * 1e6)

    def release(self, *events: Any) -> None:
        """Give events back for reuse."""
        self._free.extend(e for e in events if e is not None)


class TimedWork:
    """A torch ``Work`` that stamps its calls' completion when it is waited on."""

    def __init__(self, work: Any, entries: list[list[Any]], gpu: GpuTimer | None = None) -> None:
        self._work = work
        self._entries = entries
        self._gpu = gpu

    def _done(self) -> None:
        for e in self._entries:
            if e[6] is None:
                returned(e, self._gpu)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        r = self._work.wait(*args, **kwargs)
        self._done()
        return r

    def is_completed(self) -> bool:
        done = bool(self._work.is_completed())
        if done and self._succeeded():
            self._done()
        return done

    def _succeeded(self) -> bool:
        try:
            fut = self._work.get_future()
        except Exception:  # a backend without futures: completed is all it says
            return True
        return succeeded(fut)

    def get_future(self) -> Any:
        """The work's future; its success stamps the calls (DDP's communication hooks
        chain on it and never wait)."""
        fut = self._work.get_future()
        fut.add_done_callback(lambda f: self._done() if succeeded(f) else None)
        return fut

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def succeeded(fut: Any) -> bool:
    """Whether a work's future says it succeeded. A call that failed (its peer died, and
    Gloo says so at once) is not completed: it stays unfinished, as the peer's call does,
    and the rank is seen waiting in it. A future not done yet (NCCL's is set after its
    events completed) does not say otherwise."""
    if not fut.done():
        return True
    try:
        fut.value()
    except Exception:
        return False
    return True


def returned(entry: list[Any], gpu: GpuTimer | None) -> None:
    """The host got a call back (or waited for it): stamp it, and for a CUDA call
    mark the stream, whose event completes when the GPU finished the call."""
    entry[6] = time.time_ns()
    if gpu is not None:
        entry[EV1] = gpu.mark()


def positional_group(name: str, args: tuple[Any, ...]) -> Any:
    # where the group goes: all_reduce(t, op, group), broadcast(t, src, group),
    # reduce(t, dst, op, group), all_gather(list, t, group)
    index = {"all_reduce": 2, "broadcast": 2, "reduce": 3, "all_gather": 2}.get(name)
    if index is not None and len(args) > index:
        return args[index]
    return None


def first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for a in (*args, *kwargs.values()):
        if hasattr(a, "numel"):
            return a
        if isinstance(a, list | tuple) and a and hasattr(a[0], "numel"):
            return a[0]
    return None


_DTYPES: dict[Any, tuple[DType, int]] = {}


def tensor_info(t: Any) -> tuple[int, int, DType]:
    if t is None:
        return 0, 0, DType.UINT8
    known = _DTYPES.get(t.dtype)
    if known is None:
        name = str(t.dtype).removeprefix("torch.")
        dtype = DType(name) if name in DType._value2member_map_ else DType.UINT8
        known = _DTYPES[t.dtype] = (dtype, int(t.element_size()))
    n = int(t.numel())
    return n, n * known[1], known[0]


__all__ = [
    "DEND",
    "DSTART",
    "EV0",
    "EV1",
    "Comm",
    "GpuTimer",
    "TimedWork",
    "first_tensor",
    "positional_group",
    "returned",
    "succeeded",
    "tensor_info",
]
