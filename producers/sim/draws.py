"""Each scenario's faults, drawn from its seed: which rank, link, step and size
(:data:`~producers.sim.scenarios.SCENARIOS` names them). A draw returns the faults of one
run of ``steps`` steps of the job ``spec``; :class:`NotApplicable` says a scenario
cannot happen in that job (a slow NIC needs three nodes or more)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from producers.sim.engine import Engine
from producers.sim.faults import (
    BubbleDelay,
    ComputeHang,
    Fault,
    GPUStallInTransfer,
    HostStarvation,
    IntermittentGPU,
    MissingRecv,
    NetworkHang,
    SlowGPU,
    SlowLink,
    SlowNIC,
    TransientGPU,
)
from producers.sim.job import JobSpec
from schemas.enums import Phase


def _stage_rank(spec: JobSpec, rng: np.random.Generator, stage: int | None = None) -> int:
    p = int(rng.integers(spec.pp)) if stage is None else stage
    return spec.rank(p, int(rng.integers(spec.dpc)), int(rng.integers(spec.tp)))


def _remote_peers(spec: JobSpec, u: int, upstream: bool) -> list[int]:
    """The ranks on other nodes that ``u`` sends to: its DP-ring successor and its next
    pipeline stage (activations), and with ``upstream`` its previous stage (gradients)."""
    p, d, t = spec.coords(u)
    peers = [spec.rank(p, (d + 1) % spec.dpc, t)] if spec.dpc > 1 else []
    stages = (p + 1, p - 1) if upstream else (p + 1,)
    peers += [spec.rank(q, d, t) for q in stages if 0 <= q < spec.pp]
    return [v for v in peers if spec.node_of(v) != spec.node_of(u)]


def _inter_node_edge(spec: JobSpec, rng: np.random.Generator) -> tuple[int, int]:
    """A link that crosses nodes: a DP-ring edge or a pipeline (activation) edge."""
    edges = [(u, v) for u in range(spec.world_size) for v in _remote_peers(spec, u, False)]
    if not edges:
        raise ValueError("this layout has no inter-node link")
    u, v = edges[int(rng.integers(len(edges)))]
    return u, v


def _onset(spec: JobSpec, rng: np.random.Generator, steps: int) -> int:
    return int(rng.integers(max(4, steps // 4), max(5, steps // 2)))


def healthy(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    return []


def slow_gpu(
    spec: JobSpec,
    rng: np.random.Generator,
    steps: int,
    factors: tuple[float, ...] = (1.3, 1.5, 2.0),
) -> list[Fault]:
    return [
        SlowGPU(
            onset_step=_onset(spec, rng, steps),
            rank=_stage_rank(spec, rng),
            factor=float(rng.choice(factors)),
        )
    ]


def intermittent(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    return [
        IntermittentGPU(
            onset_step=_onset(spec, rng, steps),
            rank=_stage_rank(spec, rng),
            factor=2.0,
            period_steps=max(6, steps // 5),
            burst_steps=2,
        )
    ]


def transient(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    onset = _onset(spec, rng, steps)
    return [
        TransientGPU(
            onset_step=onset,
            end_step=onset + 1,
            rank=_stage_rank(spec, rng),
            factor=float(rng.choice([2.0, 3.0])),
        )
    ]


def host_cpu(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    return [
        HostStarvation(
            onset_step=_onset(spec, rng, steps),
            node=int(rng.integers(spec.num_nodes)),
            launch_delay_us=300.0,
        )
    ]


def slow_link(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    u, v = _inter_node_edge(spec, rng)
    return [SlowLink(onset_step=_onset(spec, rng, steps), src_rank=u, dst_rank=v, factor=5.0)]


class NotApplicable(ValueError):
    """The scenario cannot happen in this layout (e.g. it needs more nodes)."""


def slow_nic(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    """A NIC whose rank sends to at least two other nodes (else it looks like one link)."""
    ranks = [u for u in range(spec.world_size) if len(set(_remote_peers(spec, u, True))) >= 2]
    if not ranks:
        raise NotApplicable("no rank here sends to two other nodes: a slow NIC looks like a link")
    rank = ranks[int(rng.integers(len(ranks)))]
    return [SlowNIC(onset_step=_onset(spec, rng, steps), rank=rank, factor=4.0)]


def compute_hang(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    return [
        ComputeHang(
            onset_step=_onset(spec, rng, steps),
            rank=_stage_rank(spec, rng),
            phase=Phase(rng.choice([Phase.FORWARD, Phase.BACKWARD])),
            microbatch=int(rng.integers(spec.num_microbatches)),
            layer=int(rng.integers(spec.layers_per_stage)),
        )
    ]


def missing_recv(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    stage = int(rng.integers(1, spec.pp)) if spec.pp > 1 else 0
    return [
        MissingRecv(
            onset_step=_onset(spec, rng, steps),
            rank=_stage_rank(spec, rng, stage),
            phase=Phase.FORWARD,
            microbatch=min(3, spec.num_microbatches - 1),
        )
    ]


def network_hang(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    u, v = _inter_node_edge(spec, rng)
    return [NetworkHang(onset_step=_onset(spec, rng, steps), src_rank=u, dst_rank=v)]


def gpu_stall(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    u, v = _inter_node_edge(spec, rng)
    return [GPUStallInTransfer(onset_step=_onset(spec, rng, steps), src_rank=u, dst_rank=v)]


def bubble(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    onset = _onset(spec, rng, steps)
    return [find_bubble_slot(spec, onset, rng)]


def mixed(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    gpu = SlowGPU(onset_step=_onset(spec, rng, steps), rank=_stage_rank(spec, rng), factor=2.0)
    return [gpu, *slow_link(spec, rng, steps)]


def story(spec: JobSpec, rng: np.random.Generator, steps: int) -> list[Fault]:
    """A link degrades, then a GPU slows down, then a rank never posts its Recv."""
    u, v = _inter_node_edge(spec, rng)
    gpu = _stage_rank(spec, rng)
    stage = int(rng.integers(1, spec.pp)) if spec.pp > 1 else 0
    hung = _stage_rank(spec, rng, stage)
    return [
        SlowLink(onset_step=steps // 5, src_rank=u, dst_rank=v, factor=5.0),
        SlowGPU(onset_step=steps // 2, rank=gpu, factor=2.0),
        MissingRecv(
            onset_step=steps - 4,
            rank=hung,
            phase=Phase.FORWARD,
            microbatch=min(3, spec.num_microbatches - 1),
        ),
    ]


def find_bubble_slot(spec: JobSpec, onset: int, rng: np.random.Generator) -> BubbleDelay:
    """A (rank, backward micro-batch) on stage 0 whose delay the pipeline absorbs.

    Found by simulation: the delay is accepted if an iteration with it lasts
    within 0.2% of the same iteration without it.
    """
    if spec.pp < 2:
        raise ValueError("a pipeline bubble needs pp >= 2")
    base = Engine(replace(spec, kernels=False)).step().duration_ns
    rank = spec.rank(0, int(rng.integers(spec.dpc)), int(rng.integers(spec.tp)))
    M = spec.num_microbatches
    for mb in range(M - 1, -1, -1):
        for frac in (0.5, 0.3, 0.15):
            delay_ms = base / spec.num_microbatches * frac / 1e6
            f = BubbleDelay(
                onset_step=0, rank=rank, phase=Phase.BACKWARD, microbatch=mb, delay_ms=delay_ms
            )
            d = Engine(replace(spec, kernels=False), [f]).step().duration_ns
            if d <= base * 1.002:
                return replace(f, onset_step=onset)
    raise ValueError("no bubble slot absorbs a delay in this layout")
