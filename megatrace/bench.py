"""``megatrace bench pipeline``: raw consume+decode vs the dataflow in each role, and latency.

Composition only: the simulator makes the records, the publisher sends them,
the flow processes them; this module times the three and prints a table.
"""

from __future__ import annotations

import functools
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from detectors.align import core_name as align_core
from flows.main import Decoded, Role, build_flow, flow_config, rows_of
from infra.clickhouse import Rows, init_db, insert_rows
from infra.kafka import consumer_config, delete_topics, ensure_topics, producer_config
from infra.rowbinary import core_name as rows_core
from infra.stack import Stack
from megatrace.cli_base import tune_gc
from producers.publish import KafkaPublisher
from producers.sim.scenarios import build
from schemas.codec import decode, encode
from schemas.config import Settings
from schemas.topics import Topics


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_now_mb() -> float | None:
    """The process's resident memory now (not its peak), or None off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


class _Probe:
    """Collects (records, produced ms, stored ms) from the ClickHouse sink, and the
    process's resident memory after each insert."""

    def __init__(self) -> None:
        self.n = 0
        self.lat: list[tuple[int, int]] = []
        self.rss: list[tuple[int, float]] = []  # (records stored so far, MB resident)

    def __call__(self, count: int, produced_ms: int, stored_ms: int) -> None:
        self.n += count
        if produced_ms > 0:
            self.lat.append((stored_ms - produced_ms, count))
        if (mb := _rss_now_mb()) is not None:
            self.rss.append((self.n, mb))

    def rss_at(self, share: float) -> float | None:
        """Resident MB once ``share`` of the records seen were stored (None: unknown)."""
        return next((mb for n, mb in self.rss if n >= share * self.n), None)

    def rss_row(self) -> tuple[str, str]:
        """Resident memory at a quarter, half and all of the run, and its growth over the
        second half (a flow whose state is bounded stays flat once warm).

        >>> p = _Probe()
        >>> p.rss = [(100, 900.0), (250, 1000.0), (500, 1100.0), (1000, 1210.0)]
        >>> p.n = 1000
        >>> p.rss_row()
        ('1,000 / 1,100 / 1,210 MB', '+10.0% over the second half')
        """
        known = [mb for q in (0.25, 0.5, 1.0) if (mb := self.rss_at(q)) is not None]
        if len(known) < 3:
            return "unknown (no /proc)", ""
        quarter, half, end = known
        growth = f"{end / half - 1:+.1%} over the second half"
        return f"{quarter:,.0f} / {half:,.0f} / {end:,.0f} MB", growth

    def percentile(self, q: float) -> float:
        if not self.lat:
            return float("nan")
        v = np.repeat([x for x, _ in self.lat], [c for _, c in self.lat])
        return float(np.percentile(v, q))


@dataclass(frozen=True)
class _Cpu:
    """CPU seconds a run took: the flow's own thread (every Python step runs there), the
    rest of its process (the embedded ClickHouse engine's threads, the Kafka client's,
    the insert threads) and the local broker's process (None: not known)."""

    flow: float
    rest: float
    broker: float | None

    def per_record(self, n: int) -> str:
        us = 1e6 / max(1, n)
        broker = "" if self.broker is None else f", broker {self.broker * us:.1f}"
        return f"flow thread {self.flow * us:.1f}, rest of the process {self.rest * us:.1f}{broker}"


def _process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux), or None."""
    if pid is None:
        return None
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one read of a tiny file
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_meter(stack: Stack) -> Callable[[], _Cpu]:
    """Start counting CPU in this thread, this process and the local broker; the returned
    function says what was spent since."""
    info = stack.broker.status() if stack.uses_local_broker else None
    pid = None if info is None else info.pid
    b0, c0, p0 = _process_cpu_s(pid), time.thread_time(), time.process_time()

    def spent() -> _Cpu:
        c1, p1, b1 = time.thread_time(), time.process_time(), _process_cpu_s(pid)
        broker = None if b0 is None or b1 is None else b1 - b0
        return _Cpu(c1 - c0, (p1 - p0) - (c1 - c0), broker)

    return spent


def _raw_consume(
    settings: Settings, stack: Stack, topics: list[str], n: int
) -> tuple[float, _Cpu, float]:
    """Records/s of a bare consumer that decodes each record, the CPU it took, and the
    seconds until its first record (counted apart, as the flow's start-up is)."""
    from confluent_kafka import Consumer, TopicPartition

    cpu = _cpu_meter(stack)
    begun = time.perf_counter()
    c = Consumer(consumer_config(settings.kafka, stack.bootstrap()))
    meta = c.list_topics(timeout=10)
    c.assign([TopicPartition(t, p, 0) for t in topics for p in meta.topics[t].partitions])
    got = 0
    t0 = 0.0  # from the first message read, as the flow's rate is (see ``_flow``)
    deadline = time.perf_counter() + 300
    while got < n and time.perf_counter() < deadline:
        for m in c.consume(5000, timeout=0.2):
            if m.error() is None:
                t0 = t0 or time.perf_counter()
                decode(m.value())
                got += 1
    dt = time.perf_counter() - t0
    c.close()
    return got / dt, cpu(), t0 - begun


def _engine_alone(
    settings: Settings, stack: Stack, database: str, rows: dict[str, Rows]
) -> tuple[float, _Cpu, float]:
    """Rows/s of ClickHouse parsing the raw rows and nothing else, the CPU it took (the
    embedded engine's and the encoder's are this process's) and 0.0 (no start-up): each
    raw table's rows inserted as the raw sink inserts them (encoded as it encodes them,
    ``batch_rows`` at a time), into a ``Null``
    copy of the table (parsed, then thrown away: no part written, nothing to merge). One
    insert thread does the raw sink's inserts one after another, so a role that stores
    the raw rows cannot store more rows/s than this with the same engine."""
    client = stack.clickhouse()
    db = f"{database}_engine{time.time_ns() % 10**6}"
    init_db(client, db, 1)
    for table in rows:
        client.command(f"CREATE TABLE {db}.{table}_null AS {db}.{table} ENGINE = Null")
    step = settings.clickhouse.batch_rows
    cpu = _cpu_meter(stack)
    t0 = time.perf_counter()
    for table, batch in rows.items():
        for i in range(0, len(batch), step):
            insert_rows(client, db, table, batch[i : i + step], into=f"{table}_null")
    dt = time.perf_counter() - t0
    spent = cpu()
    client.command(f"DROP DATABASE IF EXISTS {db} SYNC")
    return sum(map(len, rows.values())) / dt, spent, 0.0


def _flow_rate(
    settings: Settings, stack: Stack, topics: Topics, database: str, role: Role, n: int
) -> tuple[float, _Cpu, float]:
    """One bounded flow of ``role`` over ``n`` records: as :func:`_raw_consume` measures."""
    busy, start, cpu = _flow(settings, stack, topics, None, database, role=role)
    return n / busy, cpu, start


def _flow(
    settings: Settings,
    stack: Stack,
    topics: Topics,
    probe: _Probe | None,
    database: str,
    idle_s: float = 2.0,
    role: Role = Role.ALL,
) -> tuple[float, float, _Cpu]:
    """Run one bounded flow into a database of its own; return (its busy seconds, its
    start-up seconds, the CPU it took).

    Busy is from its first record read until its last raw row was stored, or until the
    final quiet wait began when that was later: the steady rate, as the raw rate is
    counted from its first message (raw rows are inserted off the flow's thread, and may
    still be going in during that wait). Start-up (building a consumer per topic
    partition, their first fetch: about 0.1 s here) is paid once per process and
    reported apart. Each run gets an empty database, dropped afterwards, so that no run
    pays for the background merges of an earlier one's parts."""
    from bytewax.testing import run_main

    first = [0.0]
    stored = [0.0]

    def on_read(count: int) -> None:
        first[0] = first[0] or time.perf_counter()

    def on_stored(count: int, produced_ms: int, stored_ms: int) -> None:
        stored[0] = time.perf_counter()
        if probe is not None:
            probe(count, produced_ms, stored_ms)

    db = f"{database}_{role.value}{time.time_ns() % 10**6}"
    init_db(stack.clickhouse(), db, 1)
    cfg = flow_config(
        settings,
        stack.bootstrap(),
        stack.clickhouse_url(),
        topics=topics,
        database=db,
        tail=False,
        idle_stop_s=idle_s,
        console=False,
        on_stored=on_stored,
        on_read=on_read,
        role=role,
    )
    flow = build_flow(cfg)
    spent = _cpu_meter(stack)
    t0 = time.perf_counter()
    run_main(flow)  # in this thread: Bytewax runs a single worker's steps on its caller's
    t1 = time.perf_counter()
    cpu = spent()
    end = max(t1 - idle_s, stored[0])
    stack.clickhouse().command(f"DROP DATABASE IF EXISTS {db} SYNC")
    start = (first[0] or end) - t0
    return max(1e-9, end - t0 - start), start, cpu


def pipeline(
    settings: Settings,
    *,
    steps: int,
    scale: str,
    rate: int,
    seconds: float,
    say: Callable[[str], None],
    repeat: int = 3,
) -> None:
    """Raw consume+decode, ClickHouse parsing the raw rows alone, then the flow in each
    role on the same records, then latency.

    Each throughput is measured ``repeat`` times, alternating, and the best is kept (a
    shared machine moves single runs): the ratios are best against best, and each row
    shows the range. Every measure runs with the garbage collector settings of every
    command (:func:`~megatrace.cli_base.tune_gc`), the raw consumer's too, so that raw
    and the roles are measured alike. Its topics are deleted afterwards: the local
    broker keeps what it holds in memory, and each run publishes some 700,000 records;
    a local broker it started is stopped (a bounded command leaves no process behind)."""
    tune_gc()
    stack = Stack(settings)
    _, started = stack.up()
    try:
        _bench_on(stack, settings, steps, scale, rate, seconds, repeat, say)
    finally:
        if started:
            stack.down()


def _bench_on(
    stack: Stack,
    settings: Settings,
    steps: int,
    scale: str,
    rate: int,
    seconds: float,
    repeat: int,
    say: Callable[[str], None],
) -> None:
    boot = stack.bootstrap()
    prefix = f"bench{time.time_ns() % 10**9}."
    made = [Topics(prefix=prefix), Topics(prefix=f"{prefix}lat.")]
    try:
        for topics in made:
            ensure_topics(settings.kafka, boot, topics)
        rows = _pipeline(
            settings,
            stack,
            made,
            steps=steps,
            scale=scale,
            rate=rate,
            seconds=seconds,
            repeat=repeat,
            say=say,
        )
    finally:
        for topics in made:
            delete_topics(settings.kafka, boot, topics)
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    for a, b, c in rows:
        say(f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip())


def _pipeline(
    settings: Settings,
    stack: Stack,
    made: list[Topics],
    *,
    steps: int,
    scale: str,
    rate: int,
    seconds: float,
    repeat: int,
    say: Callable[[str], None],
) -> list[tuple[str, str, str]]:
    """The measurements of :func:`pipeline`, as its table's rows, on its two topic sets."""
    boot = stack.bootstrap()
    database = f"{settings.clickhouse.database}_bench"
    topics, topics2 = made
    run = build("healthy", scale=scale, seed=0, steps=steps, now=True)
    recs = list(run.records())
    n = len(recs)
    n_detect = sum(topics.for_record(r) != topics.kernel for r in recs)
    say(
        f"{n:,} records of a {run.spec.world_size}-rank job ({n - n_detect:,} kernel records), "
        f"{settings.kafka.partitions} partitions per topic; alignment core: {align_core()}; rows: "
        f"{rows_core()}"
    )
    pub = KafkaPublisher(producer_config(settings.kafka, boot), topics)
    t0 = time.perf_counter()
    pub.publish_all(recs)
    pub.flush()
    produce_rate = n / (time.perf_counter() - t0)
    detect_topics = [t for t in topics.inputs if t != topics.kernel]
    # the raw rows per table as the flow hands them to its sink (one poll of them all)
    _, (raw_rows, _) = rows_of(
        Decoded(recs, list(map(encode, recs)), [], 0, frozenset(map(type, recs)))
    )
    # name -> () -> (records/s, CPU, seconds to the first record read)
    measures: dict[str, Callable[[], tuple[float, _Cpu, float]]] = {
        "raw": functools.partial(_raw_consume, settings, stack, list(topics.inputs), n),
        "raw detect": functools.partial(_raw_consume, settings, stack, detect_topics, n_detect),
        "engine": functools.partial(_engine_alone, settings, stack, database, raw_rows),
    }
    roles = ((Role.ALL, n, "raw"), (Role.STORE, n, "raw"), (Role.DETECT, n_detect, "raw detect"))
    for role, count, _ in roles:
        measures[role.value] = functools.partial(
            _flow_rate, settings, stack, topics, database, role, count
        )
    runs: dict[str, list[tuple[float, _Cpu, float]]] = {name: [] for name in measures}
    rss0 = _rss_mb()
    for i in range(repeat):
        for name, measure in measures.items():
            say(f"{name}, run {i + 1} of {repeat} ...")
            runs[name].append(measure())
    best = {name: max(r, key=lambda x: x[0]) for name, r in runs.items()}

    def spread(name: str) -> str:
        rates = sorted(r[0] for r in runs[name])
        return f"best of {len(rates)} ({rates[0]:,.0f}-{rates[-1]:,.0f})"

    rows = [("produce (idempotent producer)", f"{produce_rate:,.0f} records/s", "")]
    for name, what, count in (
        ("raw", "every input topic", n),
        ("raw detect", "the detect role's topics", n_detect),
    ):
        rows += [
            (
                f"raw consume + decode, {what}",
                f"{best[name][0]:,.0f} records/s",
                f"{spread(name)}; first record read after {best[name][2]:.2f} s",
            ),
            (f"  CPU per record, raw, {what}", "µs", best[name][1].per_record(count)),
        ]
    engine, engine_cpu, _ = best["engine"]
    rows += [
        (
            "ClickHouse alone: parse the raw rows (Null tables)",
            f"{engine:,.0f} rows/s",
            f"{engine / best['raw'][0]:.0%} of raw, {spread('engine')}; a bound on roles "
            "all and store here (one insert thread feeds it)",
        ),
        (
            "  CPU per row, ClickHouse alone",
            "µs",
            f"{(engine_cpu.flow + engine_cpu.rest) * 1e6 / n:.1f}",
        ),
    ]
    for role, count, raw in roles:
        got, cpu, start = best[role.value]
        rows += [
            (
                f"flow, role {role.value} (one process)",
                f"{got:,.0f} records/s",
                f"{got / best[raw][0]:.0%} of raw, {spread(role.value)}; "
                f"first record read after {start:.2f} s",
            ),
            (f"  CPU per record, role {role.value}", "µs", cpu.per_record(count)),
        ]
    rss1 = _rss_mb()
    # latency: a paced producer while the flow (role all) runs
    paced = list(build("healthy", scale=scale, seed=1, steps=max(2, steps), now=True).records())
    total = min(len(paced), int(rate * seconds))
    pub2 = KafkaPublisher(producer_config(settings.kafka, boot), topics2)

    def produce() -> None:
        start = time.perf_counter()
        for i, rec in enumerate(paced[:total]):
            pub2.publish(rec)
            if i % 1000 == 0:
                lag = i / rate - (time.perf_counter() - start)
                if lag > 0:
                    time.sleep(lag)
                pub2._producer.poll(0)
        pub2.flush()

    probe2 = _Probe()
    th = threading.Thread(target=produce, daemon=True)
    th.start()
    _flow(settings, stack, topics2, probe2, database, idle_s=3.0)  # latency only
    th.join()
    rss2 = _rss_mb()
    rows += [
        (f"latency p50 at {rate:,} records/s (role all)", f"{probe2.percentile(50):,.0f} ms", ""),
        (f"latency p99 at {rate:,} records/s (role all)", f"{probe2.percentile(99):,.0f} ms", ""),
        ("records through the paced run", f"{probe2.n:,} of {total:,}", ""),
        ("resident memory once 25% / 50% / 100% were stored", *probe2.rss_row()),
        (
            "peak RSS after the bulk runs / after paced run",
            f"{rss1:,.0f} / {rss2:,.0f} MB",
            f"before: {rss0:,.0f} MB",
        ),
    ]
    return rows


def simulate(scales: list[str], steps: int, say: Callable[[str], None]) -> None:
    """Generation throughput per scale: the columnar engine, records, and encoded bytes."""
    from producers.sim.emit import Emitter
    from producers.sim.engine import Engine
    from producers.sim.scenarios import scale_spec
    from schemas.codec import encode

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
    from schemas.records import StepSummary

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
        f"{len(route.comms):,} communicators; after {warm} steps the job receives "
        f"{(to_job - at_warm[1]) / steady:,.0f} items per step ({to_job / n:,.0f} over all)"
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


__all__ = ["analyze", "pipeline", "simulate"]


def collector(calls: int, say: Callable[[str], None]) -> None:
    """Cost of the PyTorch collector per call, in this process (a one-rank Gloo group)."""
    import socket

    import torch
    import torch.distributed as dist

    from producers.torch_collector import Collector
    from schemas.codec import encode

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
