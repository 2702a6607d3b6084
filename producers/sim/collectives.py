"""The engine's collectives within a pipeline stage: tensor-parallel ones after each
layer's parts, and those of expert- and context-parallel groups; each recorded as every
member's call (:meth:`Collectives._record_coll`, which the transfers use too).

A blocking collective ends at its last member's arrival + its transfer time (a ring over
NVLink within a node, the NIC between nodes). :class:`Collectives` is a part of
:class:`~producers.sim.engine.Engine`, which holds the state it uses."""

from __future__ import annotations

import numpy as np

from producers.sim.trace import INF, OP_CODE, EngineState
from schemas.enums import CollOp


class Collectives(EngineState):
    """Collectives of a stage's groups: their timing and their records (the engine's
    state: :class:`~producers.sim.trace.EngineState`'s, and below)."""

    tp_elems: int
    tp_seq: list[int]
    group_seq: list[int]

    def _tp_collective(self, s: int, op: CollOp, phase: int, mb: int, layer: int) -> None:
        sp = self.spec
        if sp.tp == 1:
            return
        hang = self._hang_mask(s, "tp", phase, mb, layer)
        self.T[s][hang] = INF
        arrive = self.T[s] + self.launch[s]
        n = sp.tp
        nbytes = self.tp_elems * 2
        factor = 2 * (n - 1) / n if op == CollOp.ALL_REDUCE else (n - 1) / n
        xfer = nbytes * factor / (sp.nvlink_gbytes_s * 1e9) * 1e9 + sp.latency_us * 1e3
        end = arrive.max(axis=1, keepdims=True) + xfer
        end = np.broadcast_to(end, arrive.shape)
        count = self.tp_elems if op == CollOp.ALL_REDUCE else self.tp_elems // n
        comms = np.broadcast_to(self.layout.tp_comm[s][:, None], arrive.shape)
        self._stage_collective(s, comms, op, self.tp_seq, 0, count, arrive, end, mb, phase)

    def _stage_collective(
        self,
        s: int,
        comms: np.ndarray,
        op: CollOp,
        seqs: list[int],
        slot: int,
        count: int,
        arrive: np.ndarray,
        end: np.ndarray,
        mb: int,
        phase: int,
    ) -> None:
        """Record one bf16 collective of every group of stage ``s`` (sequence number
        ``seqs[s]``, then advanced) and move the stage's ranks to its end."""
        self._record_coll(
            s,
            self.layout.ranks[s],
            comms,
            op,
            seqs[s],
            -1,
            count,
            count * 2,
            arrive,
            end,
            mb,
            phase,
            slot,
        )
        seqs[s] += 1
        self.T[s] = np.array(end)

    def _record_coll(
        self,
        s: int,
        ranks: np.ndarray,
        comms: np.ndarray,
        op: CollOp,
        seq: object,
        peer: object,
        count: int,
        nbytes: int,
        arrive: np.ndarray,
        end: np.ndarray,
        mb: int,
        phase: int,
        slot: int,
    ) -> None:
        issued = np.isfinite(arrive)
        k = int(issued.sum())
        if not k:
            return
        lead = (
            self.lead[s][issued] if arrive.shape == self.lead[s].shape else self.lead[s].ravel()[0]
        )
        peer_arr = np.asarray(peer)
        seq_arr = np.asarray(seq)
        self.colls.add(
            k,
            rank=ranks[issued],
            comm=comms[issued],
            op=OP_CODE[op],
            seq=seq_arr[issued] if seq_arr.shape == issued.shape else seq_arr,
            peer=peer_arr[issued] if peer_arr.shape == issued.shape else peer_arr,
            count=count,
            nbytes=nbytes,
            enqueue=arrive[issued] - lead,
            start=arrive[issued],
            end=end[issued],
            mb=mb,
            phase=phase,
            slot=slot,
        )

    def _ep_all_to_all(self, s: int, phase: int, mb: int) -> None:
        """One AllToAll in every expert-parallel group of stage ``s``: this rank's tokens
        to their experts, (ep-1)/ep of them leaving it."""
        sp = self.spec
        count = self.tp_elems // sp.tp
        self._group_collective(
            s,
            CollOp.ALL_TO_ALL,
            sp.ep,
            self.layout.ep_comm[s],
            count,
            count * 2 * (sp.ep - 1) / sp.ep,
            phase,
            mb,
        )

    def _cp_collective(self, s: int, op: CollOp, phase: int, mb: int) -> None:
        """One AllGather (keys or values) or ReduceScatter (their gradients) in every
        context-parallel group of stage ``s``: each rank's share of the sequence's
        keys/values, (cp-1)/cp of the whole moving through each rank."""
        sp = self.spec
        kv = self.tp_elems // sp.tp  # this rank's share of keys (or values), elements
        count = kv * sp.cp if op == CollOp.ALL_GATHER else kv
        self._group_collective(
            s, op, sp.cp, self.layout.cp_comm[s], count, kv * 2 * (sp.cp - 1), phase, mb
        )

    def _group_collective(
        self,
        s: int,
        op: CollOp,
        size: int,
        comms: np.ndarray,
        count: int,
        moved: float,
        phase: int,
        mb: int,
    ) -> None:
        """A collective in every group of ``size`` consecutive data-axis ranks of stage
        ``s`` (expert or context parallelism): it ends when its last member arrived and
        ``moved`` bytes per rank went over the group's slowest kind of link."""
        sp = self.spec
        arrive = self.T[s] + self.launch[s]  # [d, tp]
        groups = arrive.reshape(sp.dpc // size, size, sp.tp)
        ranks = self.layout.ranks[s].reshape(groups.shape)
        one_node = (ranks // sp.gpus_per_node == ranks[:, :1] // sp.gpus_per_node).all(axis=1)
        bw = np.where(one_node, sp.nvlink_gbytes_s, sp.nic_gbytes_s)  # [groups, tp]
        xfer = moved / (bw * 1e9) * 1e9 + sp.latency_us * 1e3
        end = groups.max(axis=1, keepdims=True) + xfer[:, None, :]
        end = np.broadcast_to(end, groups.shape).reshape(arrive.shape)
        self._stage_collective(s, comms, op, self.group_seq, 4, count, arrive, end, mb, phase)

    # ------------------------------------------------------------------ pipeline
