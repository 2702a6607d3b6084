"""The ``megatrace`` command: parses argv, loads settings, composes the pieces.

No domain logic lives here; each command calls into ``infra``, ``producers``,
``flows`` or ``detectors``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import msgspec

from schemas.config import ConfigError, Settings, config_file_path, load_settings


class _Ctx:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def stack(self):
        from infra.stack import Stack

        return Stack(self.settings)


def _overrides(**flags: Any) -> dict[str, Any]:
    """Command-line flags as a settings layer (only the flags that were given)."""
    layer: dict[str, Any] = {}
    mapping = {
        "bootstrap_servers": ("kafka", "bootstrap_servers"),
        "partitions": ("kafka", "partitions"),
        "topic_prefix": ("kafka", "topic_prefix"),
        "clickhouse_url": ("clickhouse", "url"),
        "database": ("clickhouse", "database"),
        "retention_days": ("clickhouse", "retention_days"),
        "state_dir": ("stack", "state_dir"),
    }
    for name, value in flags.items():
        if value is not None:
            section, key = mapping[name]
            layer.setdefault(section, {})[key] = value
    return layer


class _Commands(click.Group):
    """The command group: an error the user can act on (ClickHouse unreachable or refusing,
    the local stack not running) ends the command with its one line, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from infra.clickhouse import ClickHouseError
        from infra.stack import StackNotRunning

        try:
            return super().invoke(ctx)
        except (ClickHouseError, StackNotRunning) as e:
            raise click.ClickException(str(e)) from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--bootstrap-servers", help="Kafka bootstrap servers (default: the local stack).")
@click.option("--partitions", type=int, help="Partitions per topic when creating topics.")
@click.option("--topic-prefix", help="Prefix of every topic name.")
@click.option("--clickhouse-url", help="chdb:///DIR or http(s)://user:pass@host:port/db.")
@click.option("--database", help="ClickHouse database name.")
@click.option("--retention-days", type=int, help="TTL of every table in days (0: keep).")
@click.option("--state-dir", help="Local stack directory (broker files, embedded ClickHouse).")
@click.pass_context
def cli(ctx: click.Context, config_file: str | None, **flags: Any) -> None:
    """megatrace: find and localise hangs and slowdowns in distributed training.

    Settings precedence: defaults < config file (--config, $MEGATRACE_CONFIG or
    ./megatrace.toml) < environment (MEGATRACE_<SECTION>__<KEY>) < these flags.
    """
    env = dict(os.environ)
    try:
        path = config_file_path(config_file, env, Path.cwd())
        settings = load_settings(file=path, env=env, overrides=_overrides(**flags))
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    ctx.obj = _Ctx(settings)


# --------------------------------------------------------------------------- config / schema


@cli.group()
def config() -> None:
    """Inspect the effective configuration."""


@config.command("show")
@click.pass_obj
def config_show(obj: _Ctx) -> None:
    """Print the effective settings (secrets masked)."""
    click.echo(json.dumps(obj.settings.public(), indent=2))


@cli.group()
def schema() -> None:
    """The record schema for producers in other languages."""


@schema.command("export")
@click.option("--out", type=click.Path(dir_okay=False), help="Write to a file instead of stdout.")
def schema_export(out: str | None) -> None:
    """Print the JSON Schema of every record type."""
    from schemas.codec import json_schema

    text = json.dumps(json_schema(), indent=2)
    if out:
        Path(out).write_text(text)
        click.echo(f"wrote {out}")
    else:
        click.echo(text)


# --------------------------------------------------------------------------- stack / db


@cli.group()
def stack() -> None:
    """The local stack: Tansu broker, topics, embedded ClickHouse."""


@stack.command("up")
@click.pass_obj
def stack_up(obj: _Ctx) -> None:
    """Start the local broker (once), create topics and tables."""
    status, started = obj.stack().up()
    b = status.broker
    if b is not None:
        click.echo(
            f"broker {'started' if started else 'already running'}: "
            f"{b.bootstrap} (pid {b.pid}, log {b.log})"
        )
    else:
        click.echo(f"broker: external {obj.settings.kafka.bootstrap_servers}")
    click.echo(f"topics: {', '.join(status.topics)}")
    click.echo(
        f"clickhouse: {_redact(status.clickhouse_url)} "
        f"(database {obj.settings.clickhouse.database})"
    )


@stack.command("down")
@click.pass_obj
def stack_down(obj: _Ctx) -> None:
    """Stop the local broker this state directory started."""
    stopped = obj.stack().down()
    click.echo("broker stopped" if stopped else "no local broker was running")


@stack.command("status")
@click.pass_obj
def stack_status(obj: _Ctx) -> None:
    """Say whether the local broker runs and where everything is."""
    st = obj.stack().status()
    if st.broker:
        click.echo(f"broker: running at {st.broker.bootstrap} (pid {st.broker.pid})")
    else:
        click.echo("broker: not running")
    click.echo(f"clickhouse: {_redact(st.clickhouse_url)}")


def _redact(url: str) -> str:
    from schemas.config import redact_url

    return redact_url(url)


@cli.group()
def db() -> None:
    """ClickHouse schema management."""


@db.command("init")
@click.pass_obj
def db_init(obj: _Ctx) -> None:
    """Create the database and tables (idempotent)."""
    s = obj.stack()
    tables = s.init_db()
    click.echo(
        f"{_redact(s.clickhouse_url())}: {obj.settings.clickhouse.database} with "
        f"{len(tables)} tables ({', '.join(tables)})"
    )


@cli.command("deadletters")
@click.pass_obj
def deadletters(obj: _Ctx) -> None:
    """Count refused records per reason (from ClickHouse)."""
    from infra.queries import dead_letter_counts

    rows = dead_letter_counts(obj.stack().clickhouse(), obj.settings.clickhouse.database)
    for reason, n in rows:
        click.echo(f"{reason:>16}  {n}")
    if not rows:
        click.echo("no dead letters")


# --------------------------------------------------------------------------- flow


def _flow_config(obj: _Ctx, tail: bool, **overrides: Any):
    from flows.main import flow_config

    s = obj.stack()
    return flow_config(obj.settings, s.bootstrap(), s.clickhouse_url(), tail=tail, **overrides)


@cli.command("run")
@click.option("--once", is_flag=True, help="Stop when the topics stay quiet instead of tailing.")
@click.option(
    "--recovery-dir",
    type=click.Path(file_okay=False),
    help="Bytewax recovery store: a killed flow resumes from its last snapshot.",
)
@click.option(
    "--snapshot-s", default=5.0, show_default=True, help="Seconds between snapshots (epoch length)."
)
@click.option("--workers", default=1, show_default=True, help="Worker threads in this process.")
@click.option("--process-id", type=int, help="This process's index in a multi-process cluster.")
@click.option("--addresses", help="host:port of every process of the cluster, ';'-separated.")
@click.option("--quiet", is_flag=True, help="Do not print verdicts as they happen.")
@click.option(
    "--role",
    type=click.Choice(["all", "store", "detect"]),
    default="all",
    show_default=True,
    help="store: raw tables only; detect: analysis only (no kernel topic); all: both.",
)
@click.pass_obj
def run(
    obj: _Ctx,
    once: bool,
    recovery_dir: str | None,
    snapshot_s: float,
    workers: int,
    process_id: int | None,
    addresses: str | None,
    quiet: bool,
    role: str,
) -> None:
    """Run the dataflow against the configured broker and ClickHouse.

    Scale out with several processes (--process-id/--addresses) over partitioned
    topics; with the embedded ClickHouse each process needs its own directory.
    A large deployment runs --role store and --role detect clusters side by side
    (each with its own consumer position and recovery directory).
    """
    from datetime import timedelta

    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.run import cli_main  # what `python -m bytewax.run` calls

    from flows.main import Role, build_flow, input_topics, tune_gc

    if (process_id is None) != (addresses is None):
        raise click.UsageError("--process-id and --addresses go together")
    recovery = None
    if recovery_dir:
        path = Path(recovery_dir)
        if not path.exists():
            path.mkdir(parents=True)
            init_db_dir(path, 1)
        recovery = RecoveryConfig(path)
    cfg = _flow_config(obj, tail=not once)
    from infra.clickhouse import init_db
    from infra.kafka import KafkaSetupError, topic_partitions

    cfg = dataclasses.replace(cfg, role=Role(role), console=not quiet)
    try:  # what the source asks first, asked here: Bytewax would bury the error in a trace
        topic_partitions(cfg.consumer, input_topics(cfg))
    except KafkaSetupError as e:
        raise click.ClickException(str(e)) from None
    init_db(obj.stack().clickhouse(), cfg.database, obj.settings.clickhouse.retention_days)
    tune_gc()
    with _flow_errors_are_one_line():
        cli_main(
            build_flow(cfg),
            workers_per_process=workers,
            process_id=process_id,
            addresses=addresses.split(";") if addresses else None,
            epoch_interval=timedelta(seconds=snapshot_s),
            recovery_config=recovery,
        )


@cli.command("agent")
@click.option("--job", help="Job id stamped on records that carry none.")
@click.option("--node", help="Node name stamped on records that carry none (default: hostname).")
@click.option("--socket", "socket_path", help="Unix datagram socket local producers send to.")
@click.option("--tail", "tails", multiple=True, help="Glob of JSON-lines files to follow.")
@click.option(
    "--inspector",
    "inspectors",
    multiple=True,
    help="Glob of the NCCL Inspector's output files to follow (its NCCL_INSPECTOR_DUMP_DIR).",
)
@click.option("--spool-dir", help="On-disk queue of accepted, undelivered records.")
@click.option(
    "--spool-max-mb",
    type=click.IntRange(min=1),
    help="Spool bound (undelivered MiB); beyond it records are dropped.",
)
@click.option("--health-file", help="JSON file the agent writes its health to.")
@click.option("--health-interval-s", type=float, help="Seconds between health reports.")
@click.pass_obj
def agent(obj: _Ctx, **flags: Any) -> None:
    """The node agent: local producers -> spool -> Kafka, nothing lost on broker outages."""
    from infra.kafka import producer_config
    from producers.agent import NodeAgent
    from producers.spool import SpoolError

    many = ("tails", "inspectors")
    over = {k: (list(v) if k in many else v) for k, v in flags.items() if v not in (None, ())}
    if "tails" in over:
        over["tail"] = over.pop("tails")
    if "inspectors" in over:
        over["inspector"] = over.pop("inspectors")
    if "socket_path" in over:
        over["socket"] = over.pop("socket_path")
    try:
        cfg = msgspec.structs.replace(obj.settings.agent, **over)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    st = obj.stack()
    bootstrap = st.bootstrap()
    try:
        node_agent = NodeAgent(
            cfg,
            producer_config(obj.settings.kafka, bootstrap),
            st.topics,
            Path(obj.settings.stack.state_dir),
        )
    except SpoolError as e:
        raise click.ClickException(str(e)) from None
    cfg = node_agent.settings  # with its paths resolved
    done = _stop_on_signal()
    node_agent.start()
    click.echo(
        f"agent on {node_agent.node}: socket {cfg.socket}, tailing {list(cfg.tail) or 'nothing'}, "
        f"spool {cfg.spool_dir} (max {cfg.spool_max_mb} MiB), broker {bootstrap}",
        err=True,
    )
    while not done.wait(cfg.health_interval_s):
        h = node_agent.write_health()
        dead = [name for name, up in h.threads.items() if not up]
        click.echo(
            f"agent: in {h.accepted} out {h.delivered} refused {h.refused} dropped {h.dropped} "
            f"lost {h.lost} spool {h.spool_bytes / 2**20:.1f} MiB (undelivered "
            f"{h.pending_bytes / 2**10:.0f} KiB) broker {'up' if h.broker_up else 'DOWN'}"
            + (f"; UNHEALTHY: {', '.join(dead)} stopped ({h.last_error})" if dead else ""),
            err=True,
        )
    node_agent.stop()
    h = node_agent.snapshot()
    click.echo(
        f"agent stopped: in {h.accepted} out {h.delivered} dropped {h.dropped} lost {h.lost}",
        err=True,
    )


def _publish(
    obj: _Ctx, records: Any, label: str, first_offsets: dict[str, int] | None = None
) -> int:
    """Publish records to the configured broker with a progress bar; return how many.

    ``first_offsets``, if given, receives where the records begin in each partition
    they went to (the flow's ``start_offsets``)."""
    from flows.kafka_source import part_name
    from infra.kafka import producer_config
    from producers.publish import KafkaPublisher

    s = obj.stack()
    pub = KafkaPublisher(producer_config(obj.settings.kafka, s.bootstrap()), s.topics)
    n = 0
    with click.progressbar(length=0, label=label, show_pos=True) as bar:
        for rec in records:
            pub.publish(rec)
            n += 1
            if n % 5000 == 0:
                bar.update(5000)
        bar.update(n % 5000)
    pub.flush()
    if first_offsets is not None:
        first_offsets.update({part_name(*tp): off for tp, off in pub.first_offsets.items()})
    return n


@cli.command("scenarios")
def scenarios() -> None:
    """List the simulator's scenarios and scales."""
    from producers.sim.scenarios import SCALES, SCENARIOS

    for name, sdef in SCENARIOS.items():
        click.echo(f"{name:<18} {sdef.description} ({sdef.steps} steps)")
    click.echo(
        "scales: "
        + ", ".join(
            f"{n} (tp{tp} pp{pp} dp{dp} = {tp * pp * dp} ranks)"
            for n, (tp, pp, dp, *_rest) in SCALES.items()
        )
    )


@cli.command("simulate")
@click.option("--scenario", default="story", show_default=True)
@click.option("--scale", default="tiny", show_default=True)
@click.option("--tp", type=int)
@click.option("--pp", type=int)
@click.option("--dp", type=int)
@click.option("--ep", type=int, help="Expert parallelism (MoE AllToAll); must divide dp.")
@click.option(
    "--cp", type=int, help="Context parallelism (keys/values gathered per layer); ranks x cp."
)
@click.option("--steps", type=int, help="Iterations (default: the scenario's).")
@click.option("--seed", default=0, show_default=True)
@click.option("--no-kernels", is_flag=True, help="Leave out CUPTI kernel records.")
@click.option("--to", "to", default="kafka", show_default=True, help="'kafka' or a directory.")
@click.option("--paced", is_flag=True, help="Publish at the pace of the timestamps.")
@click.option("--speed", default=1.0, show_default=True, help="Pace multiplier with --paced.")
@click.pass_obj
def simulate(
    obj: _Ctx,
    scenario: str,
    scale: str,
    tp: int | None,
    pp: int | None,
    dp: int | None,
    ep: int | None,
    cp: int | None,
    steps: int | None,
    seed: int,
    no_kernels: bool,
    to: str,
    paced: bool,
    speed: float,
) -> None:
    """Simulate a training job with injected faults; publish it or write it to files."""
    from producers.publish import paced_by_time
    from producers.sim.scenarios import build
    from schemas.codec import write_jsonl

    over = {k: v for k, v in {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}.items() if v}
    if no_kernels:
        over["kernels"] = False
    try:
        run = build(scenario, scale=scale, seed=seed, steps=steps, now=True, **over)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    sp = run.spec
    click.echo(
        f"job {sp.job}: {sp.world_size} ranks (tp{sp.tp} pp{sp.pp} dp{sp.dp}"
        f"{f' ep{sp.ep}' if sp.ep > 1 else ''}{f' cp{sp.cp}' if sp.cp > 1 else ''}) on "
        f"{sp.num_nodes} nodes, {run.steps} steps, faults: {run.faults or 'none'}"
    )
    records = paced_by_time(run.records(), speed) if paced else run.records()
    t0 = time.monotonic()
    if to == "kafka":
        n = _publish(obj, records, "publishing")
    else:
        out = Path(to)
        out.mkdir(parents=True, exist_ok=True)
        n = write_jsonl(out / "records.jsonl", records)
        write_jsonl(out / "labels.jsonl", run.labels)
        click.echo(f"wrote {out / 'records.jsonl'} and {out / 'labels.jsonl'}")
    dt = time.monotonic() - t0
    click.echo(f"{n} records in {dt:.1f}s ({n / dt:,.0f} records/s)")
    for lab in run.labels:
        click.echo(
            f"  truth: {lab.kind.value} {lab.cause.value} rank={lab.rank} "
            f"node={lab.node} link={lab.link} step={lab.onset_step} "
            f"cost={lab.throughput_cost:.0%}"
        )


@cli.group("import")
def import_() -> None:
    """Import records from real sources (one-shot)."""


@import_.command("kineto")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--job", required=True, help="Job id to give the records.")
@click.option("--node", default="unknown", show_default=True, help="Host the traces came from.")
@click.option(
    "--to", "to", default="kafka", show_default=True, help="'kafka' or a JSON-lines file."
)
@click.pass_obj
def import_kineto(obj: _Ctx, paths: tuple[str, ...], job: str, node: str, to: str) -> None:
    """PyTorch profiler (Kineto) traces: CUPTI kernels and NCCL kernel metadata."""
    from producers.kineto import TraceError, read_kineto
    from schemas.codec import write_jsonl

    def records():
        for p in paths:
            yield from read_kineto(Path(p), job=job, node=node)

    try:
        if to == "kafka":
            n = _publish(obj, records(), "publishing")
        else:
            n = write_jsonl(Path(to), records())
    except TraceError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{n} records from {len(paths)} trace(s)")


@import_.command("megatrace-logs")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--config",
    "megatron_config",
    type=click.Path(exists=True),
    help="Megatron's arguments (JSON, YAML, a text of --flags, its training log) or the "
    "MEGATRACE analyser's config.yaml; by default the training log or config.yaml found in "
    "DIRECTORY.",
)
@click.option("--job", required=True, help="Job id to give the records.")
@click.option("--world-size", type=int, help="If the configuration does not say.")
@click.option(
    "--to",
    default="kafka",
    show_default=True,
    help="'kafka', or a JSON-lines file for `megatrace analyze`.",
)
@click.option("--follow", is_flag=True, help="Keep tailing the growing logs (to Kafka).")
@click.pass_obj
def import_megatrace_logs(
    obj: _Ctx,
    directory: str,
    megatron_config: str | None,
    job: str,
    world_size: int | None,
    to: str,
    follow: bool,
) -> None:
    """A run of the original MEGATRACE collector as it leaves it: per-rank call logs (any
    variant), per-NIC throughput CSVs, Megatron's training log (its iteration clock);
    other files and lines are skipped and named."""
    from producers.megatrace_logs import MegatraceLogReader
    from producers.megatrace_run import RunReport, follow_dir, import_dir, survey
    from producers.megatron_config import (
        ConfigFormatError,
        config_from_arguments,
        read_megatron_config,
        read_training_log,
    )
    from schemas.codec import write_jsonl

    report = RunReport()
    try:
        cfg = read_megatron_config(Path(megatron_config), world_size) if megatron_config else None
        if follow:
            if to != "kafka":
                raise click.UsageError("--follow publishes to Kafka (leave --to out)")
            from infra.kafka import producer_config
            from producers.publish import KafkaPublisher

            if cfg is None:  # the training log's arguments, or a config.yaml beside the logs
                files = survey(Path(directory), RunReport())
                if files.training is not None:
                    args = read_training_log(files.training).arguments
                    cfg = config_from_arguments(args, str(files.training), world_size)
                elif files.configs:
                    cfg = read_megatron_config(files.configs[0], world_size)
                else:
                    raise click.UsageError(
                        "no training log or config.yaml in the directory yet: give --config"
                    )
            st = obj.stack()
            pub = KafkaPublisher(producer_config(obj.settings.kafka, st.bootstrap()), st.topics)
            reader = MegatraceLogReader(cfg, job, eager=True)
            stopping = _stop_on_signal()
            click.echo(f"following {directory} (Ctrl-C to stop)", err=True)
            n = follow_dir(Path(directory), reader, pub.publish_all, stopping.is_set,
                           report=report)  # fmt: skip
            pub.flush()
        else:
            records, report = import_dir(Path(directory), cfg, job, world_size)
            n = (
                _publish(obj, records, "publishing")
                if to == "kafka"
                else write_jsonl(Path(to), records)
            )
    except ConfigFormatError as e:
        raise click.ClickException(str(e)) from None
    what = "call lines" if follow else "records"
    click.echo(f"{n:,} {what} from {report.call_logs or 'the'} call logs in {directory}")
    for line in report.lines_out():
        click.echo(f"  {line}")


@contextlib.contextmanager
def _flow_errors_are_one_line() -> Iterator[None]:
    """A flow that stopped for a reason the user can act on - its broker stayed away
    (:class:`BrokerLost`), ClickHouse could not take its inserts (:class:`SinkError`) -
    ends the command with that one line: Bytewax wraps the error, and reports it first
    as a panic of its worker, which is held back (:mod:`megatrace.stderr`) and printed
    only for other errors."""
    from flows.kafka_source import BrokerLost
    from flows.sinks import SinkError
    from megatrace.stderr import panic_filter, release

    error: BaseException | None = None
    with panic_filter() as held:
        try:
            yield
        except Exception as e:
            error = e
    cause = error
    while cause is not None and not isinstance(cause, BrokerLost | SinkError):
        cause = cause.__cause__ or cause.__context__
    release(held, explained=cause is not None)
    if cause is not None:
        raise click.ClickException(str(cause)) from None
    if error is not None:
        raise error


def _stop_on_signal():
    import signal
    import threading

    event = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: event.set())
    return event


@import_.command("nccl-inspector")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--job", required=True, help="Job id to give the records.")
@click.option(
    "--to", "to", default="kafka", show_default=True, help="'kafka' or a JSON-lines file."
)
@click.pass_obj
def import_nccl_inspector(obj: _Ctx, paths: tuple[str, ...], job: str, to: str) -> None:
    """The NCCL Inspector's JSON output (files, or directories of them): collectives,
    transfers and proxy operations of every rank, for jobs that run the Inspector."""
    from producers.nccl_inspector import InspectorFormatError, import_files
    from schemas.codec import write_jsonl

    try:
        records, reader = import_files(map(Path, paths), job)
    except InspectorFormatError as e:
        raise click.ClickException(str(e)) from None
    n = _publish(obj, records, "publishing") if to == "kafka" else write_jsonl(Path(to), records)
    click.echo(f"{n:,} records from the Inspector's output")
    for why, count in sorted(reader.skipped.items()):
        click.echo(f"  skipped: {why} ({count:,})")
    if reader.dropped:
        click.echo(f"  the Inspector overwrote {reader.dropped:,} operations before dumping them")
    if reader.numbered:
        click.echo(
            "  inferred: ranks numbered by host and process id (no communicator holds every "
            "process, and the Inspector names no global rank)"
        )


@import_.command("flight-recorder")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--job", required=True, help="Job id to give the records.")
@click.option(
    "--config",
    "megatron_config",
    type=click.Path(exists=True),
    help="Megatron arguments (JSON, YAML or --flags): places the hang in the schedule.",
)
@click.option(
    "--to",
    default="kafka",
    show_default=True,
    help="'kafka', or a JSON-lines file for `megatrace analyze`.",
)
@click.pass_obj
def import_flight_recorder(
    obj: _Ctx, paths: tuple[str, ...], job: str, megatron_config: str | None, to: str
) -> None:
    """PyTorch Flight Recorder dumps (one file per rank, or a directory of them)."""
    from producers.flight_recorder import DumpFormatError, import_dumps
    from producers.megatron_config import ConfigFormatError as LogFormatError
    from producers.megatron_config import read_megatron_config
    from schemas.codec import write_jsonl

    files = [f for p in map(Path, paths) for f in (sorted(p.iterdir()) if p.is_dir() else [p])]
    try:
        cfg = read_megatron_config(Path(megatron_config)) if megatron_config else None
        records, skipped = import_dumps(files, job, cfg)
    except (DumpFormatError, LogFormatError) as e:
        raise click.ClickException(str(e)) from None
    n = _publish(obj, records, "publishing") if to == "kafka" else write_jsonl(Path(to), records)
    click.echo(f"{n} records from {len(files)} dump(s)")
    for what, count in sorted(skipped.items()):
        click.echo(f"  skipped: {what} ({count} entries)")


@cli.command("build-plugin")
@click.option(
    "--out",
    default="build",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for libmegatrace_nccl_profiler.so.",
)
def build_plugin(out: str) -> None:
    """Compile the NCCL profiler plugin (system C compiler; no NCCL headers or GPU needed)."""
    from producers.nccl_plugin import PluginBuildError, build

    try:
        lib = build(Path(out))
    except PluginBuildError as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(lib.resolve()))
    click.echo(f"use it with: NCCL_PROFILER_PLUGIN={lib.resolve()} (and a node agent running)")


@cli.command("gpu-check")
@click.option(
    "--out",
    default="gpu-check",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for the records, raw CUPTI activity, NCCL logs and summary.json.",
)
def gpu_check(out: str) -> None:
    """Smoke-test this GPU node: live CUPTI, the NCCL plugin under the real NCCL, the
    PyTorch collector on a GPU, and what CUPTI costs (needs a GPU, PyTorch, cupti-python)."""
    from producers.gpu_check import GpuCheckError, report, run_checks

    try:
        checks = run_checks(Path(out), progress=lambda m: click.echo(m, err=True))
    except GpuCheckError as e:
        raise click.ClickException(str(e)) from None
    click.echo(report(checks))
    if not all(c.ok for c in checks):
        raise SystemExit(1)


@cli.command("analyze")
@click.argument("path", type=click.Path(exists=True))
@click.option(
    "--json", "as_json", is_flag=True, help="Every verdict revision, one per line, as JSON."
)
def analyze(path: str, as_json: bool) -> None:
    """Run the detectors over recorded records: a JSON-lines file, a folder holding one
    (`megatrace simulate`, `megatrace lab`), or a run of the original MEGATRACE collector
    read in place (as `megatrace import megatrace-logs` reads it; its job: the folder's
    name)."""
    from detectors.console import IncidentLog
    from detectors.replay import Replay
    from detectors.route import POLL
    from producers.megatron_config import ConfigFormatError
    from schemas.codec import SchemaError, read_jsonl, verdict_json
    from schemas.records import Verdict

    p = Path(path)
    log = IncidentLog()
    replay = Replay(poll=POLL)  # batched as the flow batches its polls
    try:
        if p.is_dir() and not (p / "records.jsonl").exists():
            from producers.megatrace_run import import_dir

            records, report = import_dir(p, None, p.resolve().name)
            for line in report.lines_out():
                click.echo(f"  {line}", err=True)
        else:
            records = read_jsonl(p / "records.jsonl" if p.is_dir() else p, inputs=True)
        for out in replay.run(records):
            if not isinstance(out, Verdict):
                continue
            if as_json:  # every revision, as the verdicts table keeps them
                click.echo(json.dumps(verdict_json(out)))
            elif (line := log.update(out)) is not None:
                click.echo(line)
    except (SchemaError, ConfigFormatError) as e:
        raise click.ClickException(str(e)) from None
    if not as_json:
        click.echo("")
        for line in log.summary():
            click.echo(line)


@cli.command("demo")
@click.option("--scenario", default="story", show_default=True)
@click.option("--scale", default="demo", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.pass_obj
def demo(obj: _Ctx, scenario: str, scale: str, seed: int) -> None:
    """The main job: a simulated cluster with injected faults, end to end on the local stack."""
    from bytewax.testing import run_main

    from detectors.console import summary_table
    from detectors.texts import plural
    from flows.main import build_flow, tune_gc
    from infra.clickhouse import insert_records, read_records
    from infra.queries import align_account, step_account
    from producers.sim.scenarios import build

    s = obj.stack()
    s.up()
    click.echo(f"[1/4] stack up: broker {s.bootstrap()}, clickhouse {_redact(s.clickhouse_url())}")
    # a job id of its own per run, so a second demo on the same stack stands alone
    job = f"{scenario}-{scale}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = build(scenario, scale=scale, seed=seed, now=True, job=job)
    sp = run.spec
    click.echo(
        f"[2/4] simulating {sp.job}: {sp.world_size} ranks (tp{sp.tp} pp{sp.pp} "
        f"dp{sp.dp}) on {sp.num_nodes} nodes, {run.steps} steps, "
        f"{len(run.faults)} injected faults"
    )
    # the flow reads this run's records only (the local broker keeps earlier demos' too)
    starts: dict[str, int] = {}
    n = _publish(obj, run.records(), "      publishing", starts)
    click.echo(f"      {n:,} records published")
    client = s.clickhouse()
    db_name = obj.settings.clickhouse.database
    insert_records(client, db_name, run.labels)
    click.echo("[3/4] dataflow: decode -> align -> analyse -> ClickHouse (verdicts as they come)")
    t0 = time.monotonic()
    tune_gc()
    polls: list[int] = []  # records per poll
    with _flow_errors_are_one_line():
        run_main(
            build_flow(_flow_config(obj, tail=False, start_offsets=starts, on_read=polls.append))
        )
    click.echo(f"      done in {time.monotonic() - t0:.1f} s ({sum(polls):,} records read)")
    click.echo("[4/4] verdicts in ClickHouse beside the injected ground truth:")
    verdicts = list(
        read_records(
            client, db_name, "verdicts", "job = {j:String}", {"j": sp.job}, order_by="onset_ns"
        )
    )
    click.echo("  injected:")
    for lab in run.labels:
        where = lab.link or (f"rank {lab.rank}" if lab.rank is not None else lab.node)
        kind, cause = lab.kind.value.replace("_", " "), lab.cause.value.replace("_", " ")
        click.echo(
            f"    {kind} of {where} ({cause}) from step {lab.onset_step}, "
            f"cost {lab.throughput_cost:.0%}"
        )
    click.echo("  found:")
    for line in summary_table(verdicts):
        click.echo(f"    {line}")
    st = step_account(client, db_name, sp.job)
    click.echo(
        f"  {plural(st.steps, 'step')} analysed (mean {st.mean_ms} ms; {st.cut:,} closed "
        f"without some of their collectives, {plural(st.after_close, 'collective')} came after "
        f"their step closed); query them in {_redact(s.clickhouse_url())} database {db_name}"
    )
    al = align_account(client, db_name, sp.job)
    click.echo(
        f"  alignment: {plural(al.records, 'collective record')} on "
        f"{plural(al.comms, 'communicator')}, {al.late:,} late, {al.out_of_order:,} out of "
        f"order, {plural(al.partial, 'collective')} reported partial"
    )
    from megatrace.report import write_report

    page = write_report(client, db_name, sp.job, Path(obj.settings.stack.state_dir) / "reports")
    click.echo(f"  report with pictures: {page}")
    click.echo(
        "  the local stack stays up for queries and reports (`megatrace stack status`); "
        "`megatrace stack down` stops it"
    )


@cli.command("report")
@click.option("--job", required=True, help="The job to report on.")
@click.option(
    "--out", default=None, help="Directory for the HTML and PNGs (default: <state-dir>/reports)."
)
@click.pass_obj
def report(obj: _Ctx, job: str, out: str | None) -> None:
    """One self-contained HTML file (and PNGs) about a job, from ClickHouse."""
    from megatrace.report import ReportError, write_report

    out_dir = Path(out) if out else Path(obj.settings.stack.state_dir) / "reports"
    try:
        page = write_report(
            obj.stack().clickhouse(),
            obj.settings.clickhouse.database,
            job,
            out_dir,
            say=click.echo,
        )
    except ReportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"report: {page}")


@cli.command("eval")
@click.option("--scale", "scales", multiple=True, default=["tiny"], show_default=True)
@click.option("--seeds", default=3, show_default=True, help="Seeds per scenario.")
@click.option("--scenario", "names", multiple=True, help="Only these scenarios.")
@click.option(
    "--corpus",
    "corpora",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A folder of labelled recordings (one folder per case with records.jsonl and "
    "labels.jsonl, as `megatrace lab` leaves them); repeatable.",
)
@click.option(
    "--simulator/--no-simulator",
    default=True,
    show_default=True,
    help="Score the simulator's catalogue too.",
)
@click.option(
    "--baselines/--no-baselines",
    default=True,
    show_default=True,
    help="Also score the peers' rules (HTA, NVRx, Flight Recorder, fixed threshold).",
)
@click.option("--ep", default=1, show_default=True, help="Expert parallelism of every job.")
@click.option("--cp", default=1, show_default=True, help="Context parallelism of every job.")
@click.option(
    "--heartbeat-p2p/--no-heartbeat-p2p",
    default=True,
    show_default=True,
    help="Heartbeats count transfers too (the PyTorch collector's); without, they count "
    "collectives only (the NCCL plugin's).",
)
@click.option(
    "--pp-group-comm",
    is_flag=True,
    help="Pipeline transfers on the pipeline group's communicator (batched sends), not on a "
    "communicator per pair of stages.",
)
def evaluate(
    scales: tuple[str, ...],
    seeds: int,
    names: tuple[str, ...],
    corpora: tuple[Path, ...],
    simulator: bool,
    baselines: bool,
    ep: int,
    cp: int,
    heartbeat_p2p: bool,
    pp_group_comm: bool,
) -> None:
    """Detection quality, megatrace beside its peers: on the simulator's labelled catalogue
    and on folders of labelled recordings (real jobs: the lab's, or any kept)."""
    from megatrace import evaluate as ev

    shape = {"ep": ep, "cp": cp, "heartbeat_p2p": heartbeat_p2p, "pp_group_comm": pp_group_comm}

    def said(name: str) -> None:
        if not sys.stderr.isatty():  # the bar only draws on a terminal: say each run
            click.echo(f"  {name}", err=True)

    if simulator:
        todo, make = ev.simulated(scales, names, seeds, shape, kernels=baselines)
        with click.progressbar(
            todo, label="scenarios", item_show_func=lambda x: x and f"{x[0]} {x[1]} seed {x[2]}"
        ) as bar:
            res = ev.score((make(x) for x in bar), baselines, said)
        click.echo("\n# simulator")
        for line in res.tables():
            click.echo(line)
    for root in corpora:
        try:
            cases = list(ev.corpus(root))
        except FileNotFoundError as e:
            raise click.ClickException(str(e)) from None
        res = ev.score(cases, baselines, said)
        click.echo(f"\n# corpus {root} ({len(cases)} cases)")
        for line in res.tables():
            click.echo(line)


@cli.command("lab")
@click.option("--case", "names", multiple=True, help="Only these cases (default: all).")
@click.option("--quick", is_flag=True, help="The CI subset: a slow link, a slow rank, a hang, "
              "a healthy run.")  # fmt: skip
@click.option("--list", "listing", is_flag=True, help="List the cases and stop.")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Where each case's labelled recording goes (default: <state-dir>/lab-runs).",
)
@click.option("--baselines/--no-baselines", default=True, show_default=True)
@click.option("--cleanup", is_flag=True, help="Remove what a crashed lab left (namespaces, "
              "links, qdiscs, cgroups) and stop.")  # fmt: skip
@click.pass_obj
def lab(obj: _Ctx, names: tuple[str, ...], quick: bool, listing: bool, out: str | None,
        baselines: bool, cleanup: bool) -> None:  # fmt: skip
    """Real distributed jobs (Gloo, CPU) on network-namespace nodes, faults injected by
    the operating system, scored like the simulator (needs root and PyTorch)."""
    from infra.netlab import LabError
    from infra.netlab import cleanup as lab_cleanup
    from megatrace.lab import CASES, QUICK

    state = Path(obj.settings.stack.state_dir) / "lab"
    if cleanup:
        removed = lab_cleanup(state)
        click.echo(f"removed: {', '.join(removed)}" if removed else "nothing to remove")
        return
    if listing:
        for name, c in CASES.items():
            faults = ", ".join(f"{f.kind} of {f.target}" for f in c.faults) or "healthy"
            click.echo(f"{name:<24} {c.workload:<9} {c.ranks} ranks, {faults}")
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        raise click.ClickException(
            "the lab runs real PyTorch jobs: pip install torch==2.13.0 (the CPU build)"
        ) from None
    from megatrace.lab_run import run_lab, table

    chosen = list(names) or (list(QUICK) if quick else list(CASES))
    out_dir = Path(out) if out else Path(obj.settings.stack.state_dir) / "lab-runs"
    t0 = time.monotonic()
    try:
        runs = run_lab(obj.settings, chosen, out_dir, click.echo)
    except LabError as e:
        raise click.ClickException(str(e)) from None
    for line in table(runs, baselines):
        click.echo(line)
    click.echo(f"\n{len(runs)} cases in {time.monotonic() - t0:.0f} s; recordings in {out_dir}")


@cli.group()
def bench() -> None:
    """Benchmarks that print tables."""


@bench.command("codec")
@click.option("--records", default=200_000, show_default=True)
def bench_codec(records: int) -> None:
    """Decode throughput of json, orjson and msgspec on collective records."""
    from schemas.bench import codec_table

    for line in codec_table(records):
        click.echo(line)


@bench.command("pipeline")
@click.option("--steps", default=8, show_default=True, help="Iterations of the healthy job.")
@click.option("--scale", default="small", show_default=True)
@click.option("--rate", default=20_000, show_default=True, help="Records/s of the paced run.")
@click.option("--seconds", default=10.0, show_default=True, help="Length of the paced run.")
@click.option(
    "--repeat",
    default=3,
    type=click.IntRange(min=1),
    show_default=True,
    help="Runs of each throughput measure; the best is reported, beside the range.",
)
@click.pass_obj
def bench_pipeline(obj: _Ctx, **options: Any) -> None:
    """Raw consume+decode vs the full dataflow, and end-to-end latency, on this machine."""
    from megatrace.bench import pipeline

    pipeline(obj.settings, say=click.echo, **options)


@bench.command("faults")
@click.option("--lines", default=20_000, show_default=True, help="Hostile input lines.")
@click.option("--spool-trials", default=300, show_default=True, help="Spool damage trials.")
@click.option("--kills", default=3, show_default=True, help="kill -9 of the flow, then resumed.")
@click.option("--pills", default=200, show_default=True, help="Poison pills among a job's records.")
@click.option("--seed", default=0, show_default=True)
@click.pass_obj
def bench_faults(obj: _Ctx, **options: Any) -> None:
    """Hostile input and faults against the real components: what was tried, survived,
    lost and duplicated."""
    from megatrace.faults import faults

    rows = faults(obj.settings, say=click.echo, **options)
    if any(r.lost or r.survived < r.tried for r in rows):
        raise SystemExit(1)


@bench.command("collector")
@click.option("--calls", default=20_000, show_default=True)
def bench_collector(calls: int) -> None:
    """Overhead of the PyTorch collector per torch.distributed call."""
    from megatrace.bench import collector

    collector(calls, click.echo)


@bench.command("plugin")
@click.option("--events", default=200_000, show_default=True, help="Proxy-step state changes.")
def bench_plugin(events: int) -> None:
    """Cost per event of the NCCL profiler plugin's hot path (C, called as NCCL calls it)."""
    from megatrace.bench import plugin

    plugin(events, click.echo)


@bench.command("simulate")
@click.option(
    "--scale",
    "scales",
    multiple=True,
    default=["tiny", "small", "medium", "large"],
    show_default=True,
)
@click.option("--steps", default=2, show_default=True)
def bench_simulate(scales: tuple[str, ...], steps: int) -> None:
    """Simulator generation throughput per scale (one core)."""
    from megatrace.bench import simulate as sim_bench

    sim_bench(list(scales), steps, click.echo)


@bench.command("analyze")
@click.option("--scale", default="large", show_default=True)
@click.option("--steps", default=8, show_default=True)
def bench_analyze(scale: str, steps: int) -> None:
    """Detector cost per training step at a scale (4,096 ranks by default)."""
    from megatrace.bench import analyze as analyze_bench

    analyze_bench(scale, steps, click.echo)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
