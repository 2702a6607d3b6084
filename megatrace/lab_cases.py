"""The lab's catalogue: each case's job, its faults and when they come (see
:mod:`megatrace.lab`, which runs them).

>>> (fault,) = CASES["ddp-transient"].faults  # rank 1 held to its quota for two steps
>>> fault.kind, fault.target, fault.at_step, fault.stall_steps, fault.cpus
('transient', 1, 12, 2.0, 0.1)
>>> len(CASES), QUICK[0]
(46, 'ddp-healthy')
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    """One fault: what, on whom (a rank, or a node's index), from which step of rank 0."""

    kind: str  # slow_link | link_down | slow_rank | slow_node | hang | kill | transient | stall
    target: int
    at_step: int = 12
    #: a transient straggler's rank is held to its quota, and a stalled rank frozen, for
    #: this many of the job's usual steps
    stall_steps: float = 2.0
    #: a stalled rank's stalls: this many, ``every`` steps of rank 0's apart, each at least
    #: ``stall_min_s`` (a job of short steps loses what a straggler must cost to count)
    times: int = 1
    every: int = 0
    stall_min_s: float = 0.1
    cpus: float = 0.1  # the CPU quota of a slow rank or node
    rate_mbit: float = 60.0  # a slow link's rate


@dataclass(frozen=True)
class Case:
    name: str
    workload: str
    ranks: int = 4
    nodes: int = 2
    steps: int = 80
    faults: tuple[Fault, ...] = ()
    #: a healthy job's checkpoints, every this many steps (0: none)
    checkpoint_every: int = 0
    #: after a rank is killed, the job is started again from this step (its last
    #: checkpoint's), as torchrun restarts it (0: it is not)
    restart_at: int = 0

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes


def _cases() -> list[Case]:
    out = []
    for wl, ranks, steps in (
        ("ddp", 4, 90),
        ("zero", 4, 90),
        ("custom", 4, 90),
        ("megatron", 8, 45),
        ("moe", 4, 90),
    ):
        at = 12 if wl != "megatron" else 8

        def case(name: str, *faults: Fault, wl: str = wl, ranks: int = ranks,
                 steps: int = steps) -> Case:  # fmt: skip
            return Case(f"{wl}-{name}", wl, ranks, steps=steps, faults=faults)

        out += [
            case("healthy"),
            case("slow-link", Fault("slow_link", 1, at)),
            case("slow-rank", Fault("slow_rank", 1, at)),
            case("hang", Fault("hang", 2, at)),
            case("link-down", Fault("link_down", 1, at)),
        ]
        if wl in ("ddp", "megatron", "moe"):
            stall_every = 15 if wl == "ddp" else 8
            out += [
                case("slow-node", Fault("slow_node", 1, at, cpus=0.25)),
                case("killed", Fault("kill", 3, at)),
                case("transient", Fault("transient", 1, at)),
                case("intermittent", Fault("stall", 1, at, times=4, every=stall_every)),
                case("link-and-rank", Fault("slow_link", 0, at), Fault("slow_rank", 3, at)),
            ]
        if wl in ("ddp", "megatron"):
            # a rank a little slower than its peers: just under the CPU a rank uses here
            # (a DDP one about 0.3, a Megatron one 0.2); 5-30% of the job's throughput, as
            # the lab measures it (it varies with the host's load)
            mild = 0.25 if wl == "ddp" else 0.15
            out.append(case("mild-rank", Fault("slow_rank", 1, at, cpus=mild)))
        if wl == "ddp":  # a rank killed, and the job started again from its checkpoint
            out.append(Case("ddp-restart", wl, ranks, steps=steps, faults=(Fault("kill", 3, at),),
                            checkpoint_every=10, restart_at=10))  # fmt: skip
        if wl in ("ddp", "megatron"):  # healthy, saving a checkpoint now and then
            out.append(Case(f"{wl}-checkpoint", wl, ranks, steps=steps, checkpoint_every=10))
        if wl == "megatron":  # two ranks at once, of two stages on two nodes (two of a
            # 4-rank job's would be half of it: what the job does, no culprits)
            out.append(case("two-ranks", Fault("slow_rank", 1, at), Fault("slow_rank", 6, at)))
    return out


CASES: dict[str, Case] = {c.name: c for c in _cases()}
#: the subset CI runs: a slow link, a slow rank, a hang and a healthy run
QUICK = ("ddp-healthy", "ddp-slow-link", "ddp-slow-rank", "ddp-hang")
#: the fewest steps a case may be run for (``megatrace lab --steps``)
MIN_STEPS = 30


def too_few_steps(steps: int | None) -> str | None:
    """Why a case cannot run for ``steps`` steps (None: it can, or the case's own)."""
    if steps is None or steps >= MIN_STEPS:
        return None
    return (
        f"{steps} steps: a case needs {MIN_STEPS} steps or more (its fault comes at step 8 "
        "or 12, and the detectors need steps before it and after it)"
    )


__all__ = ["CASES", "MIN_STEPS", "QUICK", "Case", "Fault", "too_few_steps"]
