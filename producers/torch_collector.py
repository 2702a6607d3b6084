"""PyTorch collector: every ``torch.distributed`` collective and point-to-point call.

One line in a training script (after ``init_process_group``)::

    from producers import torch_collector
    torch_collector.enable(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4)

or, with no code change, under torchrun::

    torchrun --nproc-per-node 8 -m producers.torch_collector train.py --args ...

(the layout then comes from ``MEGATRACE_TP``/``_PP``/``_DP``/``_EP``/``_LAYERS``/
``_MICROBATCHES`` or from Megatron's ``parallel_state`` when it is set up).

The collector wraps the ``torch.distributed`` functions (any backend: NCCL,
Gloo), so code must call them through the module (``dist.all_reduce``), as
Megatron does. Per call the hot path only takes two clock readings, bumps the
communicator's sequence number and appends a small list; a background thread
turns those into :class:`~schemas.records.Collective` records, emits a
:class:`~schemas.records.Heartbeat` per rank every ``heartbeat_s``, and hands
batches to the sink (the node agent's socket by default; it never blocks).
A call still unfinished after ``partial_after_s`` is also reported as joined
but not finished, so a hang shows who waits and who never came.

Checkpoints are seen too: ``torch.save`` and ``torch.distributed.checkpoint``'s
``save`` and ``async_save`` are wrapped (code must call them through their
modules; other checkpoint code can be marked, ``with torch_collector.saving():``),
and the heartbeats say how long the rank spent saving and since when
a save is under way (a heartbeat goes out as a save begins and as it ends). A
rank saving holds its peers up at their next collective, as a straggler or a
hang would; the detectors tell it apart by this.

Calls on CUDA tensors (NCCL) return to Python as soon as they are enqueued, so
their host times say nothing: :class:`~producers.torch_calls.GpuTimer` takes their arrival (the
stream reached the call) and end (the stream waited for NCCL) from CUDA
events, and such a call is finished only when the GPU is done with it.
With ``kernels=True`` the process's GPU kernels come too, through CUPTI.

Communicators get a stable hash from their member ranks, so every member
names a group the same way; a job torchrun started again (its restart count,
``TORCHELASTIC_RESTART_COUNT``, the same on every rank) gets new ones, as NCCL
makes new communicators: the calls of a restarted job, numbered from 0 again,
are not taken for its first start's. Point-to-point calls go on a two-rank
communicator per pair of ranks (the n-th Send from A to B meets the n-th Recv
at B from A). Roles (TP/PP/DP) follow the declared Megatron layout.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import Any

import msgspec

from producers.torch_recorder import Collector, CollectorError, Sink, torch_distributed


def default_sink() -> Sink:
    """The node agent's socket (``MEGATRACE_AGENT__SOCKET``; what it cannot take at once
    waits in the client's bounded backlog), or a JSON-lines file
    (``MEGATRACE_COLLECT_FILE``) the agent tails."""
    from schemas.codec import encode

    path = os.environ.get("MEGATRACE_COLLECT_FILE")
    if path:
        lock = threading.Lock()

        def to_file(records: list[msgspec.Struct]) -> None:
            with lock, open(path, "ab") as f:
                f.write(b"".join(encode(r) + b"\n" for r in records))

        return to_file
    from producers.agent_client import AgentClient

    client = AgentClient(os.environ.get("MEGATRACE_AGENT__SOCKET", ".megatrace/agent.sock"))
    atexit.register(client.close)  # what still waits for the agent's socket gets a moment
    return client.send


_active: Collector | None = None


def enable(
    job: str | None = None,
    *,
    sink: Sink | None = None,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    num_layers: int | None = None,
    num_microbatches: int | None = None,
    kernels: bool | None = None,
    distributed_optimizer: bool = False,
    ep: int | None = None,
    **kwargs: Any,
) -> Collector:
    """Start collecting in this process (after ``init_process_group``); idempotent.

    ``kernels`` (default: ``MEGATRACE_KERNELS=1``) also records the process's GPU
    kernels through CUPTI (``pip install 'megatrace[cupti]'``), NCCL kernels marked.
    """
    global _active
    if _active is not None:
        return _active
    env = os.environ
    job = job or env.get("MEGATRACE_JOB") or env.get("TORCHELASTIC_RUN_ID") or "torch-job"
    if kernels is None:
        kernels = env.get("MEGATRACE_KERNELS") == "1"
    col = Collector(job=job, sink=sink or default_sink(), kernels=kernels, **kwargs)
    layout = _megatron_layout() or {}
    told = (tp, pp, dp, num_layers, num_microbatches)
    if (
        not layout
        and all(x is None for x in told)
        and not any(k in env for k in ("MEGATRACE_TP", "MEGATRACE_PP", "MEGATRACE_DP"))
    ):  # nobody said: the job record claims no layout (the analysis learns it)
        col.declare(tp=1, pp=1, dp=1)
        _active = col.install()
        return col
    col.declare(
        tp=tp or int(env.get("MEGATRACE_TP", layout.get("tp", 1))),
        pp=pp or int(env.get("MEGATRACE_PP", layout.get("pp", 1))),
        dp=dp or (int(env["MEGATRACE_DP"]) if "MEGATRACE_DP" in env else None),
        num_layers=num_layers or int(env.get("MEGATRACE_LAYERS", 0)),
        num_microbatches=num_microbatches or int(env.get("MEGATRACE_MICROBATCHES", 1)),
        distributed_optimizer=distributed_optimizer,
        ep=ep or int(env.get("MEGATRACE_EP", layout.get("ep", 1))),
    )
    _active = col.install()
    return col


def step(n: int) -> None:
    """The step hook of the active collector (a no-op when none is enabled): call it at the
    end of every training iteration with the job's own number for it."""
    if _active is not None:
        _active.step_done(n)


def saving() -> contextlib.AbstractContextManager[None]:
    """Checkpoint code the collector does not wrap, as ``with torch_collector.saving():``
    (a file synced to disk, an upload; a no-op when no collector is enabled): its time is
    the rank's saving, as ``torch.save``'s is."""
    return _active.saving() if _active is not None else contextlib.nullcontext()


def disable() -> None:
    """Stop collecting; what was recorded is flushed to the sink."""
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None


def _megatron_layout() -> dict[str, int] | None:
    try:
        from megatron.core import parallel_state as ps  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not ps.model_parallel_is_initialized():
        return None
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        # (older releases have no expert parallelism)
        "ep": getattr(ps, "get_expert_model_parallel_world_size", lambda: 1)(),
    }


def _launch(argv: list[str]) -> None:
    """``-m producers.torch_collector script.py ...``: enable once the process group is up."""
    import runpy

    dist = torch_distributed()
    original = dist.init_process_group

    def init_then_enable(*args: Any, **kwargs: Any) -> Any:
        r = original(*args, **kwargs)
        enable()
        return r

    dist.init_process_group = init_then_enable
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m producers.torch_collector SCRIPT [ARGS...]")
    _launch(sys.argv[1:])


__all__ = ["Collector", "CollectorError", "disable", "enable", "saving", "step"]
