"""One rank of a real training job for the fault lab: ``python -m producers.lab.job``.

Every workload trains a small model with real CPU compute (so a CPU quota on the rank's
process really slows it), over Gloo, with the PyTorch collector on and its step hook
called at every iteration's end:

* ``ddp``: PyTorch's DistributedDataParallel itself, buckets small enough to make a
  number of them that is not round, reduced through its stock all-reduce communication
  hook (``torch.distributed.algorithms.ddp_comm_hooks``);
* ``zero``: sharded data parallelism as FSDP and ZeRO do it: parameters all-gathered
  before the forward pass, gradients reduce-scattered after the backward pass, each
  rank stepping its own shard;
* ``megatron``: Megatron-style tensor x pipeline x data parallelism: two TP all-reduces
  per layer each way, 1F1B over micro-batches with batched send/receive between
  stages, a DP all-reduce of the gradients;
* ``custom``: a job shaped like nothing megatrace knows and told no layout: gradient
  accumulation over micro-steps, a metrics all-reduce every few steps, a validation
  pass every ten;
* ``moe``: a mixture of experts, expert parallelism carved out of data parallelism:
  two all-to-alls per MoE layer each way, the dense gradients all-reduced over every
  rank and each expert's over the ranks holding the same expert.

With ``MEGATRACE_LAB_FR`` (a directory) and ``TORCH_FR_BUFFER_SIZE`` set, the rank keeps
PyTorch's Flight Recorder ring and dumps it, as the installed torch writes it, to
``rank_<N>`` there when the job fails (its peers are gone) or when the lab asks (a file
``dump`` appears: a hung job, as a watchdog does at its timeout).

With ``--checkpoint-every K`` the job saves a checkpoint every K steps, as PyTorch's
DDP tutorial and Megatron do: the ranks that hold a copy nobody else writes (DDP's rank
0; each Megatron stage's and tensor slice's first data-parallel rank) write theirs to a
file, synced to disk, and every rank then waits at a barrier. ``--checkpoint-mb`` pads
what it writes, standing for a real model's state: a real job's save takes many of its
steps, as the lab's does with the padding (half a gigabyte a second to this disk).

``--start-step`` starts the training loop at that step (DDP): a job the lab starts again
after a rank was killed, from its last checkpoint, as torchrun does.

Rank 0 writes the step it is at to ``--progress`` (the lab injects faults by it). The
process's environment gives its rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``), node (``MEGATRACE_NODE``) and the node
agent's socket (``MEGATRACE_AGENT__SOCKET``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

WORKLOADS = ("ddp", "zero", "megatron", "custom", "moe")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="producers.lab.job")
    p.add_argument("--workload", choices=WORKLOADS, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--progress", type=Path)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--checkpoint-mb", type=int, default=96)
    p.add_argument("--start-step", type=int, default=0)
    return p.parse_args(argv)


class FlightRecorder:
    """The rank's Flight Recorder ring, dumped once: when the lab asks, or the job fails."""

    def __init__(self, rank: int, directory: Path) -> None:
        self.path = directory / f"rank_{rank}"
        self.ask = directory / "dump"
        self._lock = threading.Lock()
        threading.Thread(target=self._wait, name="megatrace-fr", daemon=True).start()

    def _wait(self) -> None:
        while not self.ask.exists():
            time.sleep(0.1)
        self.dump()

    def dump(self) -> None:
        import torch

        with self._lock:
            if self.path.exists():
                return
            raw = torch._C._distributed_c10d._dump_fr_trace(
                includeCollectives=True, includeStackTraces=False, onlyActive=False
            )
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(raw)
            os.replace(tmp, self.path)


#: this rank's recorder, where the lab keeps one
RECORDER: FlightRecorder | None = None


class Job:
    """What every workload shares: the process group, the collector, the step hook."""

    def __init__(self, a: argparse.Namespace, layout: dict[str, int] | None) -> None:
        import torch
        import torch.distributed as dist

        from producers import torch_collector

        torch.set_num_threads(1)  # ranks share two cores: no spinning OpenMP threads
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        self.torch, self.dist, self.collector = torch, dist, torch_collector
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.args = a
        node = os.environ.get("MEGATRACE_NODE")
        torch_collector.enable(a.job, node=node, heartbeat_s=0.25, **(layout or {}))
        torch.manual_seed(1234 + self.rank)
        fr = os.environ.get("MEGATRACE_LAB_FR")
        if fr and int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) > 0:
            global RECORDER
            RECORDER = FlightRecorder(self.rank, Path(fr))

    def step_done(self, step: int, state: Any = None, writes: bool = False) -> None:
        """The step's end: the collector's step hook, then a checkpoint of ``state`` (a
        module or optimizer whose state dict it saves; written by this rank if
        ``writes``) where one is due."""
        self.collector.step(step)
        a = self.args
        if a.checkpoint_every and state is not None and (step + 1) % a.checkpoint_every == 0:
            self.save(state, writes)
        if self.rank == 0 and a.progress is not None:
            tmp = a.progress.with_suffix(".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, a.progress)

    def save(self, state: Any, writes: bool) -> None:
        torch = self.torch
        if writes:  # the whole routine marked, as checkpoint code of a job's own should be
            path = Path(tempfile.gettempdir()) / f"megatrace-lab-{self.args.job}-{self.rank}.pt"
            tmp = path.with_suffix(".tmp")
            with self.collector.saving(), open(tmp, "wb") as f:
                pad = torch.zeros(self.args.checkpoint_mb << 18)  # float32: 4 bytes each
                torch.save({"state": state.state_dict(), "rest": pad}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self.saved = path
        self.dist.barrier()

    #: the checkpoint this rank wrote, removed when the job ends
    saved: Path | None = None

    def close(self) -> None:
        if self.saved is not None:
            self.saved.unlink(missing_ok=True)
        self.collector.disable()
        self.dist.destroy_process_group()


def _mlp(torch: Any, hidden: int, layers: int = 3) -> Any:
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def ddp(a: argparse.Namespace) -> None:
    job = Job(a, {"tp": 1, "pp": 1, "dp": int(os.environ["WORLD_SIZE"])})
    torch = job.torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    model = _mlp(torch, a.hidden)
    # about 0.6 MB a layer: buckets of 0.7 MB make a number of them that is not round
    net = DistributedDataParallel(model, bucket_cap_mb=0.7)
    net.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for step in range(a.start_step, a.steps):  # (a restart's: from its checkpoint's step)
        x = torch.randn(64, a.hidden)
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        job.step_done(step, net, writes=job.rank == 0)
    job.close()


def zero(a: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    job = Job(a, {"tp": 1, "pp": 1, "dp": world, "distributed_optimizer": True})
    torch, dist = job.torch, job.dist
    model = _mlp(torch, a.hidden)
    params = list(model.parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    n = -(-flat.numel() // job.world) * job.world  # padded to a multiple of the world
    full = torch.zeros(n)
    full[: flat.numel()] = flat
    shard = full.chunk(job.world)[job.rank].clone()
    sizes = [p.numel() for p in params]
    # the single-tensor forms, by their newer names where this torch has them
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for step in range(a.steps):
        gathered = torch.empty(n)
        all_gather(gathered, shard)  # the parameters, before the forward
        with torch.no_grad():
            for p, chunk in zip(params, gathered[: flat.numel()].split(sizes), strict=True):
                p.copy_(chunk.view_as(p))
        model(torch.randn(64, a.hidden)).pow(2).mean().backward()
        grads = torch.zeros(n)
        grads[: flat.numel()] = torch.cat([p.grad.flatten() for p in params])
        mine = torch.empty(n // job.world)
        reduce_scatter(mine, grads)  # each rank keeps its shard's gradient
        shard -= 1e-3 * mine / job.world
        model.zero_grad()
        job.step_done(step)
    job.close()


def custom(a: argparse.Namespace) -> None:
    job = Job(a, None)  # told no layout
    torch, dist = job.torch, job.dist
    model = _mlp(torch, a.hidden, layers=2)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    for step in range(a.steps):
        for _ in range(3):  # gradient accumulation: no communication until the last
            model(torch.randn(32, a.hidden)).pow(2).mean().backward()
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat)
        opt.step()
        opt.zero_grad()
        if step % 4 == 3:  # metrics: the loss averaged over the ranks
            dist.all_reduce(torch.tensor([float(step)]))
        if step % 10 == 9:  # a validation pass, then everyone waits
            with torch.no_grad():
                val = model(torch.randn(256, a.hidden)).pow(2).mean()
            dist.all_reduce(val.reshape(1))
            dist.barrier()
        job.step_done(step)
    job.close()


def megatron(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    dp = world // (a.tp * a.pp)
    job = Job(
        a,
        {"tp": a.tp, "pp": a.pp, "dp": dp, "num_layers": a.pp, "num_microbatches": a.microbatches},
    )
    from producers.lab.megatron import run

    run(job, torch, dist, a, dp)
    job.close()


def moe(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    job = Job(a, {"tp": 1, "pp": 1, "dp": world, "ep": a.ep, "num_layers": 2})
    from producers.lab.moe import run

    run(job, torch, dist, a, a.ep)
    job.close()


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    workloads = {"ddp": ddp, "zero": zero, "megatron": megatron, "custom": custom, "moe": moe}
    try:
        workloads[a.workload](a)
    except Exception:
        if RECORDER is not None:  # the job failed (a peer is gone): what its ring holds
            RECORDER.dump()
        raise


if __name__ == "__main__":
    main()
