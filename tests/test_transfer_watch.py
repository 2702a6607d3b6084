"""The network between nodes from its communicators' transfer times
(:class:`~detectors.transfer_watch.TransferWatch`): what tells it from a slow member."""

from __future__ import annotations

from detectors.topology import Topology
from detectors.transfer_watch import TransferWatch
from schemas.enums import CommRole
from schemas.records import CommInfo, JobInfo


def _topo(comms: dict[int, list[int]]) -> Topology:
    """8 ranks, 4 per node: ranks 0-3 on node-0, 4-7 on node-1."""
    topo = Topology.from_job(
        JobInfo(job="j", ts_ns=0, world_size=8, tp=1, pp=2, dp=4, gpus_per_node=4)
    )
    for h, ranks in comms.items():
        topo.add(CommInfo(job="j", ts_ns=0, comm_hash=h, role=CommRole.PP, ranks=ranks))
    return topo


def _run(watch, topo, slow: dict[int, float], steps: int = 30, at: int = 10, **kw):
    """Every communicator moves 10 ms a step; those in ``slow`` that many times more from
    step ``at`` (and back from step 20)."""
    events = []
    for step in range(steps):
        xsum = {c: int(10e6 * (slow.get(c, 1.0) if at <= step < 20 else 1.0)) for c in topo.comms}
        events += watch.update(step, step * 1000, xsum, topo, **kw)
    return [(e.kind, e.link, e.onset_step) for e in events]


def test_every_communicator_across_two_nodes_slower_is_their_network_and_it_comes_back():
    topo = _topo({1: [0, 4], 2: [1, 5], 3: [2, 6]})
    assert _run(TransferWatch(), topo, {1: 3.0, 2: 2.5, 3: 2.2}) == [
        ("degraded", "node-0<->node-1", 10),
        ("recovered", "node-0<->node-1", 22),
    ]


def test_one_communicator_slower_is_a_member_not_the_network():
    topo = _topo({1: [0, 4], 2: [1, 5], 3: [2, 6]})
    assert _run(TransferWatch(), topo, {1: 4.0}) == []


def test_a_rank_in_every_communicator_could_be_what_is_slow():
    topo = _topo({1: [0, 4], 2: [0, 5]})  # rank 0 is in both
    assert _run(TransferWatch(), topo, {1: 3.0, 2: 3.0}) == []


def test_a_single_communicator_cannot_tell_its_network_from_its_members():
    topo = _topo({1: [0, 1, 4, 5]})
    assert _run(TransferWatch(), topo, {1: 5.0}) == []


def test_what_another_incident_explains_is_not_judged():
    topo = _topo({1: [0, 4], 2: [1, 5], 3: [2, 6]})
    slow = {1: 3.0, 2: 3.0, 3: 3.0}
    assert _run(TransferWatch(), topo, slow, skip_nodes={"node-1"}) == []
    assert _run(TransferWatch(), topo, slow, hold=True) == []
    # a rank another incident names: the communicators without it still tell
    assert _run(TransferWatch(), topo, slow, skip_ranks={0})[0][:2] == (
        "degraded",
        "node-0<->node-1",
    )
    assert _run(TransferWatch(), topo, slow, skip_ranks={0, 1}) == []


def test_a_noisy_healthy_job_is_not_a_slow_network():
    import numpy as np

    rng = np.random.default_rng(0)
    topo = _topo({1: [0, 4], 2: [1, 5], 3: [2, 6], 4: [3, 7]})
    watch = TransferWatch()
    events = []
    for step in range(5000):  # log-normal step-to-step noise of 40%, and 3x spikes
        xsum = {c: int(10e6 * rng.lognormal(0, 0.4) * (3 if rng.random() < 0.05 else 1))
                for c in topo.comms}  # fmt: skip
        events += watch.update(step, step * 1000, xsum, topo)
    assert events == []


def test_the_network_is_back_only_when_every_communicator_across_it_is():
    topo = _topo({1: [0, 4], 2: [1, 5], 3: [2, 6]})
    watch = TransferWatch()
    events = []
    for step in range(40):
        slow = step >= 10
        xsum = {1: int(10e6 * (3 if slow and step < 20 else 1)),  # back at step 20
                2: int(10e6 * (3 if slow else 1)), 3: int(10e6 * (3 if slow else 1))}  # fmt: skip
        events += watch.update(step, step * 1000, xsum, topo)
    assert [(e.kind, e.onset_step) for e in events] == [("degraded", 10)]


def _drifting(watch: TransferWatch, seed: int, **kw) -> list[tuple[str, int]]:
    """A healthy job whose transfers vary step to step as a crowded host's do (log-normal,
    a spread of 0.55: the healthy Megatron job of ``tests/corpus/soak/busy1`` varies by
    as much) around a level that drifts up 60% over 3,000 steps and back (the host taking
    on other work), each communicator on its own."""
    import numpy as np

    rng = np.random.default_rng(seed)
    topo = _topo({1: [0, 4], 2: [1, 5], 3: [2, 6], 4: [3, 7]})
    events = []
    for step in range(6000):
        level = 1.0 + 0.6 * min(step, 6000 - step) / 3000
        xsum = {c: int(10e6 * level * rng.lognormal(0, 0.55)) for c in topo.comms}
        events += watch.update(step, step * 1000, xsum, topo, **kw)
    return [(e.kind, e.onset_step) for e in events]


def test_a_healthy_drift_under_noise_is_followed_not_a_slow_network():
    # the usual time follows the communicator's recent median, not the steps under a
    # cut-off: those would hold it under the level of a job this noisy (8 false networks
    # over these three jobs)
    for seed in range(3):
        assert _drifting(TransferWatch(), seed) == []


def test_members_kept_from_a_cpu_move_their_data_late_not_the_network():
    topo = _topo({1: [0, 4], 2: [1, 5], 3: [2, 6]})
    asked = []

    def cpu_bound(ranks: set[int], since_ns: int) -> bool:
        asked.append((sorted(ranks), since_ns))
        return True

    slow = {1: 3.0, 2: 3.0, 3: 3.0}
    assert _run(TransferWatch(), topo, slow, cpu_bound=cpu_bound) == []
    # asked of every member, since the slow steps began
    assert asked[0] == ([0, 1, 2, 4, 5, 6], 10_000)
    assert _run(TransferWatch(), topo, slow, cpu_bound=lambda r, s: False)[0][:2] == (
        "degraded",
        "node-0<->node-1",
    )
