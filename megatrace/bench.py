"""``megatrace bench pipeline``: raw consume+decode vs the dataflow in each role, and latency.

Composition only: the simulator makes the records, the publisher sends them,
the flow processes them; this module times the three and prints a table.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

from detectors.align import core_name as align_core
from detectors.rank_figures import core_name as figures_core
from flows.decode import Decoded, rows_of
from flows.flow_config import Role, flow_config
from flows.main import build_flow
from infra.clickhouse import Rows, init_db, insert_rows
from infra.kafka import consumer_config, delete_topics, ensure_topics, producer_config
from infra.rowbinary import core_name as rows_core
from infra.stack import Stack
from megatrace.bench_meters import Cpu, Probe, cpu_meter, rss_mb
from megatrace.cli_base import tune_gc
from producers.publish import KafkaPublisher
from producers.sim.scenarios import build
from schemas.codec import decode, encode
from schemas.config import Settings
from schemas.topics import Topics


def _raw_consume(
    settings: Settings, stack: Stack, topics: list[str], n: int
) -> tuple[float, Cpu, float]:
    """Records/s of a bare consumer that decodes each record, the CPU it took, and the
    seconds until its first record (counted apart, as the flow's start-up is)."""
    from confluent_kafka import Consumer, TopicPartition

    cpu = cpu_meter(stack)
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
) -> tuple[float, Cpu, float]:
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
    cpu = cpu_meter(stack)
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
) -> tuple[float, Cpu, float]:
    """One bounded flow of ``role`` over ``n`` records: as :func:`_raw_consume` measures."""
    busy, start, cpu = _flow(settings, stack, topics, None, database, role=role)
    return n / busy, cpu, start


def _flow(
    settings: Settings,
    stack: Stack,
    topics: Topics,
    probe: Probe | None,
    database: str,
    idle_s: float = 2.0,
    role: Role = Role.ALL,
) -> tuple[float, float, Cpu]:
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
    spent = cpu_meter(stack)
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
        f"{settings.kafka.partitions} partitions per topic; alignment core: {align_core()}; "
        f"per-rank figures: {figures_core()}; rows: {rows_core()}"
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
    measures: dict[str, Callable[[], tuple[float, Cpu, float]]] = {
        "raw": functools.partial(_raw_consume, settings, stack, list(topics.inputs), n),
        "raw detect": functools.partial(_raw_consume, settings, stack, detect_topics, n_detect),
        "engine": functools.partial(_engine_alone, settings, stack, database, raw_rows),
    }
    roles = ((Role.ALL, n, "raw"), (Role.STORE, n, "raw"), (Role.DETECT, n_detect, "raw detect"))
    for role, count, _ in roles:
        measures[role.value] = functools.partial(
            _flow_rate, settings, stack, topics, database, role, count
        )
    runs: dict[str, list[tuple[float, Cpu, float]]] = {name: [] for name in measures}
    rss0 = rss_mb()
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
    rss1 = rss_mb()
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

    probe2 = Probe()
    th = threading.Thread(target=produce, daemon=True)
    th.start()
    _flow(settings, stack, topics2, probe2, database, idle_s=3.0)  # latency only
    th.join()
    rss2 = rss_mb()
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


__all__ = ["pipeline"]
