"""Named, seeded, reproducible scenarios: a job, its faults, their ground truth.

>>> sorted(SCENARIOS)[:3]
['bubble-delay', 'compute-hang', 'gpu-stall']
>>> run = build("slow-gpu", scale="tiny", seed=3)
>>> run.spec.world_size, type(run.faults[0]).__name__
(8, 'SlowGPU')
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import msgspec
import numpy as np

from producers.sim import draws
from producers.sim.emit import Emitter
from producers.sim.engine import Engine
from producers.sim.faults import (
    HANGS,
    Fault,
    IntermittentGPU,
)
from producers.sim.job import JobSpec
from producers.sim.trace import StepTrace
from schemas.records import event_time
from schemas.results import FaultLabel

#: Cluster sizes: name -> (tp, pp, dp, gpus_per_node, layers, global batch)
SCALES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (2, 2, 2, 4, 8, 16),  # 8 ranks on 2 nodes of 4 GPUs
    "demo": (2, 4, 2, 4, 8, 16),  # 16 ranks on 4 nodes of 4 GPUs
    "small": (4, 4, 4, 8, 16, 64),  # 64 ranks, 8 nodes
    "medium": (8, 8, 8, 8, 32, 128),  # 512 ranks, 64 nodes
    "large": (8, 8, 64, 8, 32, 512),  # 4,096 ranks, 512 nodes
}


def scale_spec(scale: str, **over: object) -> JobSpec:
    try:
        tp, pp, dp, gpn, layers, gbs = SCALES[scale]
    except KeyError:
        raise ValueError(f"unknown scale {scale!r} (choose from {', '.join(SCALES)})") from None
    base = JobSpec(tp=tp, pp=pp, dp=dp, gpus_per_node=gpn, num_layers=layers, global_batch_size=gbs)
    return replace(base, **over) if over else base


@dataclass
class Run:
    """A built scenario: spec, faults, and how many steps to simulate."""

    name: str
    spec: JobSpec
    faults: list[Fault]
    steps: int
    hang_observe_s: float = 30.0
    labels: list[FaultLabel] = field(default_factory=list)

    def records(
        self, progress: Callable[[int, int], None] | None = None, emit_kernels: bool = True
    ) -> Iterator[msgspec.Struct]:
        """Every record of the run in emission-time order, metadata first.

        Fills :attr:`labels` as fault onsets are reached.
        """
        spec = self.spec if emit_kernels else replace(self.spec, kernels=False)
        engine = Engine(spec, self.faults)
        emitter = Emitter(engine)
        yield from engine.layout.metadata()
        self.labels = []
        onset_ns: dict[int, int] = {}
        durations: list[float] = []
        for step in range(self.steps):
            trace = engine.step()
            onset_ns[step] = self.spec.t0_ns + int(np.nanmin(trace.start))
            durations.append(trace.duration_ns)
            yield from _time_ordered(emitter, trace)
            if progress:
                progress(step + 1, self.steps)
            if trace.hung:
                yield from self._hang_heartbeats(emitter, trace)
                break
        costs = self.fault_costs(ran=durations)
        self.labels = [
            msgspec.structs.replace(
                f.label(self.spec, onset_ns[f.onset_step]),
                throughput_cost=costs[i],
                on_critical_path=isinstance(f, HANGS) or costs[i] > 0.005,
            )
            for i, f in enumerate(self.faults)
            if f.onset_step in onset_ns
        ]

    def fault_costs(self, window: int = 6, ran: list[float] | None = None) -> list[float]:
        """Each fault's measured throughput cost: 1 - t_without / t_with over its window.

        Counterfactual simulation with the same seed (identical jitter), so the
        number is the fault's own effect on the iteration, critical path and all.
        ``ran``: the step times of this run as :meth:`records` simulated them, which
        are t_with where no fault is a hang (its kernels draw nothing from the seed).
        """
        out = []
        # a hang stops the steps after it, so a slowdown's cost is measured without hangs
        running = [g for g in self.faults if not isinstance(g, HANGS)]
        if len(running) < len(self.faults):
            ran = None
        for f in self.faults:
            if isinstance(f, HANGS):
                out.append(1.0)
                continue
            span = f.period_steps if isinstance(f, IntermittentGPU) else window
            last = min(self.steps, f.onset_step + span)
            if last <= f.onset_step:
                out.append(0.0)
                continue
            others = [g for g in running if g is not f]
            if ran is not None and len(ran) >= last:
                t_with = ran[f.onset_step : last]
            else:
                t_with = _step_times(self.spec, running, last)[f.onset_step :]
            t_without = _step_times(self.spec, others, last)[f.onset_step :]
            out.append(float(max(0.0, 1.0 - sum(t_without) / sum(t_with))))
        return out

    def _hang_heartbeats(self, emitter: Emitter, trace: StepTrace) -> Iterator[msgspec.Struct]:
        interval = int(self.spec.heartbeat_interval_ms * 1e6)
        t = emitter.last_ns
        for _ in range(int(self.hang_observe_s * 1e9 // interval)):
            t += interval
            yield from emitter.heartbeats(t - self.spec.t0_ns + self.spec.t0_ns, trace.step)


def _step_times(spec: JobSpec, faults: list[Fault], steps: int) -> list[float]:
    engine = Engine(replace(spec, kernels=False), faults)
    out = []
    for _ in range(steps):
        tr = engine.step()
        out.append(tr.duration_ns)
        if tr.hung:
            break
    return out


def _time_ordered(emitter: Emitter, trace: StepTrace) -> list[msgspec.Struct]:
    recs = list(emitter.step_records(trace))
    keys = np.fromiter((event_time(r) for r in recs), dtype=np.int64, count=len(recs))
    return [recs[i] for i in np.argsort(keys, kind="stable")]


# --------------------------------------------------------------------------- catalogue


@dataclass(frozen=True)
class ScenarioDef:
    description: str
    faults: Callable[[JobSpec, np.random.Generator, int], list[Fault]]
    steps: int = 40
    #: the job's spec where the scenario needs one of its own (a scale's otherwise)
    spec: dict[str, object] = field(default_factory=dict)


SCENARIOS: dict[str, ScenarioDef] = {
    "healthy": ScenarioDef(
        "noise only: jitter, persistent per-rank offsets, clock skew", draws.healthy
    ),
    "slow-gpu": ScenarioDef("one GPU computes 1.3-2x slower from a random step", draws.slow_gpu),
    "mild-gpu": ScenarioDef(
        "one GPU computes 1.10-1.15x slower from a random step, in a compute-bound job "
        "(4 ms a layer's forward)",
        functools.partial(draws.slow_gpu, factors=(1.10, 1.12, 1.15)),
        spec={"fwd_ms_per_layer": 4.0},
    ),
    "intermittent-gpu": ScenarioDef(
        "one GPU slows 2x for 2-step bursts, periodically", draws.intermittent, steps=60
    ),
    "transient-gpu": ScenarioDef("one GPU computes 2-3x slower for one step", draws.transient),
    "host-cpu": ScenarioDef(
        "every rank of one node launches 300 us late (starved host CPU)", draws.host_cpu
    ),
    "slow-link": ScenarioDef("one inter-node link runs 5x slower", draws.slow_link),
    "slow-nic": ScenarioDef(
        "one NIC runs 4x slower on all its links (needs 3+ nodes)", draws.slow_nic
    ),
    "compute-hang": ScenarioDef(
        "one rank stops before a tensor-parallel collective", draws.compute_hang
    ),
    "missing-recv": ScenarioDef(
        "one rank never posts its pipeline Recv (forward, micro-batch 3)", draws.missing_recv
    ),
    "network-hang": ScenarioDef(
        "one inter-node transfer is posted and never completes", draws.network_hang
    ),
    "gpu-stall": ScenarioDef(
        "a sending GPU stops mid-transfer: posted, never completed, waiting on the GPU",
        draws.gpu_stall,
    ),
    "bubble-delay": ScenarioDef(
        "a delay inside a pipeline bubble: must cost no throughput", draws.bubble
    ),
    "mixed": ScenarioDef("a 2x slower GPU and a 5x slower link at once", draws.mixed),
    "story": ScenarioDef(
        "a link degrades, a GPU slows down, then a rank never posts its Recv", draws.story, steps=36
    ),
}


def build(
    name: str, *, scale: str = "tiny", seed: int = 0, steps: int | None = None, **spec_over: object
) -> Run:
    """Build a scenario at a scale (spec fields may be overridden)."""
    try:
        sdef = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r} (see `megatrace scenarios`)") from None
    spec = scale_spec(
        scale,
        job=str(spec_over.pop("job", f"{name}-{scale}-s{seed}")),
        seed=seed,
        t0_ns=time.time_ns() if spec_over.pop("now", False) else JobSpec.t0_ns,
        **{**sdef.spec, **spec_over},
    )
    n = steps or sdef.steps
    rng = np.random.default_rng([seed, 7919])
    faults = sdef.faults(spec, rng, n)
    return Run(name, spec, faults, n)


__all__ = ["HANGS", "SCALES", "SCENARIOS", "Run", "build", "scale_spec"]
