"""The GPU check's NCCL pieces: NCCL's own library through ctypes (:class:`Nccl`: a
one-rank communicator's transfers to itself) and check 2, the profiler plugin under the
real NCCL (:func:`run_plugin` runs NCCL with the plugin loaded, :func:`plugin_verdicts`
judges what the plugin sent and what NCCL's log says it loaded); see
:mod:`producers.gpu_check`.
"""

from __future__ import annotations

import contextlib
import ctypes as C
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from producers.gpu_check import Check, GpuCheckError
from schemas.codec import decode, encode
from schemas.records import Collective, Heartbeat

FLOAT32 = 7  # ncclFloat32

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
    code = f"from producers.gpu_check_nccl import nccl_child; nccl_child({iters})"
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
