"""Localise a slowdown: which rank (or node) made the critical path longer.

MEGATRACE's Algorithm 2 over :class:`~detectors.steps.StepReport` tables:

1. keep an expected duration per pipeline node and a per-rank baseline of
   lateness (TP arrivals relative to the group) and of the host's lead over
   the GPU - healthy ranks have small persistent offsets, so each rank is
   compared with its own history;
2. take the slowest pipeline replicas, compute their critical path, and keep
   critical nodes slower than expected x (1 + ``node_margin``);
3. if most ranks of one node lost their host lead (the GPU waits for the
   CPU to launch), blame that node's host; otherwise blame the rank of the
   slow node's TP group whose lateness grew most (the latest arriver), and any
   member whose lateness grew nearly as much (several culprits).

Where no schedule can be walked, or nothing on it explains the time added, the
localiser names who made the others wait, or the network
(:class:`~detectors.who_waits.WhoWaits`, whose baselines it keeps).

Nodes that got slower but have slack (a pipeline bubble) are never blamed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from detectors.critical_path import critical_path
from detectors.steps import StepReport
from detectors.topology import Topology
from detectors.who_waits import TOGETHER, SlowdownFinding, WhoWaits
from schemas.enums import Cause


class SlowdownLocalizer(WhoWaits):
    """Per-job baselines and the localisation step.

    Parameters
    ----------
    warmup
        Reports used to seed the baselines.
    node_margin
        A critical node counts as slow above expected x (1 + node_margin).
    alpha
        A node's expected duration follows new values within this fraction of it.
    host_lead_drop
        A rank lost its host lead when it falls below this fraction of its baseline.
    replicas
        How many of the slowest pipeline replicas are analysed in full.
    """

    def __init__(
        self,
        warmup: int = 5,
        node_margin: float = 0.1,
        alpha: float = 0.05,
        host_lead_drop: float = 0.3,
        replicas: int = 2,
    ) -> None:
        if warmup < 1 or node_margin <= 0 or not 0 < alpha < 1 or replicas < 1:
            raise ValueError("warmup >= 1, node_margin > 0, 0 < alpha < 1, replicas >= 1")
        self.warmup = warmup
        self.node_margin = node_margin
        self.alpha = alpha
        self.host_lead_drop = host_lead_drop
        self.replicas = replicas
        self._reset()

    def _reset(self) -> None:
        self._seen = 0
        self._late: list[np.ndarray] = []
        self._lead: list[np.ndarray] = []
        self.base_late: np.ndarray | None = None
        self.base_lead: np.ndarray | None = None
        self._blame: list[np.ndarray] = []
        self.base_blame: np.ndarray | None = None  # the last arrivers' blame, any layout
        self._wait: list[np.ndarray] = []
        self.base_wait: np.ndarray | None = None  # each rank's time waiting in collectives
        self._xsum: list[dict[int, int]] = []
        self.base_xsum: dict[int, float] = {}  # per communicator, a step's transfer time
        self.expected: dict[tuple, float] = {}
        self._seed_nodes: dict[tuple, list[float]] = {}

    @property
    def ready(self) -> bool:
        return self.base_late is not None

    def learn(self, rep: StepReport) -> None:
        """Fold a healthy step into the baselines."""
        if not rep.complete:
            return
        self._seen += 1
        if self.base_late is None:
            self._late.append(rep.lateness_ns.copy())
            self._lead.append(rep.host_lead_ns.copy())
            self._blame.append(rep.blame_any_ns.copy())
            self._wait.append(rep.wait_ns.copy())
            self._xsum.append(dict(rep.transfer_sum_ns))
            for d, nodes in rep.spans.items():
                for key, (b, e) in nodes.items():
                    self._seed_nodes.setdefault((d, *key), []).append(float(e - b))
            if self._seen >= self.warmup:
                self.base_late = np.median(np.array(self._late), axis=0)
                self.base_lead = np.median(np.array(self._lead), axis=0)
                self.base_blame = np.median(np.array(self._blame), axis=0)
                self.base_wait = np.median(np.array(self._wait), axis=0)
                self._wait = []
                comms = dict.fromkeys(c for x in self._xsum for c in x)
                self.base_xsum = _medians({c: [x.get(c, 0) for x in self._xsum] for c in comms})
                self.expected = _medians(self._seed_nodes)
                self._late, self._lead, self._blame, self._seed_nodes = [], [], [], {}
                self._xsum = []
            return
        self.base_late += 0.05 * (rep.lateness_ns - self.base_late)
        self.base_lead += 0.05 * (rep.host_lead_ns - self.base_lead)
        if self.base_blame is None:  # pickled by a version without it
            self.base_blame = rep.blame_any_ns.copy()
        self.base_blame += 0.05 * (rep.blame_any_ns - self.base_blame)
        if getattr(self, "base_wait", None) is None:  # pickled by a version without it
            self.base_wait = rep.wait_ns.astype(float)
        self.base_wait += 0.05 * (rep.wait_ns - self.base_wait)
        xsum = getattr(self, "base_xsum", None)
        if xsum is None:  # pickled by a version without it
            xsum = self.base_xsum = {}
        for c, x in rep.transfer_sum_ns.items():
            xsum[c] = xsum.get(c, float(x)) + 0.05 * (x - xsum.get(c, float(x)))
        expected, alpha = self.expected, self.alpha
        for replica, nodes in rep.spans.items():
            for node, (b, e) in nodes.items():
                key = (replica, *node)
                d = float(e - b)
                exp = expected.get(key)
                if exp is None:
                    expected[key] = d
                elif abs(d - exp) <= alpha * exp:
                    expected[key] = exp + 0.2 * (d - exp)

    def held_up(self, rep: StepReport) -> tuple[int, float]:
        """The rank that, as the last to arrive, made the others wait longer than it
        usually does by the largest share of step ``rep``, and that share ((-1, 0.0)
        before the baselines)."""
        base = self.base_blame
        if base is None or rep.duration_ns <= 0 or len(base) != len(rep.blame_any_ns):
            return -1, 0.0
        excess = rep.blame_any_ns - base
        r = int(np.argmax(excess))
        return r, max(float(excess[r]), 0.0) / rep.duration_ns

    def localize(self, reports: Sequence[StepReport], topo: Topology) -> list[SlowdownFinding]:
        """Culprit candidates for the slowdown seen in ``reports``, most likely first.

        A starved host comes first when one is seen; then, for each slow critical
        node (largest excess first), the member of its TP group whose lateness grew most.
        """
        reps = [r for r in reports if r.complete] or list(reports)
        if not reps or self.base_late is None or self.base_lead is None:
            return []
        late = np.mean([r.lateness_ns for r in reps], axis=0) - self.base_late
        lead = np.mean([r.host_lead_ns for r in reps], axis=0)
        host = self._host_node(lead, topo)
        slow = self._slow_critical_nodes(reps, topo)
        out: list[SlowdownFinding] = []
        if host is not None:
            node, frac, ratio = host
            ranks_on = [r for r in range(len(lead)) if topo.node(r) == node]
            stage = topo.coords(ranks_on[0])[0] if ranks_on else None
            out.append(
                SlowdownFinding(
                    Cause.HOST_CPU,
                    None,
                    node,
                    stage,
                    None,
                    None,
                    critical=bool(slow),
                    evidence={"ranks_host_bound": frac, "host_lead_ratio": ratio},
                )
            )
        seen: set[int] = set()
        ranked = []
        for (d, s, phase, mb), excess, dur in slow:
            group = [r for r in range(len(late)) if topo.coords(r)[:2] == (s, d)]
            top = float(max(late[r] for r in group))
            # the latest arriver, and any member nearly as late (two of a group slowed)
            for r in group:
                if late[r] == top or late[r] >= TOGETHER * top > 0:
                    ranked.append((float(late[r]), r, group, (s, phase, mb), excess, dur))
        for growth, culprit, group, (s, phase, mb), excess, dur in sorted(ranked, reverse=True):
            if culprit in seen:
                continue
            seen.add(culprit)
            others = [late[r] for r in group if r != culprit]
            out.append(
                SlowdownFinding(
                    Cause.COMPUTE,
                    culprit,
                    topo.node(culprit),
                    s,
                    phase,
                    mb,
                    critical=True,
                    evidence={
                        "node_excess_ns": excess,
                        "node_duration_ns": dur,
                        "rank_lateness_growth_ns": growth,
                        "peer_lateness_growth_ns": float(np.mean(others)) if others else 0.0,
                    },
                )
            )
        return out

    def _host_node(self, lead: np.ndarray, topo: Topology) -> tuple[str, float, float] | None:
        base = self.base_lead
        assert base is not None
        ratio = np.divide(lead, base, out=np.ones_like(lead), where=base > 0)
        by_node: dict[str, list[float]] = {}
        for r, x in enumerate(ratio.tolist()):
            by_node.setdefault(topo.node(r), []).append(x)
        best = None
        for node, xs in by_node.items():
            frac = sum(x < self.host_lead_drop for x in xs) / len(xs)
            if frac >= 0.75 and (best is None or np.mean(xs) < best[2]):
                best = (node, frac, float(np.mean(xs)))
        return best

    def _slow_critical_nodes(
        self, reps: Sequence[StepReport], topo: Topology
    ) -> list[tuple[tuple, float, float]]:
        j = topo.job
        out = []
        for rep in reps[-2:]:
            for d in rep.slowest_replicas(self.replicas):
                durs = rep.node_durations(d)
                if not durs:
                    continue
                cp = critical_path(durs, j.pp, j.num_microbatches)
                tol = 0.01 * cp.length
                for node in cp.critical(tol):
                    key = (d, *node)
                    exp = self.expected.get(key)
                    dur = durs.get(node, 0.0)
                    if exp and dur > exp * (1 + self.node_margin):
                        out.append((key, dur - exp, dur))
        return out


def _medians(samples: dict[tuple, list[float]]) -> dict[tuple, float]:
    """Each key's median, computed for all keys with as many samples at once
    (thousands of nodes at 4,096 ranks: a numpy call per key would dominate the step's
    analysis; ``megatrace bench analyze`` times it).

    >>> _medians({"a": [3.0, 1.0, 2.0], "b": [5.0, 7.0], "c": [4.0, 6.0]})
    {'a': 2.0, 'b': 6.0, 'c': 5.0}
    """
    by_len: dict[int, list[tuple]] = {}
    for key, values in samples.items():
        by_len.setdefault(len(values), []).append(key)
    out: dict[tuple, float] = {}
    for keys in by_len.values():
        medians = np.median(np.array([samples[k] for k in keys]), axis=1)
        out.update(zip(keys, medians.tolist(), strict=True))
    return {k: out[k] for k in samples}
