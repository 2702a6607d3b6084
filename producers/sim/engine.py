"""The timing engine: one training iteration at a time, every rank, every call.

Each pipeline stage runs Megatron's non-interleaved 1F1B program (warm-up
forwards, steady one-forward-one-backward, cool-down backwards, then the
data-parallel gradient sync and the optimizer). Work is vectorised over the
(d, tp) ranks of a stage (d: the data axis, dp x cp ranks): one numpy operation
per call for all of them.

Timing rules (times are float ns since the job start; ``inf`` = never):

* a compute segment lasts its base time x the rank's persistent speed x
  jitter x any slowdown fault;
* a rank arrives at a call when it finishes the previous work plus its launch
  delay; the host enqueued the call ``host_lead`` earlier;
* a blocking collective ends at the last member's arrival + transfer time
  (ring model over the slowest edge);
* a Send/Recv pair completes at max(both posted) + transfer; a Megatron batched
  p2p call returns when all of its transfers complete;
* a hung rank's time becomes ``inf``, which propagates through ``max`` to
  exactly the ranks that wait on it.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np

from producers.sim.faults import (
    BubbleDelay,
    ComputeHang,
    Fault,
    GPUStallInTransfer,
    HostStarvation,
    IntermittentGPU,
    MissingRecv,
    NetworkHang,
    SlowGPU,
    SlowLink,
    SlowNIC,
)
from producers.sim.job import JobSpec, Layout
from schemas.enums import CollOp, Phase

OPS = list(CollOp)
OP_CODE = {op: i for i, op in enumerate(OPS)}
PHASES = list(Phase)
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}
#: kernel name per (phase code, segment kind)
KERNEL_NAMES = [
    "flash_fwd_kernel",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64",
    "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x128x64",
    "multi_tensor_apply_kernel_adam",
]
INF = np.inf
CHUNK_BYTES = 512 * 1024  # bytes per NCCL proxy step


@dataclass
class Columns:
    """Append-only columns of one kind of event; concatenated at the end of a step."""

    names: tuple[str, ...]
    parts: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(self, n: int, **cols: object) -> None:
        for name in self.names:
            v = cols[name]
            arr = np.asarray(v).ravel()
            if arr.size == 1 and n != 1:
                arr = np.full(n, arr[0], dtype=arr.dtype)
            self.parts.setdefault(name, []).append(arr)

    def build(self) -> dict[str, np.ndarray]:
        return {
            k: (np.concatenate(self.parts[k]) if self.parts.get(k) else np.zeros(0))
            for k in self.names
        }


COLL_COLS = (
    "rank",
    "comm",
    "op",
    "seq",
    "peer",
    "count",
    "nbytes",
    "enqueue",
    "start",
    "end",
    "mb",
    "phase",
    "slot",
)
PROXY_COLS = (
    "rank",
    "comm",
    "seq",
    "channel",
    "peer",
    "send",
    "steps",
    "done_steps",
    "nbytes",
    "first",
    "last",
    "gpu_wait",
    "peer_wait",
    "net_wait",
    "flush_wait",
)
KERNEL_COLS = ("rank", "start", "end", "name", "corr")
LINK_COLS = ("src", "dst", "comm", "nbytes", "xfer", "end")


@dataclass
class StepTrace:
    """Everything that happened in one iteration, as columns."""

    step: int
    start: np.ndarray  # per rank
    end: np.ndarray  # per rank (inf if the rank never finished the step)
    colls: dict[str, np.ndarray]
    proxies: dict[str, np.ndarray]
    kernels: dict[str, np.ndarray]
    links: dict[str, np.ndarray]
    cpu_wait: np.ndarray | None = None  # per rank: seconds its threads waited for a CPU a second

    @property
    def hung(self) -> bool:
        return bool(np.isinf(self.end).any())

    @property
    def duration_ns(self) -> float:
        return float(self.end.max() - self.start.min())


@dataclass(frozen=True)
class _P2P:
    kind: str  # "act" (stage p -> p+1) or "grad" (p+1 -> p)
    pair: int  # lower stage of the pair
    mb: int
    role: str  # "send" | "recv"

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.pair, self.mb)


#: a starved host's ranks' threads wait for a CPU longer than they run
STARVED_CPU_WAIT = 1.2


class Engine:
    """Simulates iterations of one job with a list of faults."""

    def __init__(self, spec: JobSpec, faults: list[Fault] | tuple[Fault, ...] = ()) -> None:
        self.spec = spec
        self.layout = Layout(spec)
        self.faults = list(faults)
        s = spec
        rng = np.random.default_rng(spec.seed)
        self.rng = rng
        shape = (s.pp, s.dpc, s.tp)
        self.speed = (1.0 + rng.normal(0.0, s.rank_speed_cv, shape)).clip(0.9, 1.1)
        self.lateness = np.abs(rng.normal(0.0, s.rank_lateness_us * 1e3, shape))
        self.skew_ns = rng.normal(0.0, s.clock_skew_us * 1e3, s.num_nodes)
        self.T = np.zeros(shape)  # per-rank clock, ns since job start
        # each rank's share of time its threads wait for a CPU (the run queue), from an rng
        # of its own so that the timings' draws are the same with it as without
        self._cpu_rng = np.random.default_rng([spec.seed, 0xC9])
        self.cpu_base = self._cpu_rng.uniform(0.02, 0.15, shape)
        self.node = self.layout.ranks // s.gpus_per_node
        self._net_hang_done: set[int] = set()
        self.step_no = 0
        self.hung = False
        # transfer sizes (bytes) per call kind
        h, sl, mbs = s.hidden, s.seq_len // s.cp, s.micro_batch_size  # this rank's tokens
        self.act_elems = sl * mbs * h // (s.tp if s.sequence_parallel else 1)
        self.tp_elems = sl * mbs * h
        self.grad_elems = 12 * h * h * s.layers_per_stage // s.tp
        self._corr = 0

    # ------------------------------------------------------------------ faults
    def _setup_step(self, step: int) -> None:
        s = self.spec
        self.cf = self.speed.copy()
        self.launch = self.lateness.copy()
        self.lead = np.full(self.T.shape, s.host_lead_us * 1e3)
        noise = 1.0 + 0.2 * self._cpu_rng.standard_normal(self.T.shape)
        self.cpu_share = self.cpu_base * noise.clip(0.5, 1.5)
        self.hangs: dict[tuple[int, int, int], tuple] = {}
        self.bubbles: list[tuple[tuple[int, int, int], BubbleDelay]] = []
        self.link_factor: dict[tuple[int, int], float] = {}
        self.nic_factor: dict[int, float] = {}
        self.net_hangs: list[NetworkHang] = []
        for f in self.faults:
            if isinstance(f, SlowGPU | IntermittentGPU) and f.active(step):
                self.cf[s.coords(f.rank)] *= f.factor
            elif isinstance(f, HostStarvation) and f.active(step):
                on_node = self.node == f.node
                self.launch[on_node] += f.launch_delay_us * 1e3
                self.lead[on_node] = 5e3
                self.cpu_share[on_node] = STARVED_CPU_WAIT
            elif isinstance(f, SlowLink) and f.active(step):
                self.link_factor[(f.src_rank, f.dst_rank)] = f.factor
            elif isinstance(f, SlowNIC) and f.active(step):
                self.nic_factor[f.rank] = f.factor
            elif isinstance(f, ComputeHang) and f.onset_step == step:
                self.hangs[s.coords(f.rank)] = ("tp", PHASE_CODE[f.phase], f.microbatch, f.layer)
            elif isinstance(f, MissingRecv) and f.onset_step == step:
                self.hangs[s.coords(f.rank)] = ("recv", PHASE_CODE[f.phase], f.microbatch, -1)
            elif isinstance(f, NetworkHang) and f.onset_step == step:
                self.net_hangs.append(f)
            elif isinstance(f, BubbleDelay) and f.active(step):
                self.bubbles.append((s.coords(f.rank), f))

    def _hang_mask(self, stage: int, what: str, phase: int, mb: int, layer: int) -> np.ndarray:
        mask = np.zeros(self.T.shape[1:], dtype=bool)
        for (p, d, t), spec in self.hangs.items():
            if p == stage and spec == (what, phase, mb, layer):
                mask[d, t] = True
        return mask

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

    # ------------------------------------------------------------------ work
    def _compute(self, s: int, base_ms: float, name: int, phase: int, mb: int) -> None:
        sp = self.spec
        jitter = 1.0 + self.rng.normal(0.0, sp.jitter_cv, self.T.shape[1:]).clip(-0.2, 0.2)
        dur = base_ms * 1e6 * self.cf[s] * jitter
        for (p, d, t), f in self.bubbles:
            if p == s and PHASE_CODE[f.phase] == phase and f.microbatch == mb:
                dur[d, t] += f.delay_ms * 1e6 / max(1, self.spec.layers_per_stage * 2)
        start = self.T[s]
        end = start + dur
        if sp.kernels:
            self._corr += 1
            fin = np.isfinite(end)
            self.kernels.add(
                int(fin.sum()),
                rank=self.layout.ranks[s][fin],
                start=start[fin],
                end=end[fin],
                name=name,
                corr=self._corr,
            )
        self.T[s] = end

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

    def _layer_pass(self, s: int, phase: int, mb: int) -> None:
        sp = self.spec
        base = sp.fwd_ms_per_layer * (sp.bwd_ratio if phase == PHASE_CODE[Phase.BACKWARD] else 1)
        names = (0, 1) if phase == PHASE_CODE[Phase.FORWARD] else (2, 3)
        ops = (
            [CollOp.ALL_GATHER, CollOp.REDUCE_SCATTER]
            if sp.sequence_parallel
            else [CollOp.ALL_REDUCE]
        )
        base /= sp.cp  # context parallelism: each rank computes its share of the sequence
        forward = phase == PHASE_CODE[Phase.FORWARD]
        for layer in range(sp.layers_per_stage):
            for part, frac in enumerate((0.4, 0.6)):
                moe = part == 1 and sp.ep > 1
                ctx = part == 0 and sp.cp > 1
                if moe:  # MoE: tokens to their experts, through the expert computation, back
                    self._ep_all_to_all(s, phase, mb)
                if ctx:  # attention over the whole sequence: gather keys and values
                    self._cp_collective(s, CollOp.ALL_GATHER, phase, mb)
                    if forward:
                        self._cp_collective(s, CollOp.ALL_GATHER, phase, mb)
                self._compute(s, base * frac, names[part], phase, mb)
                if moe:
                    self._ep_all_to_all(s, phase, mb)
                if ctx and not forward:  # their gradients go back to their owners
                    self._cp_collective(s, CollOp.REDUCE_SCATTER, phase, mb)
                for op in ops:
                    self._tp_collective(s, op, phase, mb, layer)

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
    def _program(self, s: int) -> Generator[list[_P2P], None, None]:
        """Megatron's non-interleaved 1F1B for stage ``s``: yields blocking p2p batches."""
        sp = self.spec
        P, M = sp.pp, sp.num_microbatches
        F, B = PHASE_CODE[Phase.FORWARD], PHASE_CODE[Phase.BACKWARD]
        first, last = s == 0, s == P - 1
        warm = min(P - s - 1, M)

        def recv_fwd(mb: int) -> list[_P2P]:
            return [] if first else [_P2P("act", s - 1, mb, "recv")]

        def send_fwd(mb: int) -> list[_P2P]:
            return [] if last else [_P2P("act", s, mb, "send")]

        def recv_bwd(mb: int) -> list[_P2P]:
            return [] if last else [_P2P("grad", s, mb, "recv")]

        def send_bwd(mb: int) -> list[_P2P]:
            return [] if first else [_P2P("grad", s - 1, mb, "send")]

        for mb in range(warm):
            if b := recv_fwd(mb):
                yield b
            self._layer_pass(s, F, mb)
            if b := send_fwd(mb):
                yield b
        remaining = M - warm
        if remaining and (b := recv_fwd(warm)):
            yield b
        for i in range(remaining):
            fmb, bmb = warm + i, i
            self._layer_pass(s, F, fmb)
            if b := send_fwd(fmb) + recv_bwd(bmb):
                yield b
            self._layer_pass(s, B, bmb)
            if i == remaining - 1:
                if b := send_bwd(bmb):
                    yield b
            elif b := send_bwd(bmb) + recv_fwd(fmb + 1):
                yield b
        for mb in range(remaining, M):
            if b := recv_bwd(mb):
                yield b
            self._layer_pass(s, B, mb)
            if b := send_bwd(mb):
                yield b
        self._dp_sync(s)

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

    def _dp_sync(self, s: int) -> None:
        sp = self.spec
        F = PHASE_CODE[Phase.DP_SYNC]
        if sp.dpc > 1:  # gradients are reduced over the dp x cp ranks
            ops = (
                [CollOp.REDUCE_SCATTER, CollOp.ALL_GATHER]
                if sp.distributed_optimizer
                else [CollOp.ALL_REDUCE]
            )
            for op in ops:
                if op == CollOp.ALL_GATHER:
                    self._compute(s, sp.optimizer_ms, 4, PHASE_CODE[Phase.OPTIMIZER], -1)
                self._dp_collective(s, op, F)
            if not sp.distributed_optimizer:
                self._compute(s, sp.optimizer_ms, 4, PHASE_CODE[Phase.OPTIMIZER], -1)
        else:
            self._compute(s, sp.optimizer_ms, 4, PHASE_CODE[Phase.OPTIMIZER], -1)

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

    # ------------------------------------------------------------------ driver
    def step(self) -> StepTrace:
        """Simulate the next iteration."""
        if self.hung:
            raise RuntimeError("the job is hung: no further iteration can run")
        sp = self.spec
        step = self.step_no
        self._setup_step(step)
        self.colls = Columns(COLL_COLS)
        self.proxies = Columns(PROXY_COLS)
        self.kernels = Columns(KERNEL_COLS)
        self.links = Columns(LINK_COLS)
        self.tp_seq = getattr(self, "tp_seq", [0] * sp.pp)
        self.dp_seq = getattr(self, "dp_seq", [0] * sp.pp)
        self.group_seq = getattr(self, "group_seq", [0] * sp.pp)  # EP or CP, per stage
        self._pending: dict = {}
        self._done: dict = {}
        start = self.T.copy()
        programs = {s: self._program(s) for s in range(sp.pp)}
        waiting: dict[int, list[_P2P]] = {}
        active = set(programs)
        while active:
            progressed = False
            for s in sorted(active):
                batch = waiting.get(s)
                if batch is not None:
                    if not all(op.key in self._done for op in batch):
                        continue
                    self.T[s] = np.maximum.reduce(
                        [np.maximum(self.T[s], self._done[op.key]) for op in batch]
                    )
                try:
                    batch = next(programs[s])
                except StopIteration:
                    active.discard(s)
                    waiting.pop(s, None)
                    progressed = True
                    continue
                for op in batch:
                    self._p2p_post(s, op)
                waiting[s] = batch
                progressed = True
            if not progressed:
                raise RuntimeError(f"schedule deadlock in step {step}: {waiting}")
        trace = StepTrace(
            step,
            start.reshape(-1),
            self.T.copy().reshape(-1),
            self.colls.build(),
            self.proxies.build(),
            self.kernels.build(),
            self.links.build(),
            self.cpu_share.reshape(-1).copy(),
        )
        # rank order in the flattened (pp, dp, tp) arrays is the global rank order
        self.step_no += 1
        self.hung = trace.hung
        return trace
