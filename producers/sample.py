"""A small, self-consistent data-parallel job: every event type, a few steps.

Used by the smoke path of ``megatrace demo`` and by tests that need one
record of each kind with believable values. The full cluster simulator (with
pipeline schedules and fault injection) builds on the same records.

>>> recs = list(sample_job("j1", nodes=2, gpus_per_node=2, steps=2, t0_ns=10**18))
>>> sorted({type(r).__name__ for r in recs})  # doctest: +NORMALIZE_WHITESPACE
['Collective', 'CommInfo', 'Heartbeat', 'JobInfo', 'Kernel', 'LinkSample',
 'ProxySummary', 'RankInfo']
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import msgspec
import numpy as np

from schemas.records import (
    Collective,
    CommInfo,
    CommProgress,
    Heartbeat,
    JobInfo,
    Kernel,
    LinkSample,
    ProxySummary,
    RankInfo,
)
from schemas.units import (
    DTYPE_BYTES,
    ClockSource,
    CollOp,
    CommRole,
    Direction,
    DType,
    KernelKind,
)


def comm_hash(job: str, name: str) -> int:
    """A stable 64-bit communicator hash for a named group of a job."""
    return (zlib.crc32(f"{job}/{name}".encode()) << 32) | zlib.crc32(name[::-1].encode())


def sample_job(
    job: str,
    *,
    nodes: int = 2,
    gpus_per_node: int = 4,
    steps: int = 5,
    t0_ns: int,
    compute_ms: float = 40.0,
    grad_elements: int = 50_000_000,
    seed: int = 0,
) -> Iterator[msgspec.Struct]:
    """Yield the records of a healthy pure data-parallel job, in time order per step."""
    rng = np.random.default_rng(seed)
    world = nodes * gpus_per_node
    clock = ClockSource.SIMULATED
    yield JobInfo(
        job=job,
        ts_ns=t0_ns,
        name="sample",
        source="sample",
        world_size=world,
        dp=world,
        num_layers=24,
        global_batch_size=world * 4,
        micro_batch_size=4,
        num_microbatches=1,
        gpus_per_node=gpus_per_node,
    )
    ch = comm_hash(job, "dp0")
    for r in range(world):
        yield RankInfo(
            job=job,
            ts_ns=t0_ns,
            rank=r,
            node=f"node-{r // gpus_per_node}",
            gpu=r % gpus_per_node,
            nic=f"mlx5_{r % gpus_per_node}",
            dp_rank=r,
        )
    yield CommInfo(job=job, ts_ns=t0_ns, comm_hash=ch, role=CommRole.DP, ranks=list(range(world)))
    size = grad_elements * DTYPE_BYTES[DType.BFLOAT16]
    busbw = 40e9  # bytes/s
    transfer = int(size * 2 * (world - 1) / world / busbw * 1e9)
    t = t0_ns + 1_000_000
    for step in range(steps):
        arrivals = t + (rng.normal(compute_ms, compute_ms * 0.02, world) * 1e6).astype(np.int64)
        end = int(arrivals.max()) + transfer
        for r in range(world):
            node = f"node-{r // gpus_per_node}"
            a = int(arrivals[r])
            yield Kernel(
                job=job,
                node=node,
                rank=r,
                clock=clock,
                device=r % gpus_per_node,
                stream=7,
                name="sm90_xmma_gemm_bf16bf16_bf16f32",
                kind=KernelKind.COMPUTE,
                correlation_id=step * 10 + 1,
                start_ns=t,
                end_ns=a,
            )
            yield Collective(
                job=job,
                node=node,
                rank=r,
                clock=clock,
                comm_hash=ch,
                comm_size=world,
                rank_in_comm=r,
                op=CollOp.ALL_REDUCE,
                seq=step,
                count=grad_elements,
                size_bytes=size,
                dtype=DType.BFLOAT16,
                enqueue_ns=a,
                start_ns=a,
                end_ns=end,
                algo="ring",
                proto="simple",
                nchannels=2,
            )
            peer = (r + 1) % world
            yield ProxySummary(
                job=job,
                node=node,
                rank=r,
                clock=clock,
                comm_hash=ch,
                seq=step,
                channel=0,
                peer=peer,
                direction=Direction.SEND,
                steps_posted=16,
                steps_done=16,
                size_bytes=size // 2,
                first_ns=a,
                last_ns=end,
                send_gpu_wait_ns=1000,
                send_peer_wait_ns=int(arrivals.max()) - a,
                send_wait_ns=transfer // 2,
                nic=f"mlx5_{r % gpus_per_node}",
            )
            yield LinkSample(
                job=job,
                node=node,
                rank=r,
                clock=clock,
                ts_ns=end,
                window_ns=transfer,
                nic=f"mlx5_{r % gpus_per_node}",
                src_rank=r,
                dst_rank=peer,
                dst_node=f"node-{peer // gpus_per_node}",
                comm_hash=ch,
                func=CollOp.ALL_REDUCE,
                size_bytes=size // 2,
                throughput_gbps=size / 2 / max(transfer, 1) * 8,
                wr_posted=50,
                wr_completed=50,
            )
            yield Heartbeat(
                job=job,
                node=node,
                rank=r,
                clock=clock,
                ts_ns=end,
                pid=1000 + r,
                step=step,
                comms=[CommProgress(comm_hash=ch, issued_seq=step, completed_seq=step)],
            )
        t = end + 1_000_000
