"""What one simulated iteration leaves: columns of calls, proxy summaries, kernels and
link transfers (:class:`StepTrace`), and the codes they use for ops, phases and kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from producers.sim.job import JobSpec, Layout
from schemas.enums import CollOp, Phase

OPS = list(CollOp)
OP_CODE = {op: i for i, op in enumerate(OPS)}
PHASES = list(Phase)
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}
#: kernel name per (phase code, segment kind)
KERNEL_NAMES = [
    "flash_fwd_kernel",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64",
    "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x128x64",
    "multi_tensor_apply_kernel_adam",
]
#: a time that never comes (a hung rank's clock, a transfer that never completes)
INF = np.inf
CHUNK_BYTES = 512 * 1024  # bytes per NCCL proxy step


@dataclass
class Columns:
    """Append-only columns of one kind of event; concatenated at the end of a step."""

    names: tuple[str, ...]
    parts: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(self, n: int, **cols: object) -> None:
        for name in self.names:
            v = cols[name]
            arr = np.asarray(v).ravel()
            if arr.size == 1 and n != 1:
                arr = np.full(n, arr[0], dtype=arr.dtype)
            self.parts.setdefault(name, []).append(arr)

    def build(self) -> dict[str, np.ndarray]:
        return {
            k: (np.concatenate(self.parts[k]) if self.parts.get(k) else np.zeros(0))
            for k in self.names
        }


COLL_COLS = (
    "rank",
    "comm",
    "op",
    "seq",
    "peer",
    "count",
    "nbytes",
    "enqueue",
    "start",
    "end",
    "mb",
    "phase",
    "slot",
)
PROXY_COLS = (
    "rank",
    "comm",
    "seq",
    "channel",
    "peer",
    "send",
    "steps",
    "done_steps",
    "nbytes",
    "first",
    "last",
    "gpu_wait",
    "peer_wait",
    "net_wait",
    "flush_wait",
)
KERNEL_COLS = ("rank", "start", "end", "name", "corr")
LINK_COLS = ("src", "dst", "comm", "nbytes", "xfer", "end")


@dataclass
class StepTrace:
    """Everything that happened in one iteration, as columns."""

    step: int
    start: np.ndarray  # per rank
    end: np.ndarray  # per rank (inf if the rank never finished the step)
    colls: dict[str, np.ndarray]
    proxies: dict[str, np.ndarray]
    kernels: dict[str, np.ndarray]
    links: dict[str, np.ndarray]
    cpu_wait: np.ndarray | None = None  # per rank: seconds its threads waited for a CPU a second

    @property
    def hung(self) -> bool:
        return bool(np.isinf(self.end).any())

    @property
    def duration_ns(self) -> float:
        return float(self.end.max() - self.start.min())


class EngineState:
    """What the engine's parts (:class:`~producers.sim.collectives.Collectives`,
    :class:`~producers.sim.transfers.Transfers`) read of the engine: the job and its
    layout, each rank's clock (``T``, float ns since the job start, per (stage, d, tp)),
    launch delay and host lead, and the step's call records."""

    spec: JobSpec
    layout: Layout
    T: np.ndarray
    launch: np.ndarray
    lead: np.ndarray
    colls: Columns
