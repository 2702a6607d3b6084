"""Turn a :class:`~producers.sim.engine.StepTrace` into the records real producers emit.

Timestamps become integer ns on each node's (skewed) host clock. A call that
was issued but never completed is reported with ``end_ns=None`` (what a
collector's stuck-call report looks like); a call that was never issued is
not reported at all. Heartbeats carry each rank's latest issued/completed
sequence number per communicator; after a hang they keep coming (the
processes are alive) with frozen progress.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np

from producers.sim.emit_kernels import CLOCK, KernelEmitter
from producers.sim.engine import Engine
from producers.sim.trace import OPS, StepTrace
from schemas.enums import Direction, DType
from schemas.records import (
    Collective,
    CommProgress,
    Heartbeat,
    LinkSample,
    ProxySummary,
)

#: An unfinished proxy operation is reported this long after it started, with the
#: time it spent so far in the state it is stuck in (the NCCL plugin's MEGATRACE_STUCK_MS).
STUCK_REPORT_NS = 500_000_000


class Emitter(KernelEmitter):
    """Builds records for one engine's job, step after step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        sp = engine.spec
        lay = engine.layout
        self.spec = sp
        ranks = np.arange(sp.world_size)
        self.nodes = [sp.node_of(r) for r in range(sp.world_size)]
        self.nics = [sp.nic_of(r) for r in range(sp.world_size)]
        self.skew = engine.skew_ns[ranks // sp.gpus_per_node].round().astype(np.int64)
        self.comm_hash = [c.hash for c in lay.comms]
        # each rank's process's CPU counters (ns since it started), as heartbeats carry them
        self.cpu_run = np.zeros(sp.world_size)
        self.cpu_wait = np.zeros(sp.world_size)
        self.cpu_share = np.zeros(sp.world_size)
        self.cpu_ts: np.ndarray | None = None
        self.comm_size = [len(c.ranks) for c in lay.comms]
        self.comm_stage = np.array([c.pp_stage for c in lay.comms])
        # latest issued/completed seq per (rank, slot); slot: 0 tp, 1 dp, 2 pp-below,
        # 3 pp-above, 4 ep or cp (the group carved from the data axis; never both)
        self.slot_comm = np.full((sp.world_size, 5), -1, dtype=np.int64)
        group = max(sp.ep, sp.cp)
        group_comm = lay.ep_comm if sp.ep > 1 else lay.cp_comm
        for p in range(sp.pp):
            for d in range(sp.dpc):
                for t in range(sp.tp):
                    r = sp.rank(p, d, t)
                    if sp.tp > 1:
                        self.slot_comm[r, 0] = lay.tp_comm[p, d]
                    if sp.dpc > 1:
                        self.slot_comm[r, 1] = lay.dp_comm[p, t]
                    if p > 0:
                        self.slot_comm[r, 2] = lay.pp_comm[p - 1, d, t]
                    if p < sp.pp - 1:
                        self.slot_comm[r, 3] = lay.pp_comm[p, d, t]
                    if group > 1:
                        self.slot_comm[r, 4] = group_comm[p, d, t]
        self.group = group
        # transfers over a pipeline group count per peer: no one progress to report
        self.p2p_progress = sp.heartbeat_p2p and not sp.pp_groups
        self.issued = np.full(self.slot_comm.shape, -1, dtype=np.int64)
        self.completed = np.full(self.slot_comm.shape, -1, dtype=np.int64)
        self.last_ns = int(sp.t0_ns)

    def _abs(self, t: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Float ns since job start -> int ns on the rank's host clock (inf stays -1)."""
        out = np.full(t.shape, -1, dtype=np.int64)
        fin = np.isfinite(t)
        out[fin] = self.spec.t0_ns + t[fin].round().astype(np.int64) + self.skew[rank[fin]]
        return out

    # ------------------------------------------------------------------ records
    def collectives(self, tr: StepTrace) -> list[Collective]:
        c = tr.colls
        if not len(c["rank"]):
            return []
        rank = c["rank"].astype(np.int64)
        comm = c["comm"].astype(np.int64)
        slot = c["slot"].astype(np.int64)
        sp = self.spec
        rank_in = np.select(
            [slot == 0, slot == 1, slot == 4],
            [rank % sp.tp, (rank // sp.tp) % sp.dpc, (rank // sp.tp) % sp.dpc % self.group],
            rank // (sp.tp * sp.dpc) - self.comm_stage[comm],
        )
        enq = self._abs(c["enqueue"], rank)
        start = self._abs(c["start"], rank)
        end = self._abs(c["end"], rank)
        seq = c["seq"].astype(np.int64)
        # progress for heartbeats: a collective's newest seq; a pair's transfers counted
        # both ways in one counter, as the PyTorch collector counts a pair communicator's
        # Sends and Recvs (each direction numbers its own: no seq says how many)
        done = end >= 0
        pair = (slot == 2) | (slot == 3)
        coll = ~pair
        np.maximum.at(self.issued, (rank[coll], slot[coll]), seq[coll])
        np.maximum.at(self.completed, (rank[coll & done], slot[coll & done]), seq[coll & done])
        np.add.at(self.issued, (rank[pair], slot[pair]), 1)
        np.add.at(self.completed, (rank[pair & done], slot[pair & done]), 1)
        job, nodes, hashes, sizes = sp.job, self.nodes, self.comm_hash, self.comm_size
        ops = [OPS[i] for i in range(len(OPS))]
        out = []
        for r, cm, ri, op, sq, peer, cnt, nb, e, s, en in zip(
            rank.tolist(),
            comm.tolist(),
            rank_in.tolist(),
            c["op"].astype(int).tolist(),
            seq.tolist(),
            c["peer"].astype(np.int64).tolist(),
            c["count"].astype(np.int64).tolist(),
            c["nbytes"].astype(np.int64).tolist(),
            enq.tolist(),
            start.tolist(),
            end.tolist(),
            strict=True,
        ):
            o = ops[op]
            out.append(
                Collective(
                    job=job,
                    node=nodes[r],
                    rank=r,
                    clock=CLOCK,
                    comm_hash=hashes[cm],
                    comm_size=sizes[cm],
                    rank_in_comm=ri,
                    op=o,
                    seq=sq,
                    count=cnt,
                    size_bytes=nb,
                    dtype=DType.BFLOAT16,
                    enqueue_ns=e,
                    start_ns=s,
                    end_ns=en if en >= 0 else None,
                    peer=peer if peer >= 0 else None,
                    stream=13,
                    algo="ring",
                    proto="Simple",
                    nchannels=sp.nchannels,
                )
            )
        return out

    def proxies(self, tr: StepTrace, observe_ns: int) -> list[ProxySummary]:
        p = tr.proxies
        if not len(p["rank"]):
            return []
        rank = p["rank"].astype(np.int64)
        first = self._abs(p["first"], rank)
        last = self._abs(p["last"], rank)
        last = np.where(last < 0, np.maximum(observe_ns, first + STUCK_REPORT_NS), last)

        def waited(w: np.ndarray) -> np.ndarray:  # still waiting (inf): as long as observed
            return (
                np.where(np.isinf(w), last - first, np.nan_to_num(w, posinf=0))
                .astype(np.int64)
                .clip(0, None)
            )

        net_ns, gpu_ns = waited(p["net_wait"]), waited(p["gpu_wait"])
        job, nodes, nics, hashes = self.spec.job, self.nodes, self.nics, self.comm_hash
        out = []
        for r, cm, sq, ch, peer, snd, st, ds, nb, f, la, gw, pw, nw, fw in zip(
            rank.tolist(),
            p["comm"].astype(np.int64).tolist(),
            p["seq"].astype(np.int64).tolist(),
            p["channel"].astype(np.int64).tolist(),
            p["peer"].astype(np.int64).tolist(),
            p["send"].astype(int).tolist(),
            p["steps"].astype(np.int64).tolist(),
            p["done_steps"].astype(np.int64).tolist(),
            p["nbytes"].astype(np.int64).tolist(),
            first.tolist(),
            last.tolist(),
            gpu_ns.tolist(),
            np.nan_to_num(p["peer_wait"]).clip(0, None).astype(np.int64).tolist(),
            net_ns.tolist(),
            p["flush_wait"].astype(np.int64).tolist(),
            strict=True,
        ):
            waits = (
                {"send_gpu_wait_ns": gw, "send_peer_wait_ns": pw, "send_wait_ns": nw}
                if snd
                else {"recv_wait_ns": nw, "recv_flush_wait_ns": fw, "recv_gpu_wait_ns": gw}
            )
            out.append(
                ProxySummary(
                    job=job,
                    node=nodes[r],
                    rank=r,
                    clock=CLOCK,
                    comm_hash=hashes[cm],
                    seq=sq,
                    channel=ch,
                    peer=peer,
                    direction=Direction.SEND if snd else Direction.RECV,
                    steps_posted=st,
                    steps_done=ds,
                    size_bytes=nb,
                    first_ns=f,
                    last_ns=la,
                    nic=nics[r],
                    **waits,
                )
            )
        return out

    def links(self, tr: StepTrace) -> list[LinkSample]:
        lk = tr.links
        if not len(lk["src"]):
            return []
        src = lk["src"].astype(np.int64)
        dst = lk["dst"].astype(np.int64)
        key = src * self.spec.world_size + dst
        uniq, inv = np.unique(key, return_inverse=True)
        nbytes = np.bincount(inv, weights=lk["nbytes"].astype(float))
        xfer = np.bincount(inv, weights=lk["xfer"])
        ends = np.zeros(len(uniq))
        np.maximum.at(ends, inv, lk["end"])
        comm = np.zeros(len(uniq), dtype=np.int64)
        comm[inv] = lk["comm"].astype(np.int64)
        s_arr = uniq // self.spec.world_size
        ts = self._abs(ends, s_arr)
        out = []
        for s, d, nb, x, t, cm in zip(
            s_arr.tolist(),
            (uniq % self.spec.world_size).tolist(),
            nbytes.tolist(),
            xfer.tolist(),
            ts.tolist(),
            comm.tolist(),
            strict=True,
        ):
            out.append(
                LinkSample(
                    job=self.spec.job,
                    node=self.nodes[s],
                    rank=s,
                    clock=CLOCK,
                    ts_ns=t,
                    window_ns=int(x),
                    nic=self.nics[s],
                    src_rank=s,
                    dst_rank=d,
                    dst_node=self.nodes[d],
                    dst_nic=self.nics[d],
                    comm_hash=self.comm_hash[cm],
                    size_bytes=int(nb),
                    throughput_gbps=nb * 8 / x if x > 0 else 0.0,
                    wr_posted=50,
                    wr_completed=50,
                )
            )
        return out

    def heartbeats(
        self, ts_ns: np.ndarray | int, step: int, cpu_wait: np.ndarray | None = None
    ) -> list[Heartbeat]:
        """Every rank's heartbeat at ``ts_ns``; its CPU counters grow since its last one at
        ``cpu_wait`` seconds waited a second (the last share given, where none is)."""
        sp = self.spec
        ts = np.broadcast_to(np.asarray(ts_ns, dtype=np.int64), (sp.world_size,))
        if cpu_wait is not None:
            self.cpu_share = cpu_wait
        if self.cpu_ts is not None:
            dt = np.maximum(ts - self.cpu_ts, 0)
            self.cpu_wait += self.cpu_share * dt
            self.cpu_run += 0.8 * dt
        self.cpu_ts = np.maximum(ts, self.cpu_ts) if self.cpu_ts is not None else ts.copy()
        out = []
        for r in range(sp.world_size):
            comms = [
                CommProgress(
                    comm_hash=self.comm_hash[cm],
                    issued_seq=int(self.issued[r, k]),
                    completed_seq=int(self.completed[r, k]),
                )
                for k, cm in enumerate(self.slot_comm[r].tolist())
                if cm >= 0 and (k not in (2, 3) or self.p2p_progress)
            ]
            out.append(
                Heartbeat(
                    job=sp.job,
                    node=self.nodes[r],
                    rank=r,
                    clock=CLOCK,
                    ts_ns=int(ts[r]) + int(self.skew[r]),
                    pid=10_000 + r,
                    step=step,
                    comms=comms,
                    cpu_ns=int(self.cpu_run[r]) + 1,
                    cpu_wait_ns=int(self.cpu_wait[r]),
                )
            )
        return out

    def step_records(self, tr: StepTrace) -> Iterator[msgspec.Struct]:
        """All records of one step (calls, proxies, kernels, links, heartbeats)."""
        end = tr.end
        fin_end = np.where(np.isfinite(end), end, np.nan)
        observe = self.spec.t0_ns + int(np.nanmax(fin_end) if np.isfinite(fin_end).any() else 0)
        yield from self.collectives(tr)
        yield from self.proxies(tr, observe)
        if self.spec.kernels:
            yield from self.kernels(tr)
        yield from self.links(tr)
        hb_t = np.where(
            np.isfinite(end), end, np.nanmax(fin_end) if np.isfinite(fin_end).any() else 0
        )
        yield from self.heartbeats(
            self.spec.t0_ns + hb_t.round().astype(np.int64), tr.step, tr.cpu_wait
        )
        self.last_ns = max(self.last_ns, observe)
