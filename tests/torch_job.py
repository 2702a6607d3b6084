"""A small real training job on torch.distributed (Gloo, CPU), shaped like Megatron.

Each rank runs ``python -m tests.torch_job`` with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set. Tensor parallelism: every layer has two blocks (column- then
row-parallel linear), each with one all-reduce in forward and one in backward,
as Megatron issues them. Pipeline parallelism: Megatron's non-interleaved 1F1B
schedule with batched isend/irecv of activations and gradients between
neighbouring stages. Data parallelism: one all-reduce of the gradients per
step. "GPU time" is a sleep per block (this machine has two cores for all the
ranks); a fault is a real extra sleep in one rank's compute, or one rank that
stops before a collective. The megatrace collector is on (one line).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

STATE = {"step": 0, "mb": 0, "phase": "forward"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="torch-job")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--block-ms", type=float, default=2.0, help="forward 'GPU' time per block")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=0)
    p.add_argument("--hang-mb", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=6.0)
    return p.parse_args()


class Compute(torch.autograd.Function):
    """Stands in for the GPU time of a block: forward and backward (2x) sleeps."""

    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        time.sleep(2 * ctx.seconds)
        return g, None


class ReduceForward(torch.autograd.Function):
    """Megatron's reduce-from-model-parallel region: all-reduce forward, identity back."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


class ReduceBackward(torch.autograd.Function):
    """Megatron's copy-to-model-parallel region: identity forward, all-reduce back."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class Block(torch.nn.Module):
    def __init__(self, hidden: int, tp: int, group, rank: int, args) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(hidden, hidden // tp) * 0.05)
        self.w2 = torch.nn.Parameter(torch.randn(hidden // tp, hidden) * 0.05)
        self.group, self.rank, self.args = group, rank, args

    def forward(self, x):
        a = self.args
        seconds = a.block_ms / 1000
        if self.rank == a.slow_rank and STATE["step"] >= a.slow_from:
            seconds *= a.slow_factor
        x = ReduceBackward.apply(x, self.group)
        h = torch.nn.functional.gelu(x @ self.w1)
        h = Compute.apply(h @ self.w2, seconds)
        if (
            self.rank == a.hang_rank
            and STATE["step"] == a.hang_step
            and STATE["mb"] == a.hang_mb
            and STATE["phase"] == "forward"
        ):
            time.sleep(a.hang_s)  # this rank never joins the next all-reduce
            os._exit(3)
        return ReduceForward.apply(h, self.group)


def groups(world: int, tp: int, pp: int):
    dp = world // (tp * pp)
    rank = dist.get_rank()
    mine = {}
    for s in range(pp):
        for d in range(dp):
            ranks = [s * tp * dp + d * tp + t for t in range(tp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["tp"] = g
        for t in range(tp):
            ranks = [s * tp * dp + d * tp + t for d in range(dp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["dp"] = g
    return mine, dp


def main() -> None:
    a = parse()
    # four ranks share two cores here: one intra-op thread each, or their spinning OpenMP
    # threads make the host the bottleneck and a rank's extra "GPU" sleep only frees a core
    # for the others (measured: 0.75 s steps, +/- 0.15 s, instead of 0.27 s)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, dp = groups(world, a.tp, a.pp)
    from producers import torch_collector

    torch_collector.enable(
        a.job, tp=a.tp, pp=a.pp, dp=dp, num_layers=a.layers, num_microbatches=a.microbatches
    )
    torch.manual_seed(rank)
    stage = rank // (a.tp * dp)
    first, last = stage == 0, stage == a.pp - 1
    up, down = rank - a.tp * dp, rank + a.tp * dp  # same (dp, tp) on the neighbouring stages
    blocks = torch.nn.ModuleList(
        Block(a.hidden, a.tp, mine["tp"], rank, a) for _ in range(2 * a.layers // a.pp)
    )
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    shape = (8, a.hidden)

    def exchange(send: tuple | None, recv_from: int | None):
        ops, buf = [], None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send[0].detach().contiguous(), send[1]))
        if recv_from is not None:
            buf = torch.empty(shape)
            ops.append(dist.P2POp(dist.irecv, buf, recv_from))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return buf

    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}

    def forward(mb: int, x):
        STATE.update(mb=mb, phase="forward")
        if x is None:
            x = torch.randn(shape)
        x.requires_grad_(True)
        y = x
        for b in blocks:
            y = b(y)
        inputs[mb], outputs[mb] = x, y
        return y

    def backward(mb: int, grad):
        STATE.update(mb=mb, phase="backward")
        x, y = inputs.pop(mb), outputs.pop(mb)
        if last:
            y.pow(2).mean().backward()
        else:
            y.backward(grad)
        return x.grad

    collector = torch_collector.enable()
    for step in range(a.steps):
        STATE["step"] = step
        collector.step = step
        M = a.microbatches
        warm = min(a.pp - stage - 1, M)
        for mb in range(warm):
            x = exchange(None, None if first else up)
            y = forward(mb, x)
            exchange(None if last else (y, down), None)
        x = exchange(None, None if first else up) if M - warm > 0 else None
        for i in range(M - warm):
            y = forward(warm + i, x)
            grad = exchange(None if last else (y, down), None if last else down)
            gx = backward(i, grad)
            if i == M - warm - 1:
                exchange(None if first else (gx, up), None)
            else:
                x = exchange(None if first else (gx, up), None if first else up)
        for i in range(M - warm, M):
            grad = exchange(None, None if last else down)
            gx = backward(i, grad)
            exchange(None if first else (gx, up), None)
        if dp > 1:
            flat = torch.cat([p.grad.flatten() for p in blocks.parameters()])
            dist.all_reduce(flat, group=mine["dp"])
        opt.step()
        opt.zero_grad()
    torch_collector.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
