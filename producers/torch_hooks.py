"""The PyTorch collector's hot path: the wrappers around ``torch.distributed``'s
collectives and transfers (:class:`Hooks`, a part of
:class:`~producers.torch_recorder.Collector`, which holds the state below).

Per call a wrapper takes two clock readings, bumps the communicator's sequence number and
appends a small list (an *entry*: see :mod:`producers.torch_calls`) for the collector's
thread; a call on a CUDA tensor also marks the stream (:class:`GpuTimer`). A deprecated
name calling its new one is recorded once; transfers batched by ``batch_isend_irecv`` are
recorded by the batch, each on the two-rank communicator of its pair.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from producers.torch_calls import (
    EV0,
    GpuTimer,
    TimedWork,
    first_tensor,
    positional_group,
    returned,
)
from producers.torch_comms import CommBook
from schemas.enums import TORCH_OP_NAMES, CollOp


class Hooks:
    """The wrappers of one process's calls."""

    dist: Any
    rank: int
    comms: CommBook
    calls: int
    _pending: deque[list[Any]]
    _p2p_seq: dict[tuple[int, int], int]
    _tls: threading.local
    _gpu: GpuTimer | None
    _mark: Callable[[], contextlib.AbstractContextManager[None]]

    def _collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        op = TORCH_OP_NAMES[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._tls, "inside", False):  # a deprecated name calling its new one
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = positional_group(name, args)
            c = self.comms.of(group)
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
        c = self.comms.pair(peer)
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

    def _timer(self, t: Any) -> GpuTimer | None:
        """The device timer for a call on ``t`` (None: not a CUDA tensor)."""
        if t is None or not getattr(t, "is_cuda", False):
            return None
        if self._gpu is None:
            import torch

            self._gpu = GpuTimer(torch.cuda)
        return self._gpu


__all__ = ["Hooks"]
