"""MEGATRACE's critical path over one pipeline's 1F1B graph of one iteration.

Nodes are (stage, phase, micro-batch); edges are the next node on the same
stage, forward b on stage s -> forward b on stage s+1, and backward b on stage
s+1 -> backward b on stage s. With each node's duration, earliest and latest
start times give the slack; nodes with (near) zero slack are critical. Only a
critical node can slow the iteration: a slow node inside a pipeline bubble
has slack that absorbs it.

>>> d = {(s, ph, mb): 10.0 for s in range(2) for ph in ("forward", "backward") for mb in range(2)}
>>> d[(0, "backward", 0)] = 5.0
>>> cp = critical_path(d, stages=2, microbatches=2)
>>> cp.length
60.0
>>> sorted(n for n in d if cp.slack[n] > 0)
[(0, 'backward', 0), (0, 'forward', 1)]
>>> cp.path[0], cp.path[-1]
((0, 'forward', 0), (0, 'backward', 1))
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.layout import BWD, FWD, one_f_one_b

NodeId = tuple[int, str, int]  # (stage, phase, micro-batch)


@dataclass(frozen=True)
class CriticalPath:
    length: float
    earliest: dict[NodeId, float]
    slack: dict[NodeId, float]
    path: list[NodeId]

    def critical(self, tolerance: float) -> set[NodeId]:
        return {n for n, s in self.slack.items() if s <= tolerance}


def pipeline_edges(stages: int, microbatches: int) -> dict[NodeId, list[NodeId]]:
    """Predecessors of every node of the 1F1B graph."""
    preds: dict[NodeId, list[NodeId]] = {}
    for s in range(stages):
        order = one_f_one_b(s, stages, microbatches)
        for i, (phase, mb) in enumerate(order):
            node = (s, phase, mb)
            p = [(s, *order[i - 1])] if i else []
            if phase == FWD and s > 0:
                p.append((s - 1, FWD, mb))
            if phase == BWD and s < stages - 1:
                p.append((s + 1, BWD, mb))
            preds[node] = p
    return preds


def _topological(preds: dict[NodeId, list[NodeId]]) -> list[NodeId]:
    order: list[NodeId] = []
    seen: set[NodeId] = set()
    for root in preds:
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            stack.extend((p, False) for p in preds[node] if p not in seen)
    return order


def critical_path(durations: dict[NodeId, float], stages: int, microbatches: int) -> CriticalPath:
    """Earliest start, slack and one critical path; missing durations count as zero."""
    preds = pipeline_edges(stages, microbatches)
    order = _topological(preds)
    dur = {n: float(durations.get(n, 0.0)) for n in preds}
    es: dict[NodeId, float] = {}
    for n in order:
        es[n] = max((es[p] + dur[p] for p in preds[n]), default=0.0)
    length = max(es[n] + dur[n] for n in order)
    succs: dict[NodeId, list[NodeId]] = {n: [] for n in preds}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    ls: dict[NodeId, float] = {}
    for n in reversed(order):
        ls[n] = min((ls[c] for c in succs[n]), default=length) - dur[n]
    slack = {n: ls[n] - es[n] for n in order}
    # walk one critical path back from the sink
    node = max(order, key=lambda n: es[n] + dur[n])
    path = [node]
    while preds[node]:
        node = max(preds[node], key=lambda p: es[p] + dur[p])
        path.append(node)
    return CriticalPath(length, es, slack, path[::-1])
