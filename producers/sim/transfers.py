"""The engine's network side: point-to-point pairs between pipeline stages, the
data-parallel gradient ring, and what the NCCL proxy and the link samples see of the
transfers that leave a node.

Timing rules: a Send/Recv pair completes at max(both posted) + transfer, over NVLink within
a node and the NIC between nodes (slowed by a slow link's or NIC's factor); a ring
collective ends at the last member's arrival + the transfer over its slowest edge; a hung
edge never completes (``inf``). :class:`Transfers` is a part of
:class:`~producers.sim.engine.Engine`, which holds the state it uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from producers.sim.faults import GPUStallInTransfer, NetworkHang
from producers.sim.trace import CHUNK_BYTES, INF, PHASE_CODE, Columns, EngineState
from schemas.enums import CollOp, Phase


@dataclass(frozen=True)
class _P2P:
    kind: str  # "act" (stage p -> p+1) or "grad" (p+1 -> p)
    pair: int  # lower stage of the pair
    mb: int
    role: str  # "send" | "recv"

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.pair, self.mb)


class Transfers(EngineState):
    """Transfers of the engine's ranks: their timing and what they record (the engine's
    state: :class:`~producers.sim.trace.EngineState`'s, and below)."""

    step_no: int
    act_elems: int
    grad_elems: int
    dp_seq: list[int]
    link_factor: dict[tuple[int, int], float]
    nic_factor: dict[int, float]
    net_hangs: list[NetworkHang]
    _net_hang_done: set[int]
    _pending: dict
    _done: dict
    proxies: Columns
    links: Columns
    #: the engine's: where a rank hangs, and how a call is recorded
    _hang_mask: Callable[..., np.ndarray]
    _record_coll: Callable[..., None]

    def _edge_factor(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        f = np.ones(src.shape)
        for (u, v), k in self.link_factor.items():
            f[(src == u) & (dst == v)] = k
        for u, k in self.nic_factor.items():
            f[src == u] = np.maximum(f[src == u], k)
        return f

    def _net_hung(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Edges whose transfer never completes, and those of them stalled by the sending GPU."""
        hung = np.zeros(src.shape, dtype=bool)
        by_gpu = np.zeros(src.shape, dtype=bool)
        for i, f in enumerate(self.net_hangs):
            if i in self._net_hang_done:
                continue
            m = (src == f.src_rank) & (dst == f.dst_rank)
            if m.any():
                hung |= m
                if isinstance(f, GPUStallInTransfer):
                    by_gpu |= m
                self._net_hang_done.add(i)
        return hung, by_gpu

    def _p2p_post(self, s: int, op: _P2P) -> None:
        phase = PHASE_CODE[Phase.FORWARD if op.kind == "act" else Phase.BACKWARD]
        if op.role == "recv":
            hang = self._hang_mask(s, "recv", phase, op.mb, -1)
            self.T[s][hang] = INF
        post = self.T[s] + self.launch[s]
        entry = self._pending.setdefault(op.key, {})
        entry[op.role] = post
        if len(entry) == 2:
            self._p2p_complete(op, entry["send"], entry["recv"])

    def _p2p_complete(self, op: _P2P, send_post: np.ndarray, recv_post: np.ndarray) -> None:
        sp = self.spec
        lo, hi = self.layout.ranks[op.pair], self.layout.ranks[op.pair + 1]
        src, dst = (lo, hi) if op.kind == "act" else (hi, lo)
        s_send, s_recv = (op.pair, op.pair + 1) if op.kind == "act" else (op.pair + 1, op.pair)
        nbytes = self.act_elems * 2
        same = (src // sp.gpus_per_node) == (dst // sp.gpus_per_node)
        bw = np.where(same, sp.nvlink_gbytes_s, sp.nic_gbytes_s / self._edge_factor(src, dst))
        xfer = nbytes / (bw * 1e9) * 1e9 + sp.latency_us * 1e3
        ready = np.maximum(send_post, recv_post)
        done = ready + xfer
        hung, by_gpu = self._net_hung(src, dst)
        done = np.where(hung, INF, done)
        self._done[op.key] = done
        seq = self.step_no * sp.num_microbatches + op.mb
        phase = PHASE_CODE[Phase.FORWARD if op.kind == "act" else Phase.BACKWARD]
        comm = self.layout.pp_comm[op.pair]
        slot_send, slot_recv = (3, 2) if op.kind == "act" else (2, 3)
        self._record_coll(
            s_send,
            src,
            comm,
            CollOp.SEND,
            seq,
            dst,
            self.act_elems,
            nbytes,
            send_post,
            done,
            op.mb,
            phase,
            slot_send,
        )
        self._record_coll(
            s_recv,
            dst,
            comm,
            CollOp.RECV,
            seq,
            src,
            self.act_elems,
            nbytes,
            recv_post,
            done,
            op.mb,
            phase,
            slot_recv,
        )
        inter = ~same
        if inter.any():
            self._proxy_pair(
                src[inter],
                dst[inter],
                comm[inter],
                seq,
                nbytes,
                send_post[inter],
                recv_post[inter],
                xfer[inter],
                done[inter],
                s_send,
                s_recv,
                inter,
                by_gpu[inter],
            )

    def _proxy_pair(
        self,
        src,
        dst,
        comm,
        seq,
        nbytes,
        send_post,
        recv_post,
        xfer,
        done,
        s_send,
        s_recv,
        mask,
        by_gpu,
    ) -> None:
        sp = self.spec
        ch_bytes = nbytes // sp.nchannels
        steps = max(1, -(-ch_bytes // CHUNK_BYTES))
        hung = np.isinf(done)
        fin_s, fin_r = np.isfinite(send_post), np.isfinite(recv_post)
        gpu_lead_s = self.lead[s_send][mask]
        for ch in range(sp.nchannels):
            # sender side
            m = fin_s
            self.proxies.add(
                int(m.sum()),
                rank=src[m],
                comm=comm[m],
                seq=seq,
                channel=ch,
                peer=dst[m],
                send=1,
                steps=steps,
                done_steps=np.where(hung[m], steps // 2, steps),
                nbytes=ch_bytes,
                first=send_post[m],
                last=done[m],
                gpu_wait=np.where(by_gpu[m], INF, np.minimum(gpu_lead_s[m], 50e3)),
                peer_wait=np.clip(np.nan_to_num(recv_post[m] - send_post[m], posinf=0), 0, None),
                net_wait=np.where(by_gpu[m], xfer[m] / 2, np.where(hung[m], INF, xfer[m])),
                flush_wait=0.0,
            )
            m = fin_r
            self.proxies.add(
                int(m.sum()),
                rank=dst[m],
                comm=comm[m],
                seq=seq,
                channel=ch,
                peer=src[m],
                send=0,
                steps=steps,
                done_steps=np.where(hung[m], steps // 2, steps),
                nbytes=ch_bytes,
                first=recv_post[m],
                last=done[m],
                gpu_wait=2e3,
                peer_wait=0.0,
                net_wait=np.where(
                    hung[m],
                    INF,
                    np.clip(np.nan_to_num(send_post[m] - recv_post[m], posinf=0), 0, None)
                    + xfer[m],
                ),
                flush_wait=1e3,
            )
        fin = np.isfinite(done)
        if fin.any():
            self.links.add(
                int(fin.sum()),
                src=src[fin],
                dst=dst[fin],
                comm=comm[fin],
                nbytes=nbytes,
                xfer=xfer[fin],
                end=done[fin],
            )

    def _dp_collective(self, s: int, op: CollOp, phase: int) -> None:
        sp = self.spec
        n = sp.dpc
        ranks = self.layout.ranks[s]  # (d, tp)
        nxt = np.roll(ranks, -1, axis=0)  # ring successor within each tp column
        arrive = self.T[s] + self.launch[s]
        nbytes = self.grad_elems * 2  # bf16 gradients
        factor = 2 * (n - 1) / n if op == CollOp.ALL_REDUCE else (n - 1) / n
        same = (ranks // sp.gpus_per_node) == (nxt // sp.gpus_per_node)
        edge_bw = np.where(
            same, sp.nvlink_gbytes_s, sp.nic_gbytes_s / self._edge_factor(ranks, nxt)
        )
        edge_xfer = nbytes * factor / (edge_bw * 1e9) * 1e9  # each edge carries this much
        lat = sp.latency_us * 1e3 * 2 * (n - 1)
        xfer = edge_xfer.max(axis=0, keepdims=True) + lat  # the slowest edge paces the ring
        hung_edge, gpu_edge = self._net_hung(ranks, nxt)
        hung = hung_edge.any(axis=0, keepdims=True)
        last = arrive.max(axis=0, keepdims=True)
        end = np.broadcast_to(np.where(hung, INF, last + xfer), arrive.shape)
        count = self.grad_elems if op == CollOp.ALL_REDUCE else self.grad_elems // n
        self._record_coll(
            s,
            ranks,
            np.broadcast_to(self.layout.dp_comm[s][None, :], ranks.shape),
            op,
            self.dp_seq[s],
            -1,
            count,
            count * 2,
            arrive,
            end,
            -1,
            phase,
            1,
        )
        self.dp_seq[s] += 1
        # proxy summaries of the inter-node ring edges: each member sends to its successor
        inter = ~same
        if inter.any():
            comm = np.broadcast_to(self.layout.dp_comm[s][None, :], ranks.shape)
            prev_arrive = np.roll(arrive, 1, axis=0)
            ch_bytes = int(nbytes * factor) // sp.nchannels
            steps = max(1, -(-ch_bytes // CHUNK_BYTES))
            fin = np.isfinite(arrive) & inter
            endb = np.broadcast_to(end, arrive.shape)
            done_steps = np.where(np.broadcast_to(hung, arrive.shape), steps // 2, steps)
            lastw = np.broadcast_to(last, arrive.shape)
            succ_fin = np.roll(np.isfinite(arrive), -1, axis=0) & inter
            for ch in range(sp.nchannels):
                self.proxies.add(
                    int(fin.sum()),
                    rank=ranks[fin],
                    comm=comm[fin],
                    seq=self.dp_seq[s] - 1,
                    channel=ch,
                    peer=nxt[fin],
                    send=1,
                    steps=steps,
                    done_steps=done_steps[fin],
                    nbytes=ch_bytes,
                    first=arrive[fin],
                    last=endb[fin],
                    gpu_wait=np.where(gpu_edge[fin], INF, np.minimum(self.lead[s][fin], 50e3)),
                    peer_wait=np.subtract(
                        lastw,
                        arrive,
                        out=np.zeros(arrive.shape),
                        where=np.isfinite(lastw) & np.isfinite(arrive),
                    )[fin]
                    + np.broadcast_to(xfer - lat - edge_xfer, arrive.shape)[fin],
                    net_wait=np.where(
                        gpu_edge[fin],
                        edge_xfer[fin] / 2,
                        np.where(hung_edge[fin], INF, edge_xfer[fin]),
                    ),
                    flush_wait=0.0,
                )
                # the successor receives from this member
                rcv = succ_fin
                recv_rank = nxt[rcv]
                self.proxies.add(
                    int(rcv.sum()),
                    rank=recv_rank,
                    comm=comm[rcv],
                    seq=self.dp_seq[s] - 1,
                    channel=ch,
                    peer=ranks[rcv],
                    send=0,
                    steps=steps,
                    done_steps=done_steps[rcv],
                    nbytes=ch_bytes,
                    first=np.roll(arrive, -1, axis=0)[rcv],
                    last=endb[rcv],
                    gpu_wait=2e3,
                    peer_wait=0.0,
                    net_wait=np.where(
                        hung_edge[rcv],
                        INF,
                        edge_xfer[rcv]
                        + np.clip(
                            np.nan_to_num(arrive[rcv] - np.roll(arrive, -1, axis=0)[rcv], posinf=0),
                            0,
                            None,
                        ),
                    ),
                    flush_wait=1e3,
                )
            del prev_arrive
            ok = np.isfinite(endb) & inter
            if ok.any():
                self.links.add(
                    int(ok.sum()),
                    src=ranks[ok],
                    dst=nxt[ok],
                    comm=comm[ok],
                    nbytes=int(nbytes * factor),
                    xfer=edge_xfer[ok],
                    end=endb[ok],
                )
        self.T[s] = np.array(end)
