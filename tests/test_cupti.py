"""CUPTI activity to kernel records, through the live collector's own code path,
on recorded activity (no GPU here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from producers.cupti import (
    NCCL_EXTERNAL_KIND,
    CuptiCollector,
    CuptiUnavailable,
    activity_record,
)
from schemas.enums import KernelKind
from schemas.records import Kernel

KINDS = {10: "kernel", 1: "memcpy", 2: "memset", 29: "external_correlation"}  # CUPTI's numbers


def kernel(cid: int, start: int, end: int, name: str = "sm90_xmma_gemm_bf16") -> SimpleNamespace:
    return SimpleNamespace(
        kind=10, correlation_id=cid, start=start, end=end, name=name, device_id=3, stream_id=7
    )


def external(cid: int, ext_kind: int = NCCL_EXTERNAL_KIND) -> SimpleNamespace:
    return SimpleNamespace(kind=29, correlation_id=cid, external_kind=ext_kind, external_id=99)


def collector(sink: list) -> CuptiCollector:
    col = CuptiCollector(job="j", node="gpu-node-1", rank=11, sink=sink.extend)
    col._kind_names = KINDS  # what start() reads from cupti.ActivityKind
    col._offset = 1_000_000_000  # CUPTI clock -> host clock
    return col


def test_buffers_become_kernels_on_the_host_clock_with_nccl_marked() -> None:
    got: list[Kernel] = []
    col = collector(got)
    # buffer 1: a GEMM, a NCCL launch marked by its external correlation, a memcpy,
    # and an activity kind we do not collect
    col._buffer_completed(
        [
            kernel(1, 100, 400),
            external(2),
            kernel(2, 500, 900, name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
            SimpleNamespace(kind=1, correlation_id=3, start=950, end=990, device_id=3, stream_id=7),
            SimpleNamespace(kind=42, correlation_id=4),
        ]
    )
    # buffer 2: the kernel of a launch whose marker came in the previous buffer
    col._buffer_completed([external(5), kernel(6, 1000, 1200)])
    col._buffer_completed([kernel(5, 1300, 1400, name="renamed_by_a_newer_nccl")])
    kinds = [(k.correlation_id, k.kind) for k in got]
    assert kinds == [
        (1, KernelKind.COMPUTE),
        (2, KernelKind.NCCL),
        (3, KernelKind.MEMCPY),
        (6, KernelKind.COMPUTE),
        (5, KernelKind.NCCL),
    ]
    first = got[0]
    assert (first.start_ns, first.end_ns) == (1_000_000_100, 1_000_000_400)
    assert (first.device, first.stream, first.rank, first.node) == (3, 7, 11, "gpu-node-1")


def test_other_external_correlations_do_not_mark_nccl() -> None:
    got: list[Kernel] = []
    collector(got)._buffer_completed([external(1, ext_kind=0), kernel(1, 0, 10)])
    assert got[0].kind == KernelKind.COMPUTE


def test_activity_objects_map_field_by_field() -> None:
    a = activity_record(kernel(9, 5, 6), KINDS)
    assert a is not None and (a.kind, a.correlation_id, a.start, a.end) == ("kernel", 9, 5, 6)
    assert activity_record(SimpleNamespace(kind=77), KINDS) is None


def test_without_cupti_python_the_error_says_what_to_install() -> None:
    try:
        import cupti  # noqa: F401
    except ImportError:
        with pytest.raises(CuptiUnavailable, match=r"pip install 'megatrace\[cupti\]'"):
            CuptiCollector(job="j", node="n", rank=0, sink=print).start()
    else:
        pytest.skip("cupti-python is installed here")
