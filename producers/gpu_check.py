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

Each check runs in its own process (CUDA and CUPTI are process-wide) and
writes what it saw under ``--out``: the records, the raw CUPTI activity and
NCCL's log, so a failure can be read afterwards, and recorded activity can
become a test fixture. Needs PyTorch with CUDA, NCCL, a C compiler and
``cupti-python``; on a machine without a GPU it stops with that message.
"""

from __future__ import annotations

import contextlib
import ctypes as C
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.codec import decode, encode
from schemas.enums import CollOp, KernelKind
from schemas.records import Collective, Heartbeat, Kernel

FLOAT32 = 7  # ncclFloat32


class GpuCheckError(RuntimeError):
    """The node cannot run the check (no GPU, no NCCL, no compiler)."""


@dataclass
class Check:
    """One line of the report."""

    name: str
    ok: bool
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- NCCL through ctypes


class _UniqueId(C.Structure):
    _fields_ = (("internal", C.c_char * 128),)


class Nccl:
    """The few NCCL calls the check needs, on the library PyTorch loaded."""

    def __init__(self) -> None:
        import torch  # loads libnccl

        if not torch.cuda.is_available():
            raise GpuCheckError("no CUDA GPU visible to PyTorch")
        self.lib = _load_nccl()
        for name in ("ncclSend", "ncclRecv"):
            getattr(self.lib, name).argtypes = [
                C.c_void_p,
                C.c_size_t,
                C.c_int,
                C.c_int,
                C.c_void_p,
                C.c_void_p,
            ]
        self.lib.ncclCommInitRank.argtypes = [C.POINTER(C.c_void_p), C.c_int, _UniqueId, C.c_int]
        self.lib.ncclCommDestroy.argtypes = [C.c_void_p]
        self.lib.ncclGetErrorString.restype = C.c_char_p

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise GpuCheckError(f"{what}: {self.lib.ncclGetErrorString(rc).decode()}")

    def version(self) -> str:
        v = C.c_int()
        self._ok(self.lib.ncclGetVersion(C.byref(v)), "ncclGetVersion")
        major, rest = divmod(v.value, 10000)
        return f"{major}.{rest // 100}.{rest % 100}"

    def one_rank_comm(self) -> C.c_void_p:
        uid = _UniqueId()
        self._ok(self.lib.ncclGetUniqueId(C.byref(uid)), "ncclGetUniqueId")
        comm = C.c_void_p()
        self._ok(self.lib.ncclCommInitRank(C.byref(comm), 1, uid, 0), "ncclCommInitRank")
        return comm

    def to_self(self, comm: C.c_void_p, send: Any, recv: Any, stream: int) -> None:
        """One grouped send and receive of a float32 tensor to this rank itself;
        ``send=None`` posts the receive alone (it never completes)."""
        self._ok(self.lib.ncclGroupStart(), "ncclGroupStart")
        if send is not None:
            self._ok(
                self.lib.ncclSend(send.data_ptr(), send.numel(), FLOAT32, 0, comm, stream),
                "ncclSend",
            )
        self._ok(
            self.lib.ncclRecv(recv.data_ptr(), recv.numel(), FLOAT32, 0, comm, stream), "ncclRecv"
        )
        self._ok(self.lib.ncclGroupEnd(), "ncclGroupEnd")

    def destroy(self, comm: C.c_void_p) -> None:
        self._ok(self.lib.ncclCommDestroy(comm), "ncclCommDestroy")


def _load_nccl() -> C.CDLL:
    with contextlib.suppress(OSError):
        return C.CDLL("libnccl.so.2")  # the one PyTorch already loaded
    with contextlib.suppress(ImportError, OSError, IndexError):
        import nvidia.nccl  # type: ignore[import-not-found]

        return C.CDLL(str(Path(next(iter(nvidia.nccl.__path__))) / "lib" / "libnccl.so.2"))
    raise GpuCheckError("libnccl.so.2 not found (PyTorch built with NCCL, or nvidia-nccl)")


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


# --------------------------------------------------------------------------- check 2: plugin


SIZES = (1 << 20, 256)  # float32 elements: 4 MB (many channels) and 1 KB (one)


def nccl_child(iters: int) -> None:
    """The process NCCL loads the plugin into: ``iters`` grouped sends and receives
    to itself per size in :data:`SIZES`; prints the plugin's health counters as
    ``@@counts {...}``."""
    import torch

    from producers.nccl_plugin import counts

    torch.cuda.set_device(0)
    nccl = Nccl()
    print("nccl", nccl.version(), flush=True)
    comm = nccl.one_rank_comm()
    plugin = C.CDLL(os.environ["NCCL_PROFILER_PLUGIN"])
    stream = torch.cuda.current_stream().cuda_stream
    same = True
    for n in SIZES:
        s = torch.randn(n, device="cuda")
        r = torch.empty_like(s)
        for _ in range(iters):
            nccl.to_self(comm, s, r, stream)
        torch.cuda.synchronize()
        same = same and bool(torch.equal(s, r))
    print("transfers done, data equal:", same, flush=True)
    time.sleep(0.5)  # two heartbeats, and the flusher's last batch
    print("@@counts " + json.dumps(counts(plugin)), flush=True)
    nccl.destroy(comm)


def plugin_counts(log: str) -> dict[str, int]:
    """The health counters a child printed (empty if it died first)."""
    for line in log.splitlines():
        if line.startswith("@@counts "):
            return dict(json.loads(line[len("@@counts ") :]))
    return {}


@contextlib.contextmanager
def _receiver(path: Path) -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(0.2)
    try:
        yield s
    finally:
        s.close()


def _drain(s: socket.socket, until: Callable[[], bool], seconds: float) -> list[Any]:
    data = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        with contextlib.suppress(TimeoutError):
            data += s.recv(1 << 16)
    with contextlib.suppress(TimeoutError):
        while True:
            data += s.recv(1 << 16)
    return [decode(line) for line in data.split(b"\n") if line.strip()]


def run_plugin(out: Path, *, iters: int = 50, wait_s: float = 60.0) -> tuple[list[Any], str]:
    """Start ``nccl_child`` with the plugin; what reached the socket, and the log."""
    from producers.nccl_plugin import build

    lib = out / "libmegatrace_nccl_profiler.so"
    if not lib.exists():
        build(out)
    sock = out / "agent.sock"
    sock.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        NCCL_PROFILER_PLUGIN=str(lib),
        NCCL_DEBUG="INFO",
        NCCL_DEBUG_SUBSYS="INIT,ENV",
        MEGATRACE_AGENT__SOCKET=str(sock),
        MEGATRACE_JOB="gpu-check",
        MEGATRACE_STUCK_MS="300",
        MEGATRACE_HEARTBEAT_MS="200",
        PYTHONUNBUFFERED="1",
    )
    code = f"from producers.gpu_check import nccl_child; nccl_child({iters})"
    with _receiver(sock) as s, open(out / "nccl.log", "w") as log:
        p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=log)
        got = _drain(s, lambda: p.poll() is not None, wait_s)
        if p.poll() is None:
            p.kill()
        p.wait()
    sock.unlink(missing_ok=True)
    (out / "plugin.jsonl").write_bytes(b"".join(encode(x) + b"\n" for x in got))
    return got, (out / "nccl.log").read_text()


def _log_value(log: str, marker: str) -> str:
    """What follows ``marker`` on the first log line holding it ("" if none)."""
    return next((ln.split(marker, 1)[1].strip() for ln in log.splitlines() if marker in ln), "")


def plugin_verdicts(got: list[Any], calls: int, log: str) -> list[Check]:
    """What check 2 must show (pure); ``calls`` grouped send/receive pairs to self."""
    colls = [x for x in got if isinstance(x, Collective)]
    beats = [x for x in got if isinstance(x, Heartbeat)]
    counts = plugin_counts(log)
    version = _log_value(log, "NCCL version").split(" ")[0] or "?"
    loaded = _log_value(log, "PROFILER/Plugin: ")
    seen = counts.get("p2p_started", 0)
    skipped = counts.get("self_transfers_skipped", 0)
    return [
        Check(
            "plugin loaded by NCCL",
            loaded.startswith("Loaded megatrace"),
            f"NCCL {version}: {loaded or 'not loaded'}",
        ),
        Check(
            "plugin events from NCCL",
            seen == 2 * calls and skipped == seen and "data equal: True" in log,
            f"{seen} P2p events for {calls} send/receive pairs to self, {skipped} counted as "
            "self-transfers (NCCL gives them no end)",
            counts,
        ),
        Check(
            "plugin reports nothing stuck",
            not colls and counts.get("calls_reported_stuck", 1) == 0,
            f"{len(colls)} call records, {counts.get('calls_reported_stuck')} reported stuck",
        ),
        Check("plugin liveness", bool(beats), f"{len(beats)} heartbeats"),
    ]


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


# --------------------------------------------------------------------------- driver


def _in_child(fn: str, out: Path) -> list[Check]:
    code = (
        "import json, dataclasses, pathlib, sys\n"
        f"from producers.gpu_check import {fn}\n"
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
    out.mkdir(parents=True, exist_ok=True)
    checks: list[Check] = []
    progress("1/4 live CUPTI")
    checks += _in_child("cupti_child", out)
    progress("2/4 NCCL profiler plugin under the real NCCL")
    iters = 50
    got, log = run_plugin(out, iters=iters)
    checks += plugin_verdicts(got, iters * len(SIZES), log)
    progress("3/4 PyTorch collector with kernels")
    checks += _in_child("collector_child", out)
    progress("4/4 live CUPTI's cost on a training step")
    checks += _in_child("overhead_child", out)
    (out / "summary.json").write_text(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    return checks


def report(checks: list[Check]) -> str:
    """The table people read."""
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in checks)


__all__ = [
    "Check",
    "GpuCheckError",
    "Nccl",
    "cupti_verdicts",
    "plugin_verdicts",
    "report",
    "run_checks",
]
