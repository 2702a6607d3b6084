"""Smoke test of megatrace's GPU-side producers on one GPU node: ``megatrace gpu-check``.

Run it on a node before trusting its records. On the node's real driver,
CUDA and NCCL it checks, and prints as a table:

1. **Live CUPTI** (:mod:`producers.cupti`): a known workload (bf16 GEMMs,
   attention, copies, NCCL transfers) comes back as
   :class:`~schemas.records.Kernel` records on the host clock; GEMM durations
   agree with CUDA events; every NCCL kernel is marked by correlation (names
   are only used here, to check the marking).
2. **The NCCL profiler plugin under the real NCCL**: NCCL loads it (the
   newest interface both know), sends it the events of a one-rank
   communicator's send/receive to itself with the right fields, and the
   plugin reports nothing stuck and keeps sending liveness. On one GPU this is
   as far as the real NCCL goes: it runs one-rank collectives as plain copies
   without the profiler, and a transfer to itself without proxy operations,
   so the completion path (kernel-channel and proxy events) needs two GPUs;
   the plugin's own tests drive that path through NCCL's entry points.
3. **The PyTorch collector on a GPU**: ``torch_collector.enable(kernels=True)``
   on a one-rank NCCL process group gives collective and kernel records in one
   stream, and a call queued behind ~0.6 s of GPU work gets the GPU's times (it
   is reported unfinished until the GPU is done with it), not the host's.
4. **What live CUPTI costs**: the wall time of a transformer training step
   (8 layers of width 2,048, bf16) with and without it; at most 5% passes.

The checks live in :mod:`producers.gpu_check_cupti` (1 and 4),
:mod:`producers.gpu_check_nccl` (2) and :mod:`producers.gpu_check_collector` (3).
Each check runs in its own process (CUDA and CUPTI are process-wide) and
writes what it saw under ``--out``: the records, the raw CUPTI activity and
NCCL's log, so a failure can be read afterwards, and recorded activity can
become a test fixture. Needs PyTorch with CUDA, NCCL, a C compiler and
``cupti-python``; on a machine without a GPU it stops with that message.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class GpuCheckError(RuntimeError):
    """The node cannot run the check (no GPU, no NCCL, no compiler)."""


@dataclass
class Check:
    """One line of the report."""

    name: str
    ok: bool
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- driver


def _in_child(module: str, fn: str, out: Path) -> list[Check]:
    """Check ``fn`` of ``module`` run in a process of its own (CUDA and CUPTI are
    process-wide); what it said goes to ``out/fn.log``."""
    code = (
        "import json, dataclasses, pathlib, sys\n"
        f"from producers.{module} import {fn}\n"
        f"r = {fn}(pathlib.Path({str(out)!r}))\n"
        "print('@@' + json.dumps([dataclasses.asdict(c) for c in r]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    (out / f"{fn}.log").write_text(res.stdout + res.stderr)
    for line in res.stdout.splitlines():
        if line.startswith("@@"):
            return [Check(**c) for c in json.loads(line[2:])]
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return [Check(fn, False, "failed: " + " | ".join(tail))]


def run_checks(out: Path, *, progress: Callable[[str], None] = print) -> list[Check]:
    """All the checks; each one's records and logs under ``out``."""
    try:
        import torch
    except ImportError:
        raise GpuCheckError("PyTorch is needed: pip install 'megatrace[torch]'") from None
    if not torch.cuda.is_available():
        raise GpuCheckError("no CUDA GPU visible to PyTorch on this machine")
    from producers.gpu_check_nccl import SIZES, plugin_verdicts, run_plugin

    out.mkdir(parents=True, exist_ok=True)
    checks: list[Check] = []
    progress("1/4 live CUPTI")
    checks += _in_child("gpu_check_cupti", "cupti_child", out)
    progress("2/4 NCCL profiler plugin under the real NCCL")
    iters = 50
    got, log = run_plugin(out, iters=iters)
    checks += plugin_verdicts(got, iters * len(SIZES), log)
    progress("3/4 PyTorch collector with kernels")
    checks += _in_child("gpu_check_collector", "collector_child", out)
    progress("4/4 live CUPTI's cost on a training step")
    checks += _in_child("gpu_check_cupti", "overhead_child", out)
    (out / "summary.json").write_text(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    return checks


def report(checks: list[Check]) -> str:
    """The table people read."""
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in checks)


__all__ = ["Check", "GpuCheckError", "report", "run_checks"]
