"""Faults the simulator can inject, each able to describe itself as ground truth.

A fault changes the timing model (compute speed, launch delay, link
bandwidth) or stops something from ever happening (a rank that never issues a
call, a transfer that never completes). :meth:`Fault.label` gives the
:class:`~schemas.results.FaultLabel` a detector is scored against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from producers.sim.job import JobSpec
from schemas.enums import Cause, Phase, VerdictKind
from schemas.results import FaultLabel


@dataclass(frozen=True)
class Fault:
    onset_step: int

    def active(self, step: int) -> bool:
        return step >= self.onset_step

    def _label(self, spec: JobSpec, onset_ns: int, **kw: object) -> FaultLabel:
        fid = f"{type(self).__name__}:{self.onset_step}:" + ":".join(
            f"{v}" for v in vars(self).values()
        )
        return FaultLabel(
            job=spec.job, fault_id=fid, onset_step=self.onset_step, onset_ns=onset_ns, **kw
        )  # type: ignore[arg-type]

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:  # pragma: no cover - abstract
        raise NotImplementedError


def _rank_fields(spec: JobSpec, rank: int) -> dict[str, object]:
    return {
        "rank": rank,
        "node": spec.node_of(rank),
        "gpu": spec.gpu_of(rank),
        "pp_stage": spec.coords(rank)[0],
    }


def _link_fields(spec: JobSpec, src: int, dst: int) -> dict[str, object]:
    """A link culprit: its ends, the sending rank and node, and the link's name."""
    name = f"{spec.node_of(src)}/{spec.nic_of(src)}->{spec.node_of(dst)}/{spec.nic_of(dst)}"
    return {
        "src_rank": src,
        "dst_rank": dst,
        "rank": src,
        "node": spec.node_of(src),
        "link": name,
        "phase": Phase.TRANSFER,
    }


@dataclass(frozen=True)
class SlowGPU(Fault):
    """One GPU computes ``factor`` times slower from ``onset_step`` (until ``end_step``)."""

    rank: int = 0
    factor: float = 1.5
    end_step: int | None = None
    #: the incident it is (a class constant: a straggler that passes is another kind)
    KIND: ClassVar[VerdictKind] = VerdictKind.SLOWDOWN

    def active(self, step: int) -> bool:
        return step >= self.onset_step and (self.end_step is None or step < self.end_step)

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=self.KIND,
            cause=Cause.COMPUTE,
            magnitude=self.factor,
            end_step=self.end_step,
            **_rank_fields(spec, self.rank),
        )


@dataclass(frozen=True)
class IntermittentGPU(Fault):
    """Short bursts of slow compute every ``period_steps`` steps (the "SW slowdown" clock state)."""

    rank: int = 0
    factor: float = 2.0
    period_steps: int = 20
    burst_steps: int = 2

    def active(self, step: int) -> bool:
        return step >= self.onset_step and (step - self.onset_step) % self.period_steps < (
            self.burst_steps
        )

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.INTERMITTENT_SLOWDOWN,
            cause=Cause.COMPUTE,
            magnitude=self.factor,
            **_rank_fields(spec, self.rank),
        )


@dataclass(frozen=True)
class TransientGPU(SlowGPU):
    """One GPU computes ``factor`` times slower for a step or a few, then recovers (a
    straggler that passes: users want its culprit and the time it cost)."""

    KIND: ClassVar[VerdictKind] = VerdictKind.TRANSIENT_STRAGGLER


@dataclass(frozen=True)
class HostStarvation(Fault):
    """Every rank of one node launches late (a host with too few CPU cores)."""

    node: int = 0
    launch_delay_us: float = 300.0

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.SLOWDOWN,
            cause=Cause.HOST_CPU,
            node=f"node-{self.node}",
            magnitude=self.launch_delay_us,
        )


@dataclass(frozen=True)
class SlowLink(Fault):
    """Transfers from ``src_rank``'s NIC to ``dst_rank``'s take ``factor`` times longer."""

    src_rank: int = 0
    dst_rank: int = 0
    factor: float = 4.0

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.LINK_DEGRADATION,
            cause=Cause.NETWORK_LINK,
            **_link_fields(spec, self.src_rank, self.dst_rank),
            magnitude=self.factor,
        )


@dataclass(frozen=True)
class SlowNIC(Fault):
    """Every transfer leaving ``rank``'s NIC takes ``factor`` times longer (a degraded NIC:
    all its links slow at once, which tells it apart from one slow link)."""

    rank: int = 0
    factor: float = 4.0

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.LINK_DEGRADATION,
            cause=Cause.NIC,
            **_rank_fields(spec, self.rank),
            src_rank=self.rank,
            link=f"{spec.node_of(self.rank)}/{spec.nic_of(self.rank)}",
            phase=Phase.TRANSFER,
            magnitude=self.factor,
        )


@dataclass(frozen=True)
class ComputeHang(Fault):
    """A rank stops before a TP collective of (microbatch, phase) in ``onset_step``."""

    rank: int = 0
    phase: Phase = Phase.FORWARD
    microbatch: int = 0
    layer: int = 0

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.HANG,
            cause=Cause.COMPUTE,
            phase=self.phase,
            microbatch=self.microbatch,
            **_rank_fields(spec, self.rank),
            note="stops before a TP collective",
        )


@dataclass(frozen=True)
class MissingRecv(Fault):
    """A rank never posts its pipeline Recv for (microbatch, phase): the 3,840-GPU case."""

    rank: int = 0
    phase: Phase = Phase.FORWARD
    microbatch: int = 3

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.HANG,
            cause=Cause.COMPUTE,
            phase=self.phase,
            microbatch=self.microbatch,
            **_rank_fields(spec, self.rank),
            note="never posts its Recv",
        )


@dataclass(frozen=True)
class NetworkHang(Fault):
    """The first transfer from ``src_rank`` to ``dst_rank`` in ``onset_step`` never completes."""

    src_rank: int = 0
    dst_rank: int = 0

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.HANG,
            cause=Cause.NETWORK_LINK,
            **_link_fields(spec, self.src_rank, self.dst_rank),
            note="posted, never completed",
        )


@dataclass(frozen=True)
class GPUStallInTransfer(NetworkHang):
    """The sending GPU stops producing data halfway through its first transfer from
    ``src_rank`` to ``dst_rank`` in ``onset_step`` (a GPU fault, e.g. an Xid error).

    Like a network hang the transfer is posted and never completes, but the
    sender's proxy waits for its GPU (SendGPUWait), not for the network: the
    culprit is the sending GPU, not the link (the decision table of docs/method.md).
    """

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.HANG,
            cause=Cause.COMPUTE,
            **_rank_fields(spec, self.src_rank),
            note=f"GPU stopped producing data for rank {self.dst_rank} (SendGPUWait)",
        )


@dataclass(frozen=True)
class BubbleDelay(Fault):
    """A delay on one rank's (microbatch, phase) that the pipeline bubble absorbs."""

    rank: int = 0
    phase: Phase = Phase.BACKWARD
    microbatch: int = 0
    delay_ms: float = 2.0

    def label(self, spec: JobSpec, onset_ns: int) -> FaultLabel:
        return self._label(
            spec,
            onset_ns,
            kind=VerdictKind.SLOWDOWN,
            cause=Cause.COMPUTE,
            phase=self.phase,
            microbatch=self.microbatch,
            magnitude=self.delay_ms,
            on_critical_path=False,
            **_rank_fields(spec, self.rank),
            note="inside a pipeline bubble: costs no throughput",
        )


HANGS = (ComputeHang, MissingRecv, NetworkHang)  # GPUStallInTransfer is a NetworkHang
