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

The engine runs the program; its collectives within a stage are
:mod:`producers.sim.collectives`, the transfers between stages and the data-parallel
ring :mod:`producers.sim.transfers`, and what a step leaves :mod:`producers.sim.trace`'s.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from producers.sim.collectives import Collectives
from producers.sim.faults import (
    BubbleDelay,
    ComputeHang,
    Fault,
    HostStarvation,
    IntermittentGPU,
    MissingRecv,
    NetworkHang,
    SlowGPU,
    SlowLink,
    SlowNIC,
)
from producers.sim.job import JobSpec, Layout
from producers.sim.trace import (
    COLL_COLS,
    KERNEL_COLS,
    LINK_COLS,
    PHASE_CODE,
    PROXY_COLS,
    Columns,
    StepTrace,
)
from producers.sim.transfers import _P2P, Transfers
from schemas.enums import CollOp, Phase

#: a starved host's ranks' threads wait for a CPU longer than they run
STARVED_CPU_WAIT = 1.2


class Engine(Collectives, Transfers):
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
