"""The megatrace NCCL profiler plugin: build it, and drive it as NCCL would.

``megatrace build-plugin`` compiles ``megatrace_profiler.c`` with the system C
compiler into ``libmegatrace_nccl_profiler.so`` (no NCCL headers, no GPU).
Point NCCL at it with ``NCCL_PROFILER_PLUGIN=/path/libmegatrace_nccl_profiler.so``
and run the node agent; the plugin sends its records to the agent's socket
(``MEGATRACE_AGENT__SOCKET``).

:class:`Plugin` loads the library with ctypes and calls the same entry points
NCCL calls (profiler API v7, v6, v5 or v4), with our own declarations of NCCL's
structures (:mod:`producers.nccl_plugin.abi`): the tests and ``megatrace bench plugin``
use it, on this machine.
"""

from __future__ import annotations

import ctypes as C
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from producers.nccl_plugin.abi import (
    _CeColl,
    _Coll,
    _CollV7,
    _descr,
    _KernelPhase,
    _P2p,
    _P2pV7,
    _ProxyOp,
    _StateArgs,
    _table,
)

SOURCE = Path(__file__).with_name("megatrace_profiler.c")
LIBRARY = "libmegatrace_nccl_profiler.so"

# event types and states, as NCCL numbers them
COLL, P2P, PROXY_OP, PROXY_STEP, KERNEL_CH = 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 6
CE_COLL, CE_SYNC, CE_BATCH, KERNEL_PHASE = 1 << 12, 1 << 13, 1 << 14, 1 << 15
SEND_GPU_WAIT, SEND_WAIT, RECV_WAIT, RECV_FLUSH_WAIT, RECV_GPU_WAIT = 8, 9, 10, 11, 12
SEND_PEER_WAIT = 20
KERNEL_PHASE_STOP = 31
#: the profiler API versions the plugin exports, newest first (NCCL takes the newest it knows)
VERSIONS = (7, 6, 5, 4)


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
    "ce_colls_started",
    "ce_parts_started",
    "kernel_phases_started",
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
        if version not in VERSIONS:
            raise ValueError(
                f"profiler API version {version} (valid: {', '.join(map(str, VERSIONS))})"
            )
        self.lib = C.CDLL(str(library))
        self.version = version
        self.table = _table(version).in_dll(self.lib, f"ncclProfiler_v{version}")
        self._descr = _descr(version)
        self._keep: list[object] = []

    def init(self, comm_hash: int, nranks: int, rank: int, nnodes: int = 1) -> Comm:
        ctx, mask = C.c_void_p(), C.c_int(0)
        if self.version >= 5:
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
        strings = {k: v.encode() if isinstance(v, str) else v for k, v in fields.items()}
        self._keep.append(strings)
        v7 = self.version >= 6
        if etype == COLL:
            d.u.coll = (_CollV7 if v7 else _Coll)(**strings)
        elif etype == P2P:
            d.u.p2p = (_P2pV7 if v7 else _P2p)(**strings)
        elif etype == PROXY_OP:
            d.u.proxyOp = _ProxyOp(**fields)
        elif etype == PROXY_STEP:
            d.u.step = fields.get("step", 0)
        elif etype == CE_COLL:
            d.u.ceColl = _CeColl(**strings)
        elif etype == KERNEL_PHASE:
            d.u.kernelPhase = _KernelPhase(**strings)
        handle = C.c_void_p()
        self.table.startEvent(comm.context, C.byref(handle), C.byref(d))
        return handle

    def state(
        self, handle: C.c_void_p, state: int, trans_size: int = 0, timer: int | None = None
    ) -> None:
        args = _StateArgs(pTimer=timer) if timer is not None else _StateArgs(transSize=trans_size)
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
        user_tag: int = 0,
        phases_ns: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        """One ring AllReduce across ``comms`` (one per rank), as NCCL reports it:
        the call, then per channel a send proxy op to the next rank and a receive
        from the previous one, each of ``steps`` steps through their wait states,
        and kernel channels. ``send_wait_s[(src, dst)]`` stretches that edge's
        SendWait/RecvWait; ``stuck=(src, dst)`` leaves that edge's last step
        posted and never completed (and the call never finishes). From v7, the call
        carries ``user_tag``, and ``phases_ns[rank]`` gives that rank's kernel phases
        (initial sync, data movement, final sync) on every channel, GPU-timed."""
        send_wait_s = send_wait_s or {}
        phases_ns = phases_ns or {}
        n = len(comms)
        coll = {"seqNumber": seq, "func": "AllReduce", "count": count, "nChannels": channels}
        coll |= {"datatype": "ncclBfloat16", "algo": "RING", "proto": "SIMPLE"}
        if self.version >= 7:
            coll |= {"userTag": user_tag, "kernelVariant": "AllReduce_RING_SIMPLE"}
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
                if c.rank in phases_ns:
                    self.kernel_phases(c, kch, ch, phases_ns[c.rank])
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

    def kernel_phases(
        self, comm: Comm, channel_event: C.c_void_p, channel: int, lengths: tuple[int, int, int]
    ) -> None:
        """A kernel channel's three phases, one after the other on the GPU's clock."""
        t = 1_000_000_000
        for phase, (name, ns) in enumerate(zip(("initial_sync", "compute", "final_sync"),
                                               lengths, strict=True)):  # fmt: skip
            h = self.start(comm, KERNEL_PHASE, channel_event, channelId=channel, phaseId=phase,
                           phaseName=name, pTimer=t)  # fmt: skip
            t += ns
            self.state(h, KERNEL_PHASE_STOP, timer=t)
            self.stop(h)

    def ce_collective(self, comms: list[Comm], seq: int, count: int = 1 << 20) -> None:
        """One collective run by the copy engines (v6+): the call, its sync and batch
        parts, then its end."""
        ce = {"seqNumber": seq, "func": "AllGather", "count": count, "datatype": "ncclBfloat16",
              "syncStrategy": "barrier", "batchSize": 1, "numBatches": 1}  # fmt: skip
        calls = [self.start(c, CE_COLL, **ce) for c in comms]
        for c, h in zip(comms, calls, strict=True):
            self.stop(self.start(c, CE_SYNC, h))
            self.stop(self.start(c, CE_BATCH, h))
        for h in calls:
            self.stop(h)


__all__ = [
    "COUNTS", "LIBRARY", "SOURCE", "VERSIONS", "Comm", "Plugin", "PluginBuildError", "build",
    "counts",
]  # fmt: skip
