"""The lab's ground truth: each case's labels, from what was injected and the job's own
step markers (see :mod:`megatrace.lab`).

A fault is priced by the step time it added while it lasted (a CPU quota at most by
the share of the time the kernel held its ranks back); a rank stalled now and then, by
the time its stalls added over the steps from the first to the last.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infra.netlab import Node
from megatrace.lab import CaseRun, Injected
from megatrace.lab_cases import Fault
from schemas.enums import Cause, VerdictKind
from schemas.records import Iteration
from schemas.results import FaultLabel


def labels_of(run: CaseRun, nodes: list[Node]) -> list[FaultLabel]:
    """The ground truth, from what was injected and the job's own step markers."""
    marks = sorted(run.marks, key=lambda m: m.end_ns)
    out = []
    for i, inj in enumerate(run.injected):
        f = inj.fault
        # (a job started again after the fault counts its steps from its checkpoint's)
        until = inj.ended_ns if f.kind == "kill" and inj.ended_ns else 1 << 62
        onset_step = next((m.step for m in marks if inj.onset_ns <= m.end_ns < until), f.at_step)
        per_node = run.case.per_node
        common: dict[str, Any] = {}
        if f.kind in ("slow_link", "link_down"):
            kind = VerdictKind.LINK_DEGRADATION if f.kind == "slow_link" else VerdictKind.HANG
            cause = Cause.NETWORK_LINK
            common["node"] = nodes[f.target].name
        elif f.kind == "slow_node":
            kind, cause = VerdictKind.SLOWDOWN, Cause.HOST_CPU
            common["node"] = nodes[f.target].name
        else:
            kind = {
                "slow_rank": VerdictKind.SLOWDOWN,
                "transient": VerdictKind.TRANSIENT_STRAGGLER,
                "stall": VerdictKind.INTERMITTENT_SLOWDOWN,
                "hang": VerdictKind.HANG,
                "kill": VerdictKind.HANG,
            }[f.kind]
            cause = Cause.COMPUTE
            common.update(rank=f.target, node=nodes[f.target // per_node].name)
        out.append(
            FaultLabel(
                job=run.job,
                fault_id=f"{run.case.name}-{i}",
                kind=kind,
                cause=cause,
                onset_step=onset_step,
                onset_ns=inj.onset_ns,
                magnitude=_magnitude(f),
                throughput_cost=1.0 if kind is VerdictKind.HANG else _cost(marks, inj),
                note=_note(f),
                **common,
            )
        )
    return out


def _note(f: Fault) -> str:
    if f.kind == "stall":
        return (f"{f.times} stalls of rank {f.target}, every {f.every} steps from step "
                f"{f.at_step} of rank 0")  # fmt: skip
    return f"{f.kind} from step {f.at_step} of rank 0"


def _magnitude(f: Fault) -> float:
    """A quota's CPUs; a transient straggler's (or a stall's) longest step, in the job's
    usual steps (one, and the time its rank was held, were it held back all of it)."""
    if f.kind in ("transient", "stall"):
        return 1.0 + f.stall_steps
    return f.cpus if "slow" in f.kind else 0.0


def _cost(marks: list[Iteration], inj: Injected) -> float:
    """The throughput the fault cost: 1 - the step time before it / the step time during it.
    A CPU quota cost at most the share of the time the kernel held its ranks back: a job
    slowed by another fault at once (a slow link) may leave a quota nothing to hold back,
    and the step time it lost is that fault's. A brief fault (a transient, or stalls now
    and then) costs the time it added over the steps it touched, their mean: most of those
    steps may run as usual, or faster as the job catches up, and their median would then
    price a step or two twice as long at nothing. Their usual step is the median of the
    steps before and during: a brief fault leaves most of them as they were."""
    durations = [(m.end_ns, m.duration_ns) for m in marks if m.duration_ns]
    before = [d for t, d in durations if t < inj.onset_ns][-10:]
    end = 1 << 62
    if inj.ended_ns is not None:  # the steps it lasted: up to the first to end after it
        end = next((t for t, _ in durations if t >= inj.ended_ns), inj.ended_ns)
    during = [d for t, d in durations if inj.onset_ns < t <= end]
    if not before or not during:
        return 0.0
    if inj.fault.kind in ("stall", "transient"):
        # the usual step is the median around the fault, before it and while it lasted:
        # stalls now and then leave most of dozens of steps as usual, and the ten before
        # them may run a warm-up's or the machine's own load's few ms longer
        usual, typical = np.median(before + during), np.mean(during)
    else:
        usual, typical = np.median(before), np.median(during)
    cost = float(max(0.0, 1 - usual / typical))
    if inj.throttled is not None and inj.throttled[1] > inj.onset_ns:
        held, read_ns = inj.throttled
        cost = min(cost, held / (read_ns - inj.onset_ns))
    return cost


def step_ns(marks: list[Iteration]) -> float:
    """The job's usual step time (its median), from its markers."""
    d = [m.duration_ns for m in marks if m.duration_ns]
    return float(np.median(d)) if d else 0.0


__all__ = ["labels_of", "step_ns"]
