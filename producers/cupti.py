"""Live CUPTI kernel activity through NVIDIA's ``cupti-python`` (GPU nodes only).

:class:`CuptiCollector` enables CUPTI's activity API for kernels, memcpys,
memsets and external correlations, and turns each completed buffer into
:class:`~schemas.records.Kernel` records handed to a sink (the node agent).
CUPTI timestamps are converted to host time with an offset measured at start.
A kernel is a NCCL kernel when its launch happened inside a NCCL call that
the collector marked with an external correlation id (:meth:`nccl_call`) -
never by its name, which NCCL changes between versions.

The mapping (:func:`activity_record`, :func:`map_activities`) is plain Python
over plain records, so it is tested here, without a GPU, on recorded activity;
the same functions run on the live buffers.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas.enums import ClockSource, KernelKind
from schemas.records import Kernel

#: The external-correlation kind megatrace marks NCCL calls with (CUPTI's "custom 0").
NCCL_EXTERNAL_KIND = 4
_KINDS = {"kernel": KernelKind.COMPUTE, "memcpy": KernelKind.MEMCPY, "memset": KernelKind.MEMSET}


class CuptiUnavailable(RuntimeError):
    """cupti-python or a GPU is missing."""


@dataclass(frozen=True)
class Activity:
    """One CUPTI activity record, as plain data (kind: kernel, memcpy, memset,
    external_correlation)."""

    kind: str
    correlation_id: int
    start: int = 0
    end: int = 0
    name: str = ""
    device_id: int = 0
    stream_id: int = 0
    external_kind: int = 0
    external_id: int = 0


def activity_record(obj: Any, kind_names: dict[int, str]) -> Activity | None:
    """A cupti-python activity object as an :class:`Activity` (None: a kind we skip).

    ``kind_names`` maps CUPTI's numeric kinds to our names (built from
    ``cupti.ActivityKind`` at start).
    """
    kind = kind_names.get(int(obj.kind))
    if kind is None:
        return None
    if kind == "external_correlation":
        return Activity(
            kind=kind,
            correlation_id=int(obj.correlation_id),
            external_kind=int(obj.external_kind),
            external_id=int(obj.external_id),
        )
    return Activity(
        kind=kind,
        correlation_id=int(obj.correlation_id),
        start=int(obj.start),
        end=int(obj.end),
        name=str(getattr(obj, "name", "") or ""),
        device_id=int(getattr(obj, "device_id", 0)),
        stream_id=int(getattr(obj, "stream_id", 0)),
    )


def map_activities(
    acts: Iterable[Activity],
    *,
    job: str,
    node: str,
    rank: int,
    clock_offset_ns: int,
    nccl_ids: set[int] | None = None,
) -> list[Kernel]:
    """Kernel records from a buffer of activity. External correlations in the buffer
    (and ``nccl_ids``, carried over from earlier buffers) mark NCCL launches."""
    marked = nccl_ids if nccl_ids is not None else set()
    pending: list[Activity] = []
    for a in acts:
        if a.kind == "external_correlation":
            if a.external_kind == NCCL_EXTERNAL_KIND:
                marked.add(a.correlation_id)
        elif a.kind in _KINDS:
            pending.append(a)
    out = []
    for a in pending:
        kind = _KINDS[a.kind]
        if a.correlation_id in marked and kind == KernelKind.COMPUTE:
            kind = KernelKind.NCCL
        start = a.start + clock_offset_ns
        out.append(
            Kernel(
                job=job,
                node=node,
                rank=rank,
                clock=ClockSource.HOST_REALTIME,
                device=a.device_id,
                stream=a.stream_id,
                name=a.name,
                kind=kind,
                correlation_id=a.correlation_id,
                start_ns=start,
                end_ns=max(start, a.end + clock_offset_ns),
            )
        )
    return out


class CuptiCollector:
    """Kernel activity of this process, live (needs ``pip install 'megatrace[cupti]'``)."""

    def __init__(
        self,
        *,
        job: str,
        node: str,
        rank: int,
        sink: Callable[[list[msgspec.Struct]], None],
        buffer_bytes: int = 8 << 20,
        on_activity: Callable[[list[Activity]], None] | None = None,
    ) -> None:
        self.job, self.node, self.rank, self.sink = job, node, rank, sink
        self.on_activity = on_activity  # sees each buffer before mapping (to record fixtures)
        self.buffer_bytes = buffer_bytes
        self.nccl_ids: set[int] = set()
        self.dropped = 0
        self._ids: Iterator[int] = itertools.count(1)
        self._cupti: Any = None
        self._offset = 0
        self._kind_names: dict[int, str] = {}
        self._enabled: list[int] = []

    def start(self) -> CuptiCollector:
        try:
            from cupti import cupti
        except ImportError:
            raise CuptiUnavailable(
                "live CUPTI needs NVIDIA's cupti-python and a GPU: pip install 'megatrace[cupti]'"
            ) from None
        self._cupti = cupti
        ak = cupti.ActivityKind
        self._kind_names = {
            int(ak.CONCURRENT_KERNEL): "kernel",
            int(ak.MEMCPY): "memcpy",
            int(ak.MEMSET): "memset",
            int(ak.EXTERNAL_CORRELATION): "external_correlation",
        }
        self._offset = time.time_ns() - int(cupti.get_timestamp())
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        # External correlations are recorded only for API calls whose records are
        # on, so the runtime and driver API records are enabled too (and skipped).
        self._enabled = [*self._kind_names, int(ak.RUNTIME), int(ak.DRIVER)]
        for kind in self._enabled:
            cupti.activity_enable(kind)
        return self

    def _buffer_requested(self) -> tuple[int, int]:
        return self.buffer_bytes, 0

    def _buffer_completed(self, activities: list[Any]) -> None:
        acts = [a for a in (activity_record(x, self._kind_names) for x in activities) if a]
        if self.on_activity is not None:
            self.on_activity(acts)
        records = map_activities(
            acts,
            job=self.job,
            node=self.node,
            rank=self.rank,
            clock_offset_ns=self._offset,
            nccl_ids=self.nccl_ids,
        )
        if len(self.nccl_ids) > 1_000_000:  # bounded: old launches are long done
            self.nccl_ids.clear()
        if records:
            self.sink(list(records))

    @contextlib.contextmanager
    def nccl_call(self) -> Iterator[None]:
        """Mark the kernels launched inside as NCCL kernels (wrap a NCCL call)."""
        if self._cupti is None:
            yield
            return
        self._cupti.activity_push_external_correlation_id(NCCL_EXTERNAL_KIND, next(self._ids))
        try:
            yield
        finally:
            self._cupti.activity_pop_external_correlation_id(NCCL_EXTERNAL_KIND)

    def stop(self) -> None:
        if self._cupti is None:
            return
        self._cupti.activity_flush_all(1)
        for kind in self._enabled:
            self._cupti.activity_disable(kind)
        self._cupti = None


__all__ = [
    "Activity",
    "CuptiCollector",
    "CuptiUnavailable",
    "activity_record",
    "map_activities",
]
