"""The GPU check's check 3 (see :mod:`producers.gpu_check`): the PyTorch collector with
kernels on a one-rank NCCL group (:func:`collector_child`, judged by
:func:`collector_verdicts`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producers.gpu_check import Check
from schemas.codec import encode
from schemas.enums import CollOp
from schemas.records import Collective, Kernel

# --------------------------------------------------------------------------- check 3: collector


def collector_child(out: Path) -> list[Check]:
    """Check 3 (run in its own process)."""
    import torch
    import torch.distributed as dist

    from producers import torch_collector

    torch.cuda.set_device(0)
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    small = torch.ones(1024, device="cuda")
    bare_us = _call_us(lambda: dist.all_reduce(small))
    got: list[Any] = []
    torch_collector.enable("gpu-check", sink=got.extend, tp=1, pp=1, kernels=True)
    traced_us = _call_us(lambda: dist.all_reduce(small))
    torch.cuda.synchronize()
    time.sleep(0.3)
    got.clear()  # the timing calls' records
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        b = a @ a
        dist.all_reduce(b)
    torch.cuda.synchronize()
    # the GPU busy for a while: the call is enqueued at once, reached and finished later
    torch.cuda._sleep(int(1.2e9))  # about 0.6 s of GPU clock cycles
    t_call = time.time_ns()
    dist.all_reduce(b)
    t_back = time.time_ns()
    time.sleep(0.35)  # meanwhile the collector reports the call unfinished
    torch.cuda.synchronize()
    t_sync = time.time_ns()
    time.sleep(0.3)
    torch_collector.disable()
    dist.destroy_process_group()
    (out / "collector.jsonl").write_bytes(b"".join(encode(x) + b"\n" for x in got))
    cost = traced_us - bare_us
    return [
        *collector_verdicts(got, t_call=t_call, t_back=t_back, t_sync=t_sync),
        Check(
            "collector cost per NCCL call",
            cost < 50,
            f"{bare_us:.1f} µs per all_reduce call without the collector, {traced_us:.1f} µs "
            f"with it (+{cost:.1f} µs: two CUDA events and a CUPTI correlation marker)",
        ),
    ]


def _call_us(call: Callable[[], Any], n: int = 2000) -> float:
    """Host microseconds per call (median of five rounds, after a warm-up round)."""
    import torch

    rounds = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            call()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(rounds[1:])


def collector_verdicts(got: list[Any], *, t_call: int, t_back: int, t_sync: int) -> list[Check]:
    """What check 3 must show (pure): four AllReduce calls, the last behind a busy GPU."""
    calls = [x for x in got if isinstance(x, Collective) and x.op == CollOp.ALL_REDUCE]
    top = max((x.seq for x in calls), default=3)
    calls = [x for x in calls if x.seq > top - 4]  # the last four calls
    done = {x.seq: x for x in calls if x.end_ns is not None}
    kernels = [x for x in got if isinstance(x, Kernel)]
    last = done.get(top)
    early = [x for x in calls if x.seq == top and x.end_ns is None]
    checks = [
        Check(
            "collector with kernels",
            sorted(done) == list(range(top - 3, top + 1)) and len(kernels) >= 3,
            f"the last 4 AllReduce calls finished: {len(done) == 4}; {len(kernels)} kernel "
            "records in the same stream",
        )
    ]
    if last is None or last.start_ns is None or last.end_ns is None:
        return [
            *checks,
            Check("collector device times", False, "the last call has no device times"),
        ]
    reached = (last.start_ns - last.enqueue_ns) / 1e6
    checks.append(
        Check(
            "collector device times",
            bool(early)
            and reached > 200
            and last.start_ns <= last.end_ns <= t_sync + 1_000_000
            and t_sync - last.end_ns < 50_000_000,
            f"the host was back in {(t_back - t_call) / 1e6:.2f} ms; the GPU reached the call "
            f"{reached:.0f} ms after it was enqueued and finished it "
            f"{(t_sync - last.end_ns) / 1e6:.2f} ms before the host saw the stream drained; "
            f"reported unfinished meanwhile: {bool(early)}",
        )
    )
    return checks
