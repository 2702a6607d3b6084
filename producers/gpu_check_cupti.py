"""The GPU check's CUPTI checks (see :mod:`producers.gpu_check`): check 1, live CUPTI
on a known workload (:func:`cupti_child`, judged by :func:`cupti_verdicts`), and check 4,
what live CUPTI costs a training step (:func:`overhead_child`).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producers.gpu_check import Check
from producers.gpu_check_nccl import Nccl
from schemas.codec import decode, encode
from schemas.enums import KernelKind
from schemas.records import Kernel

# --------------------------------------------------------------------------- check 1: CUPTI


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    """Milliseconds per call of ``fn`` by CUDA events."""
    import torch

    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def cupti_child(out: Path) -> list[Check]:
    """Check 1 (run in its own process)."""
    import torch
    import torch.nn.functional as F

    from producers.cupti import Activity, CuptiCollector

    torch.cuda.set_device(0)
    nccl = Nccl()
    comm = nccl.one_rank_comm()
    stream = torch.cuda.current_stream().cuda_stream
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
    s, r = torch.randn(1 << 22, device="cuda"), torch.empty(1 << 22, device="cuda")
    host = torch.randn(64 << 20, pin_memory=True)  # 256 MB
    for _ in range(3):
        a @ b
    F.scaled_dot_product_attention(q, q, q)
    nccl.to_self(comm, s, r, stream)
    torch.cuda.synchronize()

    records: list[Kernel] = []
    raw: list[Activity] = []
    col = CuptiCollector(
        job="gpu-check",
        node=socket.gethostname(),
        rank=0,
        sink=records.extend,
        on_activity=raw.extend,
    )
    t0 = time.time_ns()
    col.start()
    gemm_ms = _timed(lambda: a @ b, 10)
    for _ in range(5):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    copy_ms = _timed(lambda: host.to("cuda", non_blocking=True), 1)[0]
    torch.zeros(1 << 26, device="cuda")
    nccl_launches = 5
    for _ in range(nccl_launches):
        with col.nccl_call():
            nccl.to_self(comm, s, r, stream)
    torch.cuda.synchronize()
    t1 = time.time_ns()
    col.stop()
    ok_copy = torch.equal(s, r)
    nccl.destroy(comm)

    (out / "cupti_records.jsonl").write_bytes(b"".join(encode(k) + b"\n" for k in records))
    sample = [dataclasses.asdict(x) for x in raw if x.kind != "kernel" or "add" not in x.name]
    (out / "cupti_activity.json").write_text(json.dumps(sample[:400]))
    return cupti_verdicts(
        records,
        t0,
        t1,
        gemm_ms=gemm_ms,
        copy_ms=copy_ms,
        copy_bytes=host.numel() * 4,
        nccl_launches=nccl_launches,
        copied=ok_copy,
    )


def cupti_verdicts(
    records: list[Kernel],
    t0: int,
    t1: int,
    *,
    gemm_ms: list[float],
    copy_ms: float,
    copy_bytes: int,
    nccl_launches: int,
    copied: bool,
) -> list[Check]:
    """What the records of check 1 must show (pure: tested on recorded activity)."""
    checks = []
    by_kind: dict[KernelKind, list[Kernel]] = {}
    for k in records:
        by_kind.setdefault(k.kind, []).append(k)
    counts = {str(kind): len(v) for kind, v in by_kind.items()}
    roundtrip = all(decode(encode(k)) == k for k in records)
    checks.append(
        Check(
            "cupti records",
            bool(records) and roundtrip,
            f"{len(records)} kernel records, schema round trip {roundtrip}",
            counts,
        )
    )
    slack = 5_000_000
    lo = min((k.start_ns for k in records), default=0)
    hi = max((k.end_ns for k in records), default=0)
    inside = t0 - slack <= lo and hi <= t1 + slack
    checks.append(
        Check(
            "cupti host clock",
            inside,
            f"records span {(hi - lo) / 1e6:.1f} ms inside the "
            f"{(t1 - t0) / 1e6:.1f} ms the workload ran (5 ms slack)",
            {"first_after_start_ms": (lo - t0) / 1e6, "last_before_end_ms": (t1 - hi) / 1e6},
        )
    )
    compute = sorted(by_kind.get(KernelKind.COMPUTE, []), key=lambda k: k.end_ns - k.start_ns)
    longest = [(k.end_ns - k.start_ns) / 1e6 for k in compute[-len(gemm_ms) :]]
    ratio = statistics.median(longest) / statistics.median(gemm_ms) if longest else 0.0
    checks.append(
        Check(
            "cupti gemm duration",
            0.8 <= ratio <= 1.05,
            f"median GEMM {statistics.median(longest) if longest else 0:.3f} ms by CUPTI, "
            f"{statistics.median(gemm_ms):.3f} ms by CUDA events (ratio {ratio:.2f})",
            {
                "gemm_cupti_ms": longest,
                "gemm_events_ms": gemm_ms,
                "tflops": 2 * 8192**3 / (statistics.median(gemm_ms) / 1e3) / 1e12,
            },
        )
    )
    marked = by_kind.get(KernelKind.NCCL, [])
    unmarked = [k.name for k in compute if "nccl" in k.name.lower()]
    wrong = [k.name for k in marked if "nccl" not in k.name.lower()]
    checks.append(
        Check(
            "cupti nccl marking",
            len(marked) >= nccl_launches and not unmarked and not wrong and copied,
            f"{len(marked)} NCCL kernels marked for {nccl_launches} grouped calls; "
            f"{len(unmarked)} NCCL-named kernels unmarked, {len(wrong)} marked wrongly; "
            f"data arrived {copied}",
            {"names": sorted({k.name for k in marked})[:5]},
        )
    )
    copies = by_kind.get(KernelKind.MEMCPY, [])
    big = max(copies, key=lambda k: k.end_ns - k.start_ns, default=None)
    gbps = copy_bytes / (big.end_ns - big.start_ns) if big else 0.0
    checks.append(
        Check(
            "cupti copies",
            big is not None and 1.0 < gbps < 100.0,
            f"{len(copies)} copies; the 256 MB host-to-device copy at {gbps:.1f} GB/s "
            f"by CUPTI ({copy_bytes / (copy_ms * 1e6):.1f} GB/s by CUDA events)",
        )
    )
    return checks


# --------------------------------------------------------------------------- check 4: overhead


def _train_steps(model: Any, opt: Any, x: Any, n: int) -> list[float]:
    """Milliseconds of wall clock per training step (forward, backward, update)."""
    import torch

    times = []
    for _ in range(n):
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def overhead_child(out: Path, max_overhead: float = 0.05) -> list[Check]:
    """Check 4 (own process): a transformer training step with and without live CUPTI."""
    import torch

    from producers.cupti import CuptiCollector

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 8).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(8, 1024, 2048, device="cuda")
    _train_steps(model, opt, x, 5)
    before = _train_steps(model, opt, x, 20)
    records: list[Kernel] = []
    col = CuptiCollector(job="gpu-check", node=socket.gethostname(), rank=0, sink=records.extend)
    col.start()
    traced = _train_steps(model, opt, x, 20)
    col.stop()
    after = _train_steps(model, opt, x, 20)
    bare = statistics.median(before + after)
    with_cupti = statistics.median(traced)
    cost = with_cupti / bare - 1
    return [
        Check(
            "cupti overhead on a training step",
            cost <= max_overhead,
            f"{bare:.1f} ms per step without, {with_cupti:.1f} ms with live CUPTI "
            f"({cost:+.1%}; bar {max_overhead:.0%}); {len(records) / 20:.0f} kernel records a step",
            {"bare_ms": before + after, "traced_ms": traced},
        )
    ]
