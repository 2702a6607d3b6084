"""A real torch.distributed job (Gloo, CPU) with PyTorch's Flight Recorder on, in which
some ranks never join a collective: every rank dumps its Flight Recorder ring as torch
writes it (``_dump_fr_trace``), to ``<out>/rank_<N>``.

Each rank runs ``python -m tests.fr_job`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
and TORCH_FR_BUFFER_SIZE (the Flight Recorder's ring: off when 0) set.
The job: a data-parallel all-reduce and a tensor-parallel pair's all-reduce, over groups
of their own, for a few steps; at ``--hang-step`` the ``--skip`` ranks never join
the data-parallel all-reduce, and the others give up on it after ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hang-step", type=int, default=4)
    p.add_argument("--skip", type=int, nargs="*", default=[])
    p.add_argument("--timeout-s", type=float, default=3.0)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout_s))
    dp = dist.new_group(list(range(world)), group_desc="data_parallel")
    pairs = [dist.new_group([r, r + 1], group_desc="tensor_parallel") for r in range(0, world, 2)]
    tp = pairs[rank // 2]
    grad, act = torch.ones(4096), torch.ones(1024)
    try:
        for step in range(a.steps):
            for _ in range(2):  # forward and backward of one layer
                dist.all_reduce(act, group=tp)
                time.sleep(0.002)
            if step == a.hang_step and rank in a.skip:
                break  # never joins this step's gradient all-reduce
            dist.all_reduce(grad, group=dp)
    except RuntimeError:
        pass  # the peers that never came: Gloo gives up after the timeout
    time.sleep(0.5 if rank in a.skip else 0.0)
    dump = torch._C._distributed_c10d._dump_fr_trace(
        includeCollectives=True, includeStackTraces=False, onlyActive=False
    )
    Path(a.out, f"rank_{rank}").write_bytes(dump)
    os._exit(0)  # Gloo's teardown would wait on the peers that left


if __name__ == "__main__":
    main()
