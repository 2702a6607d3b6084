"""A mixture-of-experts model for the lab, with real compute: expert parallelism as
Megatron carves it out of data parallelism.

The ranks split into expert-parallel groups of ``ep`` consecutive ranks; in each MoE
layer every rank holds one expert. A layer routes each token to its top-1 expert and
dispatches the tokens to their experts' ranks with an all-to-all, at a fixed capacity
per expert as capacity-factor MoE does (a surplus is dropped, a shortfall padded); the
rank runs its expert on what it received, and a second all-to-all brings the results
back. The backward pass does both again, in reverse. The dense layers' and routers'
gradients are all-reduced over every rank, each expert's over the ranks that hold the
same expert (Megatron's expert-data-parallel group).
"""

from __future__ import annotations

import argparse
from typing import Any

#: tokens an expert takes, over an even share of the batch
CAPACITY_FACTOR = 1.25


def groups(dist: Any, world: int, ep: int) -> dict[str, Any]:
    """This rank's expert-parallel and expert-data-parallel groups (every rank makes
    every group, in the same order, as ``new_group`` requires)."""
    rank = dist.get_rank()
    mine: dict[str, Any] = {}
    for g in range(world // ep):
        ranks = list(range(g * ep, (g + 1) * ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ep"] = group
    for e in range(ep):
        ranks = list(range(e, world, ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["edp"] = group if len(ranks) > 1 else None
    return mine


def run(job: Any, torch: Any, dist: Any, a: argparse.Namespace, ep: int) -> None:
    class AllToAll(torch.autograd.Function):
        """The tokens' exchange; its gradient goes back the same way."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:  # type: ignore[override]
            ctx.group = group
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x.contiguous(), group=group)
            return out

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:  # type: ignore[override]
            out = torch.empty_like(g)
            dist.all_to_all_single(out, g.contiguous(), group=ctx.group)
            return out, None

    class MoE(torch.nn.Module):
        def __init__(self, hidden: int, group: Any, capacity: int) -> None:
            super().__init__()
            self.router = torch.nn.Linear(hidden, ep)
            self.expert = torch.nn.Sequential(
                torch.nn.Linear(hidden, 2 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(2 * hidden, hidden),
            )
            self.group, self.capacity = group, capacity

        def forward(self, x: Any) -> Any:
            gate, choice = torch.softmax(self.router(x), dim=-1).max(dim=-1)
            c, pad = self.capacity, x.new_zeros(self.capacity, x.shape[1])
            taken = [torch.nonzero(choice == e).flatten()[:c] for e in range(ep)]
            slots = torch.cat([torch.cat([x[i], pad[: c - len(i)]]) for i in taken])
            done = AllToAll.apply(self.expert(AllToAll.apply(slots, self.group)), self.group)
            index = torch.cat(taken)
            back = torch.cat([done[e * c : e * c + len(i)] for e, i in enumerate(taken)])
            return x + torch.zeros_like(x).index_add(0, index, back * gate[index, None])

    rank, world = job.rank, job.world
    mine = groups(dist, world, ep)
    tokens = 64
    capacity = int(CAPACITY_FACTOR * tokens / ep + 0.5)
    dense = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU()) for _ in range(2)
    )
    moe = torch.nn.ModuleList(MoE(a.hidden, mine["ep"], capacity) for _ in range(2))
    shared = list(dense.parameters()) + [p for m in moe for p in m.router.parameters()]
    experts = [p for m in moe for p in m.expert.parameters()]
    opt = torch.optim.SGD(shared + experts, lr=1e-3)
    torch.manual_seed(4321 + rank)
    for step in range(a.steps):
        y = torch.randn(tokens, a.hidden)
        for d, m in zip(dense, moe, strict=True):
            y = m(d(y))
        y.pow(2).mean().backward()
        flat = torch.cat([p.grad.flatten() for p in shared])
        dist.all_reduce(flat)  # the dense layers and routers: every rank's
        if mine["edp"] is not None:  # each expert: the ranks holding the same one
            flat = torch.cat([p.grad.flatten() for p in experts])
            dist.all_reduce(flat, group=mine["edp"])
        opt.step()
        opt.zero_grad()
        job.step_done(step)
