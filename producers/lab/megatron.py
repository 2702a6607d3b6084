"""Megatron-style tensor x pipeline x data parallelism for the lab, with real compute.

Each stage holds ``2 * layers / pp`` blocks; a block is Megatron's pair of a
column-parallel and a row-parallel linear layer, with the tensor-parallel all-reduce
after it in the forward pass (reduce from the model-parallel region) and before it in
the backward pass (copy to it). Stages exchange activations and gradients by
Megatron's non-interleaved 1F1B schedule, with batched ``isend``/``irecv``; the
data-parallel group all-reduces the gradients at the end of the step.
"""

from __future__ import annotations

import argparse
from typing import Any


def groups(dist: Any, world: int, tp: int, pp: int) -> dict[str, Any]:
    """This rank's tensor- and data-parallel groups (Megatron's rank order)."""
    dp = world // (tp * pp)
    rank = dist.get_rank()
    mine: dict[str, Any] = {}
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
    return mine


def run(job: Any, torch: Any, dist: Any, a: argparse.Namespace, dp: int) -> None:
    class ReduceForward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:  # type: ignore[override]
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:  # type: ignore[override]
            return g, None

    class ReduceBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:  # type: ignore[override]
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:  # type: ignore[override]
            g = g.clone()
            dist.all_reduce(g, group=ctx.group)
            return g, None

    class Block(torch.nn.Module):
        def __init__(self, hidden: int, tp: int, group: Any) -> None:
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(hidden, 2 * hidden // tp) * 0.03)
            self.w2 = torch.nn.Parameter(torch.randn(2 * hidden // tp, hidden) * 0.03)
            self.group = group

        def forward(self, x: Any) -> Any:
            x = ReduceBackward.apply(x, self.group)
            h = torch.nn.functional.gelu(x @ self.w1) @ self.w2
            return ReduceForward.apply(h, self.group)

    rank, world = job.rank, job.world
    mine = groups(dist, world, a.tp, a.pp)
    stage = rank // (a.tp * dp)
    first, last = stage == 0, stage == a.pp - 1
    up, down = rank - a.tp * dp, rank + a.tp * dp  # the same (dp, tp) on the next stages
    blocks = torch.nn.ModuleList(Block(a.hidden, a.tp, mine["tp"]) for _ in range(2))
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    shape = (16, a.hidden)

    def exchange(send: tuple[Any, int] | None, recv_from: int | None) -> Any:
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

    inputs: dict[int, Any] = {}
    outputs: dict[int, Any] = {}

    def forward(mb: int, x: Any) -> Any:
        x = torch.randn(shape) if x is None else x
        x.requires_grad_(True)
        y = x
        for b in blocks:
            y = b(y)
        inputs[mb], outputs[mb] = x, y
        return y

    def backward(mb: int, grad: Any) -> Any:
        x, y = inputs.pop(mb), outputs.pop(mb)
        if last:
            y.pow(2).mean().backward()
        else:
            y.backward(grad)
        return x.grad

    m = a.microbatches
    for step in range(a.steps):
        warm = min(a.pp - stage - 1, m)
        for mb in range(warm):
            y = forward(mb, exchange(None, None if first else up))
            exchange(None if last else (y, down), None)
        x = exchange(None, None if first else up) if m - warm > 0 else None
        for i in range(m - warm):
            y = forward(warm + i, x)
            grad = exchange(None if last else (y, down), None if last else down)
            gx = backward(i, grad)
            if i == m - warm - 1:
                exchange(None if first else (gx, up), None)
            else:
                x = exchange(None if first else (gx, up), None if first else up)
        for i in range(m - warm, m):
            gx = backward(i, exchange(None, None if last else down))
            exchange(None if first else (gx, up), None)
        if dp > 1:
            flat = torch.cat([p.grad.flatten() for p in blocks.parameters()])
            dist.all_reduce(flat, group=mine["dp"])
        opt.step()
        opt.zero_grad()
        job.step_done(step, blocks, writes=rank // a.tp % dp == 0)
