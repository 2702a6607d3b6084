"""``megatrace lab``: real distributed jobs, faults the operating system injects, scored
like the simulator.

Each case runs a real training job (:mod:`producers.lab.job`: DDP, sharded data
parallelism, Megatron-style TP x PP x DP, and a job shaped like nothing megatrace
knows) on lab "nodes", network namespaces joined by a bridge (:mod:`infra.netlab`),
with the PyTorch collector in every rank and a node agent per node, through the local
broker and the dataflow into ClickHouse: the production path. Faults come from
outside the job: ``tbf`` on a node's link, the link set down (a hang in the network),
a cgroup CPU quota on a rank or on a node's
ranks (for good; or on a rank for twice the job's usual step time: a transient
straggler), the cgroup ``freezer`` on a rank now and then (a rank that stalls, as a GPU
that drops its clocks for a moment: intermittent), ``SIGSTOP``, ``SIGKILL``; each is
injected when rank 0 reaches a given step, and its label (kind, culprit, onset time) is
written from what was done (:mod:`megatrace.lab_labels`). The verdicts the flow stored
are scored with :mod:`detectors.scoring`, beside the peers' rules; every case is also
kept as a labelled recording (``records.jsonl``, ``labels.jsonl``) for ``megatrace eval
--corpus``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.netlab import NetLab, Node
from megatrace.lab_cases import Case, Fault
from schemas.config import DetectSettings
from schemas.records import Iteration
from schemas.results import FaultLabel, Verdict

Say = Callable[[str], None]


#: what a transient quota (a tenth of a CPU in 10 ms periods) throttles its rank before
#: it is lifted: most of the 9 ms one period can hold back
BITE_NS = 8_000_000
#: how long a hung job is left hung before the lab ends it
HANG_S = 8.0
#: how long a job hung in the network (every rank in a call whose transfer cannot
#: move) is left hung: such a call is a hang only past the detectors' ``stall_hang_s``,
#: a slow transfer being as silent until then
STALL_HOLD_S = HANG_S + DetectSettings().stall_hang_s
#: how long after a rank is killed the job is started again, where a case restarts it
#: (torchrun's agent sees a worker fail within its monitor interval, 5 s by default)
RESTART_S = 4.0
#: a transient straggler's rank goes back to its usual CPU group this long after its
#: quota ended: two of its heartbeats (every 0.25 s) read the time it was throttled first
LEAVE_AFTER_S = 0.6
#: the Flight Recorder ring every rank keeps (entries)
FR_ENTRIES = 4000


@dataclass
class Injected:
    fault: Fault
    onset_ns: int
    ended_ns: int | None = None
    #: a CPU quota's: how long the kernel held its ranks back, and until when it was read
    throttled: tuple[int, int] | None = None


@dataclass
class CaseRun:
    """What one case did and what came of it."""

    case: Case
    job: str
    injected: list[Injected] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    labels: list[FaultLabel] = field(default_factory=list)
    marks: list[Iteration] = field(default_factory=list)
    records: list[Any] = field(default_factory=list)
    #: megatrace's verdicts from the ranks' Flight Recorder dumps alone, where there are any
    fr_verdicts: list[Verdict] = field(default_factory=list)
    fr_ranks: list[int] = field(default_factory=list)  # the ranks that dumped
    seconds: float = 0.0
    error: str = ""


class Ranks:
    """A case's rank processes, inside their nodes."""

    def __init__(
        self,
        case: Case,
        nodes: list[Node],
        job: str,
        run_dir: Path,
        port: int,
        sockets: dict[int, Path],
    ) -> None:
        self.case, self.nodes, self.run_dir = case, nodes, run_dir
        self.progress = run_dir / "progress"
        self.fr_dir = run_dir / "fr"
        self.fr_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._seen: dict[int, float] = {}  # each step, when it was first seen
        self.job, self.port, self.sockets = job, port, sockets
        self.launch()

    def launch(self, start_step: int = 0, attempt: int = 0) -> None:
        """The job's rank processes, from ``start_step`` (a restart's: ``attempt``, as
        torchrun counts its restarts, and a port of its own)."""
        case, nodes, run_dir, sockets = self.case, self.nodes, self.run_dir, self.sockets
        self.procs = []
        for r in range(case.ranks):
            node = nodes[r // case.per_node]
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(case.ranks),
                "MASTER_ADDR": nodes[0].ip,
                "MASTER_PORT": str(self.port + attempt),
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
                "GLOO_SOCKET_IFNAME": node.dev,
                "LOCAL_RANK": str(r % case.per_node),
                "LOCAL_WORLD_SIZE": str(case.per_node),
                "MEGATRACE_NODE": node.name,
                "MEGATRACE_AGENT__SOCKET": str(sockets[node.index]),
                "TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES),
                "MEGATRACE_LAB_FR": str(self.fr_dir),
            }
            log = open(run_dir / f"rank{r}.log", "ab")  # noqa: SIM115
            argv = [
                sys.executable,
                "-m",
                "producers.lab.job",
                "--workload",
                case.workload,
                "--job",
                self.job,
                "--steps",
                str(case.steps),
                "--progress",
                str(self.progress),
                "--checkpoint-every",
                str(case.checkpoint_every),
                "--start-step",
                str(start_step),
            ]
            self.procs.append(
                subprocess.Popen(node.exec(*argv), env=env, stdout=log, stderr=subprocess.STDOUT)
            )
            log.close()

    def step(self) -> int:
        try:
            step = int(self.progress.read_text())
        except (OSError, ValueError):
            return -1
        self._seen.setdefault(step, time.monotonic())
        return step

    def usual_step_s(self) -> float | None:
        """The job's step time so far, from when each step was first seen (steps 0 and 1
        left out: they start the job); None before two are seen."""
        seen = sorted((s, t) for s, t in self._seen.items() if s >= 2)
        if len(seen) < 2:
            return None
        (s0, t0), (s1, t1) = seen[0], seen[-1]
        return (t1 - t0) / (s1 - s0)

    def wait_step(self, step: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.step() >= step:
                return True
            if all(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.02)
        return False

    def dump_flight_recorders(self, stopped: set[int], timeout_s: float = 6.0) -> int:
        """Ask every rank for its Flight Recorder ring (a stopped one cannot answer);
        how many dumps there are once the others answered or ``timeout_s`` passed."""
        ask = self.fr_dir / "dump"
        ask.touch()
        deadline = time.monotonic() + timeout_s
        live = {r for r, p in enumerate(self.procs) if p.poll() is None} - stopped
        while time.monotonic() < deadline and not live <= self.dumped():
            time.sleep(0.1)
        ask.unlink()  # a stopped rank, continued to be killed, must not answer late
        return len(self.dumped())

    def dumped(self) -> set[int]:
        """The ranks whose Flight Recorder dump is written (``rank_<N>``; one being
        written is ``rank_<N>.tmp`` until it is whole)."""
        names = (p.name.removeprefix("rank_") for p in self.fr_dir.glob("rank_*"))
        return {int(n) for n in names if n.isdigit()}

    def pids(self, ranks: list[int]) -> list[int]:
        return [self.procs[r].pid for r in ranks]

    def node_ranks(self, node: int) -> list[int]:
        n = self.case.per_node
        return list(range(node * n, (node + 1) * n))

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                NetLab.signal(p.pid, signal.SIGCONT)  # a stopped process must run to die
                NetLab.signal(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(30)


def inject(lab: NetLab, ranks: Ranks, case: Case, out: list[Injected]) -> None:
    """Each fault of the case, at its step; then the job to its end (a hung one is ended
    after :data:`HANG_S`). Every fault is lifted after, also where the case failed (a
    link left down would hang the next case)."""
    ends: list[Callable[[], None]] = []
    try:
        _inject(lab, ranks, case, out, ends)
    finally:
        for end in ends:
            end()
    ranks.wait(timeout_s=60 + 4 * case.steps)


def _inject(
    lab: NetLab, ranks: Ranks, case: Case, out: list[Injected], ends: list[Callable[[], None]]
) -> None:
    """:func:`inject`'s faults, each one's lifting appended to ``ends``."""
    hang_at: float | None = None
    hold_s = HANG_S
    stopped: set[int] = set()
    for i, f in enumerate(case.faults):
        if not ranks.wait_step(f.at_step, timeout_s=300):
            break
        inj = Injected(f, time.time_ns())
        out.append(inj)
        if f.kind == "slow_link":
            node = lab.nodes[f.target]
            lab.limit_link(node, f.rate_mbit)
            ends.append(lambda node=node: lab.clear_link(node))
        elif f.kind == "link_down":  # the job cannot go on: a hang in the network
            node = lab.nodes[f.target]
            lab.cut_link(node)
            ends.append(lambda node=node: lab.cut_link(node, False))
            hang_at, hold_s = time.monotonic(), STALL_HOLD_S
        elif f.kind in ("slow_rank", "slow_node"):
            who = [f.target] if f.kind != "slow_node" else ranks.node_ranks(f.target)
            group = lab.cgroup(f"{case.name[:20]}-{i}", ranks.pids(who))
            lab.quota(group, f.cpus)
            ends.append(lambda group=group, inj=inj: _lift(lab, group, inj))
        elif f.kind == "transient":
            group = lab.cgroup(f"{case.name[:20]}-{i}", ranks.pids([f.target]))
            lab.quota(group, f.cpus, period_us=10_000)
            held_s = f.stall_steps * (ranks.usual_step_s() or 0.1)
            time.sleep(held_s)
            # a rank waiting in its collectives may not spend its quota at once: held on
            # (at most as long again) until the kernel throttled it most of a period
            deadline = time.monotonic() + held_s
            while (NetLab.throttled_ns(group) or 0) < BITE_NS and time.monotonic() < deadline:
                time.sleep(0.002)
            _lift(lab, group, inj)
            inj.ended_ns = time.time_ns()
            # back with its session's other processes once its heartbeats read the
            # throttled time (in a cpu group of its own, it would get as much of the CPU
            # as all of them together for the rest of the job: a fault of its own)
            time.sleep(LEAVE_AFTER_S)
            lab.leave(group)
        elif f.kind == "stall":  # frozen, as a GPU stalls: late, yet waiting for nothing
            group = lab.cgroup(f"{case.name[:20]}-{i}", ranks.pids([f.target]), ("freezer",))
            for k in range(f.times):
                if k and not ranks.wait_step(f.at_step + k * f.every, timeout_s=300):
                    break
                lab.freeze(group)
                try:
                    time.sleep(max(f.stall_min_s, f.stall_steps * (ranks.usual_step_s() or 0.1)))
                finally:
                    lab.freeze(group, False)
            inj.ended_ns = time.time_ns()
        elif f.kind == "hang":
            NetLab.signal(ranks.pids([f.target])[0], signal.SIGSTOP)
            stopped.add(f.target)
            hang_at = time.monotonic()
        elif f.kind == "kill":
            NetLab.signal(ranks.pids([f.target])[0], signal.SIGKILL)
            hang_at = time.monotonic()
            if case.restart_at:  # as torchrun: the others stopped, all started again
                time.sleep(RESTART_S)
                ranks.kill()
                inj.ended_ns = time.time_ns()
                ranks.launch(case.restart_at, attempt=1)
                hang_at = None
    if hang_at is not None:  # the job cannot go on: leave it hung a while, then end it
        time.sleep(max(0.0, hold_s - (time.monotonic() - hang_at)))
        ranks.dump_flight_recorders(stopped)  # as the watchdogs would, at their timeout
        ranks.kill()
    else:
        # faults last to the end of training, not through the processes' exit: a quota
        # held through it would count the seconds their teardown was throttled
        ranks.wait_step(case.steps - 1, timeout_s=60 + 4 * case.steps)


def _lift(lab: NetLab, group: str, inj: Injected) -> None:
    """A CPU quota's end: how long it held its ranks back is read first."""
    held = NetLab.throttled_ns(group)
    if held is not None:
        inj.throttled = (held, time.time_ns())
    lab.quota(group, None)


__all__ = [
    "CaseRun",
    "Injected",
    "Ranks",
    "inject",
]
