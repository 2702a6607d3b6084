"""The Kineto/CUPTI reader on a real PyTorch profiler trace (../shared/fixtures)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from producers.kineto import TraceError, read_kineto
from schemas.codec import decode, encode
from schemas.enums import CollOp, KernelKind
from schemas.records import CommInfo, Kernel

FIXTURE = (
    Path(__file__).resolve().parents[2] / "shared/fixtures/kineto/rank0_allreduce_nccl2.17.json.gz"
)
if not FIXTURE.exists():  # a checkout with shared/ inside it
    FIXTURE = (
        Path(__file__).resolve().parents[1]
        / "shared/fixtures/kineto/rank0_allreduce_nccl2.17.json.gz"
    )

pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason="shared fixtures not present")


def test_real_trace_gives_kernels_with_nccl_metadata() -> None:
    recs = list(read_kineto(FIXTURE, job="hta", node="host-a"))
    kernels = [r for r in recs if isinstance(r, Kernel)]
    kinds = Counter(k.kind for k in kernels)
    assert kinds[KernelKind.NCCL] == 21
    assert kinds[KernelKind.COMPUTE] == 2700 - 21
    assert kinds[KernelKind.MEMCPY] == 960 and kinds[KernelKind.MEMSET] == 114
    nccl = [k for k in kernels if k.kind == KernelKind.NCCL]
    # DDP broadcasts parameters at start, then all-reduces gradients
    assert Counter(k.coll_op for k in nccl) == {CollOp.ALL_REDUCE: 15, CollOp.BROADCAST: 6}
    assert all(k.group_size == 2 and k.rank == 0 and k.pg_name == "0" for k in nccl)
    assert nccl[0].count == 6637568
    (pg,) = [r for r in recs if isinstance(r, CommInfo)]
    assert pg.ranks == [0, 1] and {k.comm_hash for k in nccl} == {pg.comm_hash}
    # real unix-epoch nanoseconds, end after start, and every record is a valid wire record
    assert all(1.7e18 < k.start_ns <= k.end_ns < 1.8e18 for k in kernels)
    assert all(decode(encode(r)) == r for r in recs[:: max(1, len(recs) // 500)])


def test_not_a_trace_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="not a Kineto trace"):
        list(read_kineto(bad, job="j", node="n"))


def test_a_trace_analysed_alone_is_nothing_judged_not_a_healthy_job(tmp_path: Path) -> None:
    """A profiler trace gives kernels, and kernels are stored, not judged: analysing them
    alone says nothing was judged; it does not call the job healthy. A healthy job's
    calls still read as one."""
    from click.testing import CliRunner

    from megatrace.cli import cli
    from producers.sim.scenarios import build
    from schemas.codec import write_jsonl

    write_jsonl(tmp_path / "kernels.jsonl", read_kineto(FIXTURE, job="hta", node="host-a"))
    res = CliRunner().invoke(cli, ["analyze", str(tmp_path / "kernels.jsonl")])
    assert res.exit_code == 0, res.output
    assert "nothing judged: the records hold no collective call" in res.output
    assert "healthy" not in res.output

    run = build("healthy", scale="tiny", seed=0, steps=20)
    write_jsonl(tmp_path / "calls.jsonl", run.records(emit_kernels=True))
    res = CliRunner().invoke(cli, ["analyze", str(tmp_path / "calls.jsonl")])
    assert res.exit_code == 0, res.output
    assert "no incidents: the job looks healthy" in res.output
