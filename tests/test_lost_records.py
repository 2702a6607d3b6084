"""Records lost on the way (a source's full buffer) are told apart from a hang: a member
missing from a call but seen at later calls of the same stream joined it, its record of
it never arrived. Such a call is counted as lost, never taken for a hang's evidence."""

from __future__ import annotations

from detectors.align import CollectiveAligner
from schemas.enums import CollOp, DType
from schemas.records import Collective

MS = 1_000_000


def _call(
    rank: int, seq: int, op: CollOp = CollOp.ALL_REDUCE, peer: int | None = None
) -> Collective:
    t = seq * 10 * MS
    return Collective(job="j", node="n", rank=rank, comm_hash=9, comm_size=2, rank_in_comm=rank,
                      op=op, seq=seq, count=1, size_bytes=2, dtype=DType.BFLOAT16,
                      enqueue_ns=t, start_ns=t, end_ns=t + MS, peer=peer)  # fmt: skip


def test_a_call_whose_missing_member_went_on_is_counted_lost_not_reported() -> None:
    al = CollectiveAligner(min_timeout_ns=50 * MS)
    for seq in range(6):
        al.update(_call(0, seq))
        if seq != 2:  # rank 1's record of seq 2 never arrives; it goes on to 3, 4, 5
            al.update(_call(1, seq))
    assert al.expire(10**10) == [] and (al.lost, al.n_open) == (1, 0)


def test_a_call_whose_missing_member_stopped_is_reported_partial() -> None:
    al = CollectiveAligner(min_timeout_ns=50 * MS)
    for seq in range(3):
        al.update(_call(0, seq))
        if seq < 2:  # rank 1 stops before seq 2
            al.update(_call(1, seq))
    (inst,) = al.expire(10**10)
    assert (inst.seq, inst.ranks, al.lost) == (2, (0,), 0)
    assert al.passed() == []  # nobody went past it: it stays a hang's evidence


def test_a_reported_call_is_passed_once_its_missing_member_shows_up_later() -> None:
    """Reported partial before the evidence came (the member's later records were
    late): :meth:`passed` takes it back once they arrive; for transfers too, per
    direction."""
    al = CollectiveAligner(min_timeout_ns=50 * MS)
    al.update(_call(0, 0, CollOp.SEND, peer=1))  # rank 1's Recv of it is lost
    (inst,) = al.expire(10**10)
    assert inst.op is CollOp.SEND
    al.update(_call(0, 1, CollOp.RECV, peer=1))  # the other direction says nothing of it
    al.update(_call(1, 1, CollOp.SEND, peer=0))
    assert al.passed() == []
    al.update(_call(0, 1, CollOp.SEND, peer=1))
    al.update(_call(1, 1, CollOp.RECV, peer=0))  # rank 1 received the next one from 0
    (gone,) = al.passed()
    assert (gone.key, al.lost, al.n_open) == (inst.key, 1, 0)
