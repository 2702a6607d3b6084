"""The simulator's timing rules and labels hold, and its records are valid schema records."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from producers.sim.engine import Engine
from producers.sim.faults import MissingRecv, SlowGPU, SlowLink
from producers.sim.job import JobSpec, SpecError
from producers.sim.scenarios import build, scale_spec
from schemas.codec import decode, encode
from schemas.enums import CollOp, Phase
from schemas.records import Collective, LinkSample


def _records(run):
    return list(run.records())


@pytest.mark.parametrize(("ep", "cp"), [(1, 1), (2, 1), (1, 2)])
def test_sequence_numbers_agree_across_members(ep: int, cp: int) -> None:
    run = build("healthy", scale="tiny", seed=2, steps=4, ep=ep, cp=cp)
    colls = [r for r in _records(run) if isinstance(r, Collective)]
    members = Counter()
    sizes = {}
    for c in colls:
        key = (
            (c.comm_hash, c.seq)
            if not c.op.is_p2p
            else (c.comm_hash, c.rank if c.op == CollOp.SEND else c.peer, c.seq)
        )
        members[key] += 1
        sizes[key] = 2 if c.op.is_p2p else c.comm_size
    assert members and all(members[k] == sizes[k] for k in members)
    # p2p: every Send has exactly one Recv with the same (comm, seq, sender)
    sends = {(c.comm_hash, c.rank, c.peer, c.seq) for c in colls if c.op == CollOp.SEND}
    recvs = {(c.comm_hash, c.peer, c.rank, c.seq) for c in colls if c.op == CollOp.RECV}
    assert sends == recvs


def test_heartbeats_count_what_each_rank_issued_and_completed_as_the_collector_does() -> None:
    """Each step's heartbeats carry, per communicator, a collective's newest seq, and for a
    pair of pipeline stages how many Sends and Recvs the rank issued and completed (one
    counter both ways, as the PyTorch collector keeps it; each direction numbers its own
    seq), so a pipeline hang is judged from the same counts in the simulator as in a real
    job."""
    from producers.sim.emit import Emitter
    from schemas.records import Heartbeat

    engine = Engine(scale_spec("tiny", kernels=False), [])
    emitter = Emitter(engine)
    issued: Counter = Counter()
    completed: Counter = Counter()
    newest: dict[tuple[int, int], int] = {}
    pairs = 0
    for _ in range(3):
        records = list(emitter.step_records(engine.step()))
        for r in records:
            if isinstance(r, Collective) and r.op.is_p2p:
                issued[(r.rank, r.comm_hash)] += 1
                completed[(r.rank, r.comm_hash)] += r.end_ns is not None
            elif isinstance(r, Collective):
                newest[(r.rank, r.comm_hash)] = max(newest.get((r.rank, r.comm_hash), -1), r.seq)
        for hb in (r for r in records if isinstance(r, Heartbeat)):
            for p in hb.comms:
                key = (hb.rank, p.comm_hash)
                if key in issued:
                    assert (p.issued_seq, p.completed_seq) == (issued[key] - 1,
                                                               completed[key] - 1)  # fmt: skip
                    pairs += 1
                else:
                    assert p.issued_seq == p.completed_seq == newest[key]
    assert pairs == 3 * 8  # each step, both ends of the tiny job's four pairs of stages


def test_a_slow_rank_is_the_last_arriver_of_its_group() -> None:
    spec = scale_spec("tiny", kernels=False)
    slow = 5
    eng = Engine(spec, [SlowGPU(onset_step=0, rank=slow, factor=1.5)])
    tr = eng.step()
    c = tr.colls
    tp = c["slot"] == 0
    by_inst = defaultdict(list)
    for r, comm, seq, a in zip(
        c["rank"][tp], c["comm"][tp], c["seq"][tp], c["start"][tp], strict=True
    ):
        by_inst[(comm, seq)].append((a, r))
    group = [k for k, v in by_inst.items() if any(r == slow for _, r in v)]
    last = [max(by_inst[k])[1] for k in group]
    assert sum(r == slow for r in last) / len(last) > 0.9
    # every member of those collectives ends together, after the slow rank arrived
    ends = c["end"][tp]
    for k in group[:20]:
        mask = (c["comm"][tp] == k[0]) & (c["seq"][tp] == k[1])
        assert np.ptp(ends[mask]) == 0 and ends[mask][0] >= max(by_inst[k])[0]


def test_a_missing_recv_stalls_its_dependants_and_the_culprit_issues_nothing_more() -> None:
    spec = scale_spec("tiny", kernels=False)
    culprit = spec.rank(1, 0, 1)
    eng = Engine(spec, [MissingRecv(onset_step=1, rank=culprit, phase=Phase.FORWARD, microbatch=2)])
    eng.step()
    tr = eng.step()
    assert tr.hung
    c = tr.colls
    mine = c["rank"] == culprit
    # the culprit's last call in the step is before the Recv it never posted
    recv_mb2 = (
        (c["op"][mine] == list(CollOp).index(CollOp.RECV))
        & (c["mb"][mine] == 2)
        & (c["phase"][mine] == list(Phase).index(Phase.FORWARD))
    )
    assert not recv_mb2.any()
    # its sender waits forever, so does its TP peer
    sender = spec.rank(0, 0, 1)
    stuck = {int(r) for r, e in zip(c["rank"], c["end"], strict=True) if np.isinf(e)}
    assert sender in stuck and spec.rank(1, 0, 0) in stuck
    assert culprit not in stuck  # it never joined anything it could wait in


def test_bubble_delay_costs_nothing_and_is_labelled_off_critical_path() -> None:
    run = build("bubble-delay", scale="tiny", seed=0, steps=20)
    _records(run)
    (label,) = run.labels
    assert label.throughput_cost < 0.005
    assert label.on_critical_path is False


def test_slow_link_shows_in_link_samples_after_onset() -> None:
    run = build("slow-link", scale="tiny", seed=1, steps=24)
    recs = _records(run)
    (fault,) = run.faults
    assert isinstance(fault, SlowLink)
    onset_ns = run.labels[0].onset_ns
    edge = [
        r
        for r in recs
        if isinstance(r, LinkSample)
        and (r.src_rank, r.dst_rank) == (fault.src_rank, fault.dst_rank)
    ]
    before = np.median([r.throughput_gbps for r in edge if r.ts_ns < onset_ns])
    after = np.median([r.throughput_gbps for r in edge if r.ts_ns > onset_ns])
    assert after < before / (fault.factor * 0.8)


def test_records_are_valid_schema_records_and_labels_match_the_faults() -> None:
    run = build("mixed", scale="tiny", seed=3, steps=24)
    recs = _records(run)
    for r in recs[:: max(1, len(recs) // 2000)]:
        assert decode(encode(r)) == r
    assert [lab.kind.value for lab in run.labels] == ["slowdown", "link_degradation"]
    assert run.labels[0].rank == run.faults[0].rank


def test_expert_parallel_groups_are_carved_from_data_parallel_ranks() -> None:
    """ep=2: every MoE layer's dispatch and combine AllToAll run in groups of 2 dp ranks."""
    from schemas.enums import CommRole
    from schemas.records import CommInfo

    run = build("healthy", scale="demo", seed=0, steps=2, ep=2)  # tp2 pp4 dp2
    recs = _records(run)
    ep = {r.comm_hash: r for r in recs if isinstance(r, CommInfo) and r.role == CommRole.EP}
    spec = run.spec
    assert len(ep) == spec.pp * spec.tp * spec.dp // spec.ep
    for info in ep.values():
        coords = [spec.coords(r) for r in info.ranks]
        assert len({(p, t) for p, _, t in coords}) == 1  # one stage, one tp index
        assert sorted(d for _, d, _ in coords) == list(range(spec.ep))
    a2a = [r for r in recs if isinstance(r, Collective) and r.comm_hash in ep]
    assert {r.op for r in a2a} == {CollOp.ALL_TO_ALL}
    per_rank = Counter(r.rank for r in a2a)
    # dispatch + combine per layer, forward and backward, every micro-batch, 2 steps
    expected = 2 * spec.layers_per_stage * 2 * spec.num_microbatches * 2
    assert set(per_rank.values()) == {expected}


def test_context_parallel_groups_follow_megatrons_layout() -> None:
    """cp=2, Megatron's tp-cp-dp-pp order: CP groups are pairs of consecutive data-axis
    ranks; every layer gathers keys and values; gradients are reduced over dp x cp."""
    from schemas.enums import CommRole
    from schemas.records import CommInfo, RankInfo

    run = build("healthy", scale="demo", seed=0, steps=2, cp=2)  # tp2 pp4 dp2 cp2
    spec = run.spec
    recs = _records(run)
    assert spec.world_size == 32 and spec.num_microbatches == scale_spec("demo").num_microbatches
    comms = {r.comm_hash: r for r in recs if isinstance(r, CommInfo)}
    cp = {h: c for h, c in comms.items() if c.role == CommRole.CP}
    assert len(cp) == spec.pp * spec.tp * spec.dp
    for info in cp.values():  # ranks tp apart: cp varies right after tp
        assert info.ranks[1] - info.ranks[0] == spec.tp
    dp = [c for c in comms.values() if c.role == CommRole.DP]
    assert {len(c.ranks) for c in dp} == {spec.dp * spec.cp}
    ranks = {r.rank: r for r in recs if isinstance(r, RankInfo)}
    assert (ranks[2].cp_rank, ranks[2].dp_rank, ranks[4].cp_rank, ranks[4].dp_rank) == (1, 0, 0, 1)
    cp_calls = [r for r in recs if isinstance(r, Collective) and r.comm_hash in cp]
    assert {r.op for r in cp_calls} == {CollOp.ALL_GATHER, CollOp.REDUCE_SCATTER}
    per_rank = Counter(r.rank for r in cp_calls)
    # two per layer, forward and backward, every micro-batch, 2 steps
    expected = 2 * spec.layers_per_stage * 2 * spec.num_microbatches * 2
    assert set(per_rank.values()) == {expected}


def test_impossible_jobs_are_refused_with_the_reason() -> None:
    with pytest.raises(SpecError, match="context and expert parallelism"):
        JobSpec(cp=2, ep=2, dp=2)
    with pytest.raises(SpecError, match="seq_len 4095 is not divisible by cp 2"):
        JobSpec(cp=2, seq_len=4095)
    with pytest.raises(SpecError, match="ep 3 must divide dp 2"):
        JobSpec(dp=2, ep=3)
    with pytest.raises(SpecError, match="not divisible by pp"):
        JobSpec(num_layers=7, pp=2)
    with pytest.raises(SpecError, match="multiple of micro_batch_size"):
        JobSpec(global_batch_size=15, dp=2)
