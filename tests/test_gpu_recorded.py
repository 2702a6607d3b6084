"""What a real GPU node gave, replayed here through the same code paths.

The files in ``tests/data/h200_*`` were recorded by ``megatrace gpu-check`` on one
NVIDIA H200 (driver 580, CUDA 13.0, PyTorch 2.11, NCCL 2.28.9, cupti-python 13.0):
the raw CUPTI activity of a workload with five NCCL send/receive launches, and
the NCCL log plus the socket output of the profiler plugin loaded by that NCCL.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.cupti import Activity, map_activities
from producers.gpu_check_collector import collector_verdicts
from producers.gpu_check_cupti import cupti_verdicts
from producers.gpu_check_nccl import plugin_verdicts
from schemas.codec import decode
from schemas.enums import CollOp, DType, KernelKind
from schemas.records import Collective, Kernel

DATA = Path(__file__).with_name("data")


def recorded_activity() -> list[Activity]:
    return [Activity(**a) for a in json.loads((DATA / "h200_cupti_activity.json").read_text())]


def recorded_kernels() -> list[Kernel]:
    """The recorded activity as the collector maps it (on a host clock 10**18 ns on)."""
    return map_activities(
        recorded_activity(), job="j", node="gpu-node-0", rank=0, clock_offset_ns=10**18
    )


def test_real_cupti_activity_marks_exactly_the_nccl_kernels() -> None:
    kernels = recorded_kernels()
    nccl = [k for k in kernels if k.kind == KernelKind.NCCL]
    # marked by correlation; the names only confirm it here
    assert len(nccl) == 5 and all("ncclDevKernel" in k.name for k in nccl)
    assert not [k for k in kernels if k.kind != KernelKind.NCCL and "nccl" in k.name.lower()]
    gemms = [k for k in kernels if k.name.startswith("nvjet")]  # cuBLAS's GEMMs on Hopper
    assert len(gemms) >= 10 and all(k.kind == KernelKind.COMPUTE for k in gemms)
    assert all(k.start_ns > 10**18 and k.end_ns >= k.start_ns for k in kernels)


def _cupti_failing(records: list[Kernel], **change: object) -> list[str]:
    """The CUPTI checks that fail on ``records``, for the recorded run's workload: it ran
    from 1 ms before its first kernel to 1 ms after its last, launched five grouped NCCL
    calls, copied 256 MB to the GPU and ran 8192x8192 GEMMs. Their times by CUDA events
    were not recorded: CUPTI's own are given, so the GEMM check is not judged here."""
    kernels = recorded_kernels()
    longest = sorted(k.end_ns - k.start_ns for k in kernels if k.kind == KernelKind.COMPUTE)
    args: dict = dict(
        t0=min(k.start_ns for k in kernels) - 1_000_000,
        t1=max(k.end_ns for k in kernels) + 1_000_000,
        gemm_ms=[d / 1e6 for d in longest[-10:]], copy_ms=5.0, copy_bytes=256 << 20,
        nccl_launches=5, copied=True,
    )  # fmt: skip
    args.update(change)
    return [c.name for c in cupti_verdicts(records, **args) if not c.ok]


def test_the_recorded_cupti_run_passes_the_check_and_fails_where_its_records_would_be_wrong(
) -> None:  # fmt: skip
    """The check on the H200's activity as recorded passes; it fails when the records are
    off the host clock, an NCCL kernel goes unmarked, fewer kernels are marked than
    launched, the data did not arrive, or the copy is missing."""
    kernels = recorded_kernels()
    assert _cupti_failing(kernels) == []
    late = [msgspec.structs.replace(k, start_ns=k.start_ns + 10**9, end_ns=k.end_ns + 10**9)
            for k in kernels]  # fmt: skip
    assert _cupti_failing(late) == ["cupti host clock"]
    first = next(i for i, k in enumerate(kernels) if k.kind == KernelKind.NCCL)
    unmarked = [*kernels]
    unmarked[first] = msgspec.structs.replace(kernels[first], kind=KernelKind.COMPUTE)
    assert "cupti nccl marking" in _cupti_failing(unmarked)
    assert _cupti_failing(kernels, nccl_launches=6) == ["cupti nccl marking"]
    assert _cupti_failing(kernels, copied=False) == ["cupti nccl marking"]
    assert _cupti_failing([k for k in kernels if k.kind != KernelKind.MEMCPY]) == ["cupti copies"]


def test_without_the_api_records_no_kernel_would_be_marked() -> None:
    # what the first live run showed: external correlations come only with API records
    acts = [a for a in recorded_activity() if a.kind != "external_correlation"]
    kernels = map_activities(acts, job="j", node="n", rank=0, clock_offset_ns=0)
    assert not [k for k in kernels if k.kind == KernelKind.NCCL]


def recorded_plugin() -> tuple[list, str]:
    lines = (DATA / "h200_nccl_plugin.jsonl").read_bytes().splitlines()
    return [decode(x) for x in lines if x.strip()], (DATA / "h200_nccl_plugin.log").read_text()


def test_the_recorded_plugin_run_passes_the_check() -> None:
    got, log = recorded_plugin()
    checks = plugin_verdicts(got, 100, log)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert "Loaded megatrace (v5)" in checks[0].detail and "2.28.9" in checks[0].detail


@pytest.mark.parametrize(
    ("change", "failing"),
    [
        (lambda log: log.replace("Loaded megatrace", "Could not load"), "plugin loaded by NCCL"),
        (
            lambda log: log.replace('"calls_reported_stuck": 0', '"calls_reported_stuck": 200'),
            "plugin reports nothing stuck",
        ),
        (
            lambda log: log.replace("data equal: True", "data equal: False"),
            "plugin events from NCCL",
        ),
    ],
)
def test_the_plugin_check_fails_when_the_node_misbehaves(change, failing: str) -> None:
    got, log = recorded_plugin()
    bad = [c.name for c in plugin_verdicts(got, 100, change(log)) if not c.ok]
    assert bad == [failing]


def test_gpu_check_without_a_gpu_says_so(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["gpu-check", "--out", str(tmp_path)])
    assert res.exit_code == 1
    assert "GPU" in res.output or "PyTorch" in res.output


def _call(seq: int, enq: int, start: int | None, end: int | None) -> Collective:
    return Collective(
        job="j", node="n", rank=0, comm_hash=1, comm_size=1, rank_in_comm=0,
        op=CollOp.ALL_REDUCE, seq=seq, count=4, size_bytes=16, dtype=DType.FLOAT32,
        enqueue_ns=enq, start_ns=start, end_ns=end,
    )  # fmt: skip


def test_the_collector_check_wants_device_times_behind_a_busy_gpu() -> None:
    ms = 1_000_000
    kernels = [
        Kernel(job="j", node="n", rank=0, device=0, stream=7, name="nvjet", correlation_id=i,
               start_ns=i, end_ns=i + 1, kind=KernelKind.COMPUTE)
        for i in range(3)
    ]  # fmt: skip
    calls = [_call(12000 + i, i * ms, i * ms + 10, i * ms + 20) for i in range(3)]
    early = _call(12003, 10 * ms, None, None)  # reported while the GPU was busy
    late = _call(12003, 10 * ms, 610 * ms, 611 * ms)
    ok = collector_verdicts(
        [*calls, early, late, *kernels], t_call=10 * ms, t_back=10 * ms + 300_000, t_sync=612 * ms
    )
    assert [c.ok for c in ok] == [True, True], ok
    # host times (the call "finished" as soon as it returned) fail the check
    host = _call(12003, 10 * ms, None, 10 * ms + 300_000)
    bad = collector_verdicts(
        [*calls, host, *kernels], t_call=10 * ms, t_back=10 * ms, t_sync=612 * ms
    )
    assert [c.name for c in bad if not c.ok] == ["collector device times"]
