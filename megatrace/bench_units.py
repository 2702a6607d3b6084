"""``megatrace bench`` of one component alone: the simulator's generation
(``simulate``), the job worker at scale (``analyze``), the PyTorch collector's hot path
(``collector``) and the NCCL plugin's event handling (``plugin``). The pipeline as a whole
is :mod:`megatrace.bench`'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from megatrace.cli_base import tune_gc
from producers.sim.scenarios import build
from schemas.codec import encode


def simulate(scales: list[str], steps: int, say: Callable[[str], None]) -> None:
    """Generation throughput per scale: the columnar engine, records, and encoded bytes."""
    from producers.sim.emit import Emitter
    from producers.sim.engine import Engine
    from producers.sim.scenarios import scale_spec

    say(
        f"{'scale':<8} {'ranks':>6} {'events/step':>12} {'engine ev/s':>13} "
        f"{'records/s':>11} {'encoded rec/s':>14}"
    )
    for scale in scales:
        engine = Engine(scale_spec(scale))
        emitter = Emitter(engine)
        n_ev = t_eng = t_rec = t_enc = 0.0
        n_rec = 0
        for _ in range(steps):
            t0 = time.perf_counter()
            tr = engine.step()
            t1 = time.perf_counter()
            recs = list(emitter.step_records(tr))
            t2 = time.perf_counter()
            for r in recs:
                encode(r)
            t3 = time.perf_counter()
            n_ev += (
                len(tr.colls["rank"])
                + len(tr.proxies["rank"])
                + len(tr.kernels["rank"])
                + (len(tr.links["src"]) + engine.spec.world_size)
            )
            n_rec += len(recs)
            t_eng, t_rec, t_enc = t_eng + t1 - t0, t_rec + t2 - t0, t_enc + t3 - t0
        say(
            f"{scale:<8} {engine.spec.world_size:>6} {n_ev / steps:>12,.0f} {n_ev / t_eng:>13,.0f} "
            f"{n_rec / t_rec:>11,.0f} {n_rec / t_enc:>14,.0f}"
        )


def analyze(scale: str, steps: int, say: Callable[[str], None], poll: int = 5000) -> None:
    """Cost of the detectors per training step at a scale, in one process, by stage.

    Records go through the flow's stages (:class:`~detectors.route.Route`) as the flow
    batches them (each key's share of a poll of ``poll`` records is one batch): per
    communicator (alignment and folding into step parts), per shard of the
    communicators (merging their parts) and per node (link monitors), all parallel
    across workers, then per job (merging parts and digests, heartbeats, step
    analysis: one worker per job); the route's hook times each stage.
    """
    from detectors.route import Route
    from schemas.results import StepSummary

    tune_gc()  # as the flow does
    run = build("slow-gpu", scale=scale, seed=0, steps=steps, kernels=False)
    records = list(run.records())
    spent = dict.fromkeys(("schedule", "comm", "shard", "node", "job", "timers"), 0.0)
    to_job = 0
    step_s: list[float] = []  # job updates that closed a step
    warm = min(2, steps // 2)  # the first steps: every communicator heard from the first time
    at_warm = [0.0, 0]  # the job's time and items when the warm-up steps closed

    def hook(stage: str, seconds: float, outputs: list[Any]) -> None:
        nonlocal to_job
        spent[stage] += seconds
        if stage != "job":
            return
        to_job += 1
        if any(isinstance(o, StepSummary) for o in outputs):
            step_s.append(seconds)
            if len(step_s) == warm:
                at_warm[:] = [spent["job"], to_job]

    route = Route(poll=poll, hook=hook)
    for rec in records:
        route.update(rec)
    route.finish()
    n = run.steps
    med = sorted(step_s)[len(step_s) // 2] if step_s else 0.0
    steady = max(1, n - warm)
    shards = route.settings.part_shards

    def ms(stage: str) -> str:
        return f"{spent[stage] / n * 1e3:9.1f} ms/step"

    say(
        f"{scale}: {run.spec.world_size} ranks, {len(records) / n:,.0f} records per step, "
        f"{len(route.comms):,} communicators; after {warm} steps the job's worker is called "
        f"{(to_job - at_warm[1]) / steady:,.0f} times a step ({to_job / n:,.0f} over all: a "
        "poll's items from its communicators and nodes at once, each record of its own)"
    )
    say(f"  per communicator: alignment + folding (all communicators,  {ms('comm')}")
    say("    parallel across flow workers)")
    say(f"  per shard: merging the communicators' step parts         {ms('shard')}")
    say(f"    ({shards} shards, parallel across flow workers)")
    say(f"  per node: link monitors (all nodes,                      {ms('node')}")
    say("    parallel across flow workers)")
    say(
        f"  per job: merging parts + step analysis + other records   "
        f"{(spent['job'] - at_warm[0]) / steady * 1e3:9.1f} ms/step\n"
        f"    after {warm} steps ({spent['job'] / n * 1e3:.1f} over all: the first ones merge a\n"
        f"    part per communicator, heard from for the first time)"
    )
    say(f"  timers: hang watchdog, communicators' expiry             {ms('timers')}")
    say(f"  schedule book (job metadata, iteration markers)          {ms('schedule')}")
    say(
        f"  a job update that closed a step (its last part merged,   {med * 1e3:9.1f} ms median, "
        f"{max(step_s, default=0) * 1e3:.1f} ms max"
    )
    say("   change points, critical path, localisation, tables)")


def collector(calls: int, say: Callable[[str], None]) -> None:
    """Cost of the PyTorch collector per call, in this process (a one-rank Gloo group)."""
    import socket

    import torch
    import torch.distributed as dist

    from producers.torch_collector import Collector

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    sent = [0]

    def sink(records: list) -> None:  # what the agent client does, minus the socket
        sent[0] += len([encode(r) for r in records])

    col = Collector(job="bench", sink=sink, flush_s=0.05)
    col.declare()
    t = torch.ones(1024)

    def per_call(fn: Callable[[], object], n: int = calls) -> float:
        for _ in range(min(1000, n)):
            fn()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        return (time.perf_counter_ns() - t0) / n

    def noop(*_: object, **__: object) -> None:
        return None

    wrapped = col._collective("all_reduce", noop)
    bare_noop = per_call(lambda: noop(t))
    hot_path = per_call(lambda: (wrapped(t), col._pending.clear())) - bare_noop
    for _ in range(10_000):
        wrapped(t)
    t0 = time.perf_counter_ns()
    n = len(col.drain())
    drain = (time.perf_counter_ns() - t0) / max(n, 1)
    plain = per_call(lambda: dist.all_reduce(t))
    col.install()  # the background thread drains every 50 ms, as in a job
    traced = per_call(lambda: dist.all_reduce(t))
    col.uninstall()
    dist.destroy_process_group()
    say(f"PyTorch collector, {calls} calls each (one-rank Gloo group, 1024 floats)")
    say(f"{'what':<46}{'per call':>12}")
    say(f"{'hot path (wrapper around a no-op)':<46}{hot_path / 1000:>10.2f}µs")
    say(f"{'Gloo all_reduce without the collector':<46}{plain / 1000:>10.2f}µs")
    say(f"{'Gloo all_reduce with the collector':<46}{traced / 1000:>10.2f}µs")
    say(f"{'added to the caller':<46}{(traced - plain) / 1000:>10.2f}µs")
    say(f"{'record building, background thread':<46}{drain / 1000:>10.2f}µs")
    say(f"({sent[0]} records built and encoded by the background thread)")


def plugin(events: int, say: Callable[[str], None]) -> None:
    """Cost of the NCCL profiler plugin's entry points, timed in C (no ctypes in the loop)."""
    import ctypes
    import tempfile
    from pathlib import Path

    from producers.nccl_plugin import build

    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.CDLL(str(build(Path(tmp))))
        out = (ctypes.c_double * 4)()
        lib.megatrace_profiler_bench(events, out)
        stats = (ctypes.c_uint64 * 3)()
        lib.megatrace_profiler_stats(stats)
    say(f"NCCL profiler plugin, {events} events (v5 and v7 entry points, timed in C)")
    say(f"{'what':<58}{'per event':>12}")
    say(f"{'proxy-step state change (recordEventState)':<58}{out[0]:>10.1f}ns")
    say(f"{'proxy step: start, SendGPUWait, SendWait, stop':<58}{out[1]:>10.1f}ns")
    say(f"{'collective: call, 2 proxy ops x 4 steps, kernel channel':<58}{out[2]:>10.1f}ns")
    say(f"{'v7 kernel phase: start, GPU-timed stop, stop (opt-in)':<58}{out[3]:>10.1f}ns")
    say(
        f"(target: < 100 ns per state change; {stats[0]} events seen, {stats[1]} records sent,"
        f" {stats[2]} dropped: no agent listening here)"
    )


__all__ = ["analyze", "collector", "plugin", "simulate"]
