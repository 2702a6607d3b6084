"""The compiled alignment core (detectors/_align.c) against its Python reference.

Both cores work on the same state, so the test feeds one stream, in the same batches,
to an aligner of each and compares everything: the instances they complete, the
partial ones they report, their counts and their state, and that a snapshot taken
under one core resumes under the other.
"""

from __future__ import annotations

import pickle
import random
from collections import OrderedDict
from itertools import pairwise
from types import SimpleNamespace

import pytest

import detectors.align as align
from detectors.align import CollectiveAligner
from schemas.enums import CollOp, DType
from schemas.records import Collective


def test_the_compiled_core_is_built() -> None:
    assert align._native is not None, (
        "detectors/_align.c was not built: `pip install -e .` compiles it when a C "
        "compiler is there (without one, megatrace runs the slower Python code)"
    )


def _stream(seed: int, n: int = 6000) -> list[Collective]:
    """Collectives and transfers of a few communicators, with what a real stream holds:
    members out of order, records re-sent (late, or now with their end), members that
    never finish or never come, Sends naming no peer, and seqs going backwards."""
    rnd = random.Random(seed)
    comms = [(101, 2), (2**63 - 7, 4), (303, 8), (404, 3)]  # (hash, size)
    out: list[Collective] = []
    seq = dict.fromkeys((h for h, _ in comms), 0)
    while len(out) < n:
        comm, size = rnd.choice(comms)
        s = seq[comm] = seq[comm] + 1 if rnd.random() > 0.03 else max(0, seq[comm] - 3)
        t = 10**18 + s * 1000 + rnd.randrange(500)
        if rnd.random() < 0.3:  # a transfer
            src, dst = rnd.sample(range(size), 2)
            ends = [(src, CollOp.SEND, dst), (dst, CollOp.RECV, src)]
            members = [(r, op, peer if rnd.random() > 0.1 else None) for r, op, peer in ends]
        else:
            members = [(r, CollOp.ALL_REDUCE, None) for r in range(size)]
        rnd.shuffle(members)
        for rank, op, peer in members:
            if rnd.random() < 0.02:
                continue  # never comes
            a = t + rnd.randrange(300)
            end = None if rnd.random() < 0.05 else a + rnd.randrange(1, 400)
            rec = Collective(
                job="j", node=f"n{rank}", rank=rank, comm_hash=comm, comm_size=size,
                rank_in_comm=rank, op=op, seq=s, count=4, size_bytes=8 << rnd.randrange(10),
                dtype=DType.FLOAT32, enqueue_ns=a - 5, start_ns=a if rnd.random() > 0.2 else None,
                end_ns=end, peer=peer,
            )  # fmt: skip
            out.append(rec)
            if rnd.random() < 0.05:  # sent again, maybe with its end this time
                again = end if end is not None else a + 50
                out.insert(rnd.randrange(len(out)), _with_end(rec, again))
    return out


def _with_end(rec: Collective, end: int) -> Collective:
    import msgspec

    return msgspec.structs.replace(rec, end_ns=end)


def _state(al: CollectiveAligner) -> tuple[object, ...]:
    opened = [
        (k, e.first_seen_ns, e.members, e.op, e.comm_size, e.size_bytes, e.job, e.reported,
         e.finished)
        for k, e in al._open.items()
    ]  # fmt: skip
    return (opened, list(al._done), al._last_seq, al._recent, al.late, al.out_of_order,
            al.dropped)  # fmt: skip


def _run(monkeypatch: pytest.MonkeyPatch, native: object, records: list, cuts: list[int],
         aligner: CollectiveAligner) -> list[object]:  # fmt: skip
    monkeypatch.setattr(align, "_native", native)
    out: list[object] = []
    for lo, hi in pairwise(cuts):
        out.append(aligner.update_many(records[lo:hi]))
        out.append(aligner.expire(records[hi - 1].enqueue_ns))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_open", [8, 4096])
def test_both_cores_align_a_stream_the_same(
    monkeypatch: pytest.MonkeyPatch, seed: int, max_open: int
) -> None:
    native = align._native
    if native is None:
        pytest.skip("the compiled core was not built (see test_the_compiled_core_is_built)")
    records = _stream(seed)
    rnd = random.Random(seed)
    cuts = sorted({0, len(records), *(rnd.randrange(len(records)) for _ in range(60))})
    py, c = (CollectiveAligner(min_timeout_ns=2000, max_open=max_open) for _ in range(2))
    want = _run(monkeypatch, None, records, cuts, py)
    got = _run(monkeypatch, native, records, cuts, c)
    assert got == want
    assert sum(map(len, want)) > 500  # the stream completes and reports plenty
    assert _state(c) == _state(py)
    assert py.late and py.out_of_order and (py.dropped or max_open > 8)
    # a snapshot taken under one core resumes under the other, and one of a version
    # that kept the open instances in an OrderedDict under either
    rest = _stream(seed + 100, 1000)
    half, old = pickle.loads(pickle.dumps(c)), pickle.loads(pickle.dumps(c))
    old._open = OrderedDict(old._open)
    monkeypatch.setattr(align, "_native", None)
    want = py.update_many(rest)
    assert half.update_many(rest) == want
    monkeypatch.setattr(align, "_native", native)
    assert old.update_many(rest) == want
    assert _state(old) == _state(py) == _state(half)


def test_both_cores_read_any_record_with_the_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only Collective structs: any object with the fields (a test double, a subclass)."""
    if align._native is None:
        pytest.skip("the compiled core was not built")

    def rec(rank: int) -> SimpleNamespace:
        return SimpleNamespace(
            op=CollOp.ALL_REDUCE, peer=None, rank=rank, comm_size=2, seq=0, comm_hash=9,
            start_ns=None, enqueue_ns=100 + rank, end_ns=500, job="j", size_bytes=2,
        )  # fmt: skip

    for native in (None, align._native):
        monkeypatch.setattr(align, "_native", native)
        (inst,) = CollectiveAligner().update_many([rec(0), rec(1)])
        assert (inst.ranks, inst.arrival, inst.last_rank) == ((0, 1), (100, 101), 1)


def test_a_bad_record_fails_alike_and_keeps_what_came_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if align._native is None:
        pytest.skip("the compiled core was not built")
    good = _stream(0, 50)
    bad = SimpleNamespace(op=CollOp.ALL_REDUCE)  # no other field
    states = []
    for native in (None, align._native):
        monkeypatch.setattr(align, "_native", native)
        al = CollectiveAligner()
        with pytest.raises(AttributeError):
            al.update_many([*good, good[0], bad])
        states.append(_state(al))
    assert states[0] == states[1]
    before = CollectiveAligner()
    before.update_many([*good, good[0]])
    assert states[0] == _state(before)  # all before the bad record was taken, and counted
