"""The megatrace NCCL profiler plugin: build it, and drive it as NCCL would.

``megatrace build-plugin`` compiles ``megatrace_profiler.c`` with the system C
compiler into ``libmegatrace_nccl_profiler.so`` (no NCCL headers, no GPU).
Point NCCL at it with ``NCCL_PROFILER_PLUGIN=/path/libmegatrace_nccl_profiler.so``
and run the node agent; the plugin sends its records to the agent's socket
(``MEGATRACE_AGENT__SOCKET``).

:class:`Plugin` loads the library with ctypes and calls the same entry points
NCCL calls (profiler API v5, or v4), with our own declarations of NCCL's
structures: the tests and ``megatrace bench plugin`` use it, on this machine.
"""

from __future__ import annotations

import ctypes as C
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("megatrace_profiler.c")
LIBRARY = "libmegatrace_nccl_profiler.so"

# event types and states, as NCCL numbers them
COLL, P2P, PROXY_OP, PROXY_STEP, KERNEL_CH = 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 6
SEND_GPU_WAIT, SEND_WAIT, RECV_WAIT, RECV_FLUSH_WAIT, RECV_GPU_WAIT = 8, 9, 10, 11, 12
SEND_PEER_WAIT = 20


#: The plugin's health counters, in the order ``megatrace_profiler_counts`` returns them.
COUNTS = (
    "coll_started",
    "p2p_started",
    "proxy_ops_started",
    "proxy_steps_started",
    "kernel_ch_started",
    "kernel_ch_stopped",
    "orphans",
    "calls_finished",
    "calls_reported_stuck",
    "self_transfers_skipped",
)


def counts(lib: C.CDLL) -> dict[str, int]:
    """What NCCL did, as the loaded plugin counted it (events by type, calls finished)."""
    out = (C.c_uint64 * 16)()
    n = lib.megatrace_profiler_counts(out)
    return dict(zip(COUNTS[:n], out[:n], strict=True))


class PluginBuildError(RuntimeError):
    """The plugin could not be compiled (no C compiler, or it failed)."""


def build(out_dir: Path, compiler: str | None = None) -> Path:
    """Compile the plugin into ``out_dir``; return the library's path."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise PluginBuildError("no C compiler found (install gcc, or set CC)")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIBRARY
    cmd = [cc, "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-shared", "-fPIC"]
    cmd += ["-o", str(lib), str(SOURCE), "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise PluginBuildError(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return lib


# --------------------------------------------------------------------------- NCCL's structures


class _Coll(C.Structure):
    _fields_ = (
        ("seqNumber", C.c_uint64),
        ("func", C.c_char_p),
        ("sendBuff", C.c_void_p),
        ("recvBuff", C.c_void_p),
        ("count", C.c_size_t),
        ("root", C.c_int),
        ("datatype", C.c_char_p),
        ("nChannels", C.c_uint8),
        ("nWarps", C.c_uint8),
        ("algo", C.c_char_p),
        ("proto", C.c_char_p),
        ("parentGroup", C.c_void_p),
    )


class _P2p(C.Structure):
    _fields_ = (
        ("func", C.c_char_p),
        ("buff", C.c_void_p),
        ("datatype", C.c_char_p),
        ("count", C.c_size_t),
        ("peer", C.c_int),
        ("nChannels", C.c_uint8),
        ("parentGroup", C.c_void_p),
    )


class _ProxyOp(C.Structure):
    _fields_ = (
        ("pid", C.c_int),
        ("channelId", C.c_uint8),
        ("peer", C.c_int),
        ("nSteps", C.c_int),
        ("chunkSize", C.c_int),
        ("isSend", C.c_int),
    )


class _Union(C.Union):
    _fields_ = (("coll", _Coll), ("p2p", _P2p), ("proxyOp", _ProxyOp), ("step", C.c_int))


class _DescrV5(C.Structure):
    _fields_ = (("type", C.c_uint64), ("parentObj", C.c_void_p), ("rank", C.c_int), ("u", _Union))


class _DescrV4(C.Structure):
    _fields_ = (("type", C.c_uint8), ("parentObj", C.c_void_p), ("rank", C.c_int), ("u", _Union))


class _StateArgs(C.Union):
    _fields_ = (("transSize", C.c_size_t), ("pTimer", C.c_uint64))


_init_v5 = C.CFUNCTYPE(
    C.c_int, C.POINTER(C.c_void_p), C.c_uint64, C.POINTER(C.c_int), C.c_char_p,
    C.c_int, C.c_int, C.c_int, C.c_void_p,
)  # fmt: skip
_init_v4 = C.CFUNCTYPE(
    C.c_int, C.POINTER(C.c_void_p), C.POINTER(C.c_int), C.c_char_p, C.c_uint64,
    C.c_int, C.c_int, C.c_int, C.c_void_p,
)  # fmt: skip
_stop = C.CFUNCTYPE(C.c_int, C.c_void_p)
_record = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.POINTER(_StateArgs))
_finalize = C.CFUNCTYPE(C.c_int, C.c_void_p)


def _table(version: int) -> type[C.Structure]:
    descr = _DescrV5 if version == 5 else _DescrV4
    start = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_void_p), C.POINTER(descr))

    class Table(C.Structure):
        _fields_ = (
            ("name", C.c_char_p),
            ("init", _init_v5 if version == 5 else _init_v4),
            ("startEvent", start),
            ("stopEvent", _stop),
            ("recordEventState", _record),
            ("finalize", _finalize),
        )

    return Table


# --------------------------------------------------------------------------- the driver


@dataclass
class Comm:
    """One communicator context of one rank, as NCCL would create it."""

    plugin: Plugin
    context: C.c_void_p
    comm_hash: int
    rank: int
    nranks: int


class Plugin:
    """The plugin library, loaded and called through NCCL's entry points."""

    def __init__(self, library: Path, version: int = 5) -> None:
        if version not in (4, 5):
            raise ValueError(f"profiler API version {version} (valid: 4, 5)")
        self.lib = C.CDLL(str(library))
        self.version = version
        self.table = _table(version).in_dll(self.lib, f"ncclProfiler_v{version}")
        self._descr = _DescrV5 if version == 5 else _DescrV4
        self._keep: list[object] = []

    def init(self, comm_hash: int, nranks: int, rank: int, nnodes: int = 1) -> Comm:
        ctx, mask = C.c_void_p(), C.c_int(0)
        if self.version == 5:
            rc = self.table.init(
                C.byref(ctx), comm_hash, C.byref(mask), b"c", nnodes, nranks, rank, None
            )
        else:
            rc = self.table.init(
                C.byref(ctx), C.byref(mask), b"c", comm_hash, nnodes, nranks, rank, None
            )
        if rc != 0:
            raise RuntimeError(f"plugin init returned {rc}")
        self.mask = mask.value
        return Comm(self, ctx, comm_hash, rank, nranks)

    def start(
        self, comm: Comm, etype: int, parent: C.c_void_p | None = None, **fields
    ) -> C.c_void_p:
        d = self._descr(type=etype, parentObj=parent, rank=comm.rank)
        if etype == COLL:
            strings = {k: v.encode() if isinstance(v, str) else v for k, v in fields.items()}
            self._keep.append(strings)
            d.u.coll = _Coll(**strings)
        elif etype == P2P:
            strings = {k: v.encode() if isinstance(v, str) else v for k, v in fields.items()}
            self._keep.append(strings)
            d.u.p2p = _P2p(**strings)
        elif etype == PROXY_OP:
            d.u.proxyOp = _ProxyOp(**fields)
        elif etype == PROXY_STEP:
            d.u.step = fields.get("step", 0)
        handle = C.c_void_p()
        self.table.startEvent(comm.context, C.byref(handle), C.byref(d))
        return handle

    def state(self, handle: C.c_void_p, state: int, trans_size: int = 0) -> None:
        args = _StateArgs(transSize=trans_size)
        self.table.recordEventState(handle, state, C.byref(args))

    def stop(self, handle: C.c_void_p) -> None:
        self.table.stopEvent(handle)

    def finalize(self, comm: Comm) -> None:
        self.table.finalize(comm.context)

    def stats(self) -> tuple[int, int, int]:
        """(events seen, records sent, records dropped)."""
        out = (C.c_uint64 * 3)()
        self.lib.megatrace_profiler_stats(out)
        return out[0], out[1], out[2]

    def counts(self) -> dict[str, int]:
        """The health counters (see :data:`COUNTS`)."""
        return counts(self.lib)

    def flush(self) -> None:
        self.lib.megatrace_profiler_flush()

    # ------------------------------------------------------------------ a whole call
    def collective(
        self,
        comms: list[Comm],
        seq: int,
        *,
        count: int = 1 << 20,
        channels: int = 2,
        steps: int = 4,
        step_bytes: int = 1 << 18,
        send_wait_s: dict[tuple[int, int], float] | None = None,
        stuck: tuple[int, int] | None = None,
    ) -> None:
        """One ring AllReduce across ``comms`` (one per rank), as NCCL reports it:
        the call, then per channel a send proxy op to the next rank and a receive
        from the previous one, each of ``steps`` steps through their wait states,
        and kernel channels. ``send_wait_s[(src, dst)]`` stretches that edge's
        SendWait/RecvWait; ``stuck=(src, dst)`` leaves that edge's last step
        posted and never completed (and the call never finishes)."""
        send_wait_s = send_wait_s or {}
        n = len(comms)
        coll = {"seqNumber": seq, "func": "AllReduce", "count": count, "nChannels": channels}
        coll |= {"datatype": "ncclBfloat16", "algo": "RING", "proto": "SIMPLE"}
        calls = [self.start(c, COLL, **coll) for c in comms]
        for h in calls:
            self.stop(h)  # enqueued
        for ch in range(channels):
            for i, c in enumerate(comms):
                nxt, prv = comms[(i + 1) % n].rank, comms[(i - 1) % n].rank
                send = self.start(
                    c, PROXY_OP, calls[i], channelId=ch, peer=nxt, nSteps=steps, isSend=1
                )
                recv = self.start(
                    c, PROXY_OP, calls[i], channelId=ch, peer=prv, nSteps=steps, isSend=0
                )
                kch = self.start(c, KERNEL_CH, calls[i])
                wait = send_wait_s.get((c.rank, nxt), 0.0)
                recv_wait = send_wait_s.get((prv, c.rank), 0.0)
                send_hung, recv_hung = stuck == (c.rank, nxt), stuck == (prv, c.rank)
                for s in range(steps):
                    last = s == steps - 1
                    st = self.start(c, PROXY_STEP, send, step=s)
                    self.state(st, SEND_GPU_WAIT)
                    self.state(st, SEND_WAIT, trans_size=step_bytes)
                    if wait:
                        time.sleep(wait / steps)
                    if not (send_hung and last):  # else: posted, never completes
                        self.stop(st)
                    rt = self.start(c, PROXY_STEP, recv, step=s)
                    self.state(rt, RECV_WAIT, trans_size=step_bytes)
                    if recv_wait:
                        time.sleep(recv_wait / steps)
                    if not (recv_hung and last):
                        self.state(rt, RECV_GPU_WAIT)
                        self.stop(rt)
                if not send_hung:
                    self.stop(send)
                if not recv_hung:
                    self.stop(recv)
                if not (send_hung or recv_hung):
                    self.stop(kch)


__all__ = ["COUNTS", "LIBRARY", "SOURCE", "Comm", "Plugin", "PluginBuildError", "build", "counts"]
