"""What CUPTI would report of a simulated step: each compute kernel, and each NCCL call's
kernel with its communicator, op and size (:class:`KernelEmitter`, a part of
:class:`~producers.sim.emit.Emitter`, which holds the state below)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from producers.sim.job import JobSpec
from producers.sim.trace import KERNEL_NAMES, OPS, StepTrace
from schemas.enums import ClockSource, CollOp, KernelKind
from schemas.records import Kernel

CLOCK = ClockSource.SIMULATED
_NCCL_KERNEL = {
    op: f"ncclDevKernel_{op.value}_Sum_bf16_RING_LL" if not op.is_p2p else "ncclDevKernel_SendRecv"
    for op in CollOp
}


class KernelEmitter:
    """Kernel records of a step (the emitter's state below)."""

    spec: JobSpec
    nodes: list[str]
    comm_hash: list[int]
    comm_size: list[int]
    _abs: Callable[[np.ndarray, np.ndarray], np.ndarray]

    def kernels(self, tr: StepTrace) -> list[Kernel]:
        out: list[Kernel] = []
        k = tr.kernels
        if len(k["rank"]):
            rank = k["rank"].astype(np.int64)
            start, end = self._abs(k["start"], rank), self._abs(k["end"], rank)
            for r, s, e, nm, corr in zip(
                rank.tolist(),
                start.tolist(),
                end.tolist(),
                k["name"].astype(int).tolist(),
                k["corr"].astype(np.int64).tolist(),
                strict=True,
            ):
                out.append(self._kernel(r, s, e, 7, KERNEL_NAMES[nm], KernelKind.COMPUTE, corr))
        c = tr.colls
        if len(c["rank"]):
            rank = c["rank"].astype(np.int64)
            start, end = self._abs(c["start"], rank), self._abs(c["end"], rank)
            comm = c["comm"].astype(np.int64)
            for r, s, e, cm, op, cnt in zip(
                rank.tolist(),
                start.tolist(),
                end.tolist(),
                comm.tolist(),
                c["op"].astype(int).tolist(),
                c["count"].astype(np.int64).tolist(),
                strict=True,
            ):
                if e < 0:
                    continue  # still running: CUPTI reports a kernel when it ends
                o = OPS[op]
                out.append(
                    self._kernel(
                        r,
                        s,
                        e,
                        13,
                        _NCCL_KERNEL[o],
                        KernelKind.NCCL,
                        self._next_corr(),
                        comm_hash=self.comm_hash[cm],
                        coll_op=o,
                        count=cnt,
                        group_size=self.comm_size[cm],
                    )
                )
        return out

    def _kernel(
        self,
        rank: int,
        start: int,
        end: int,
        stream: int,
        name: str,
        kind: KernelKind,
        corr: int,
        **nccl: object,
    ) -> Kernel:
        return Kernel(
            job=self.spec.job,
            node=self.nodes[rank],
            rank=rank,
            clock=CLOCK,
            device=rank % self.spec.gpus_per_node,
            stream=stream,
            name=name,
            kind=kind,
            correlation_id=corr,
            start_ns=start,
            end_ns=end,
            **nccl,
        )  # type: ignore[arg-type]

    def _next_corr(self) -> int:
        """CUPTI correlation ids are unique per launch; NCCL launches count from 2**32."""
        self._corr = getattr(self, "_corr", 1 << 32) + 1
        return self._corr


__all__ = ["CLOCK", "KernelEmitter"]
